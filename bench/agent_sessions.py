"""Multi-turn agent sessions in the simulator: drafters compared on the same sessions, session update cost.

The sessions are synthetic but built from real text (GSM8K and HumanEval, read
from their PyPI packages by bench/offline_data.py) in the shape agent loops have:
every request's prompt is the previous prompt + the model's output + new
messages (tool results, user turns), in Qwen's chat format.

  code    a coding agent works through HumanEval tasks in one repository: it
          writes each function (some with a planted bug), runs the tests, reads
          the failure, rewrites the function, and now and then re-reads the
          whole file. Sessions grow to ~50k+ tokens.
  react   a ReAct agent solves GSM8K problems one after another with a
          calculator tool: one turn per calculation (the answer's <<a*b=c>>
          annotations), the observation as the next message.

The assistant outputs are scripted from the data (not sampled from a model), so
the acceptance figures measure drafting on this workload, not on a model's own
outputs. Token ids come from the Qwen2.5 tokenizer when its GGUF file is in
~/.cache/thinkahead/models (converted once and cached as a tokenizer directory
under ~/.cache/thinkahead/tokenizers), else from a deterministic word tokenizer.

Every drafter replays the same sessions in the same run (`replay_sessions`,
greedy acceptance against the recorded outputs, drafts of up to --max-draft
tokens, one bonus token per verify step), with session reuse on: it changes
only the update cost, never a draft (tests/test_sessions.py). The caches keep
their defaults (global tree depth 64, request and session trees depth 32);
"combined-depth-64" is the combined drafter with request and session trees of
depth 64 as well: twice the tree upkeep per token. Then the per-turn cache update at 45k-60k-token prompts
is timed on the same turns for a continued session (the full prompt with fresh
int objects; the full prompt sharing the agent's token objects; only the new
tokens through `SuffixCache.continue_session`) against a rebuild of the prompt.

Writes bench/results/agent_sessions.{json,md}. Run:
  python bench/agent_sessions.py             # about 2-3 minutes on a laptop core
  python bench/agent_sessions.py --quick     # a smoke run
"""

from __future__ import annotations

from pathlib import Path
import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_session_data import RecordedSession, build_sessions, load_tokenizer  # noqa: E402

from thinkahead.token_spec.drafters import CombinedDrafter, PromptLookupDrafter, SuffixDrafter  # noqa: E402
from thinkahead.token_spec.simulator import SessionReplayStats, replay_sessions  # noqa: E402
from thinkahead.token_spec.suffix_cache import SuffixCache  # noqa: E402
from thinkahead.token_spec import suffix_impl  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


# -------------------------------------------------------------------- drafters
DRAFTERS: dict[str, Callable[[], object]] = {
    "suffix": lambda: SuffixDrafter(SuffixCache()),  # SuffixDecoding's defaults: chain, factor 1, min prob 0.1
    "suffix-tree": lambda: SuffixDrafter(SuffixCache(), tree=True),
    "prompt-lookup-recent-3": lambda: PromptLookupDrafter(max_ngram=3, prefer="last"),
    "prompt-lookup-recent-8": lambda: PromptLookupDrafter(max_ngram=8, prefer="last"),
    "combined": lambda: CombinedDrafter(SuffixCache()),
    # request and session trees as deep as the global tree (64) instead of the default 32
    "combined-depth-64": lambda: CombinedDrafter(SuffixCache(request_depth=64)),
}
BASELINES = ("suffix", "suffix-tree", "prompt-lookup-recent-3", "prompt-lookup-recent-8")


def percentile_ms(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


UPDATE_HOW = {
    "retokenized": "start_request(full prompt), the prompt's ints new objects (a server re-tokenizing the chat)",
    "shared": "start_request(full prompt) built as previous prompt + output + new tokens (an agent's token list)",
    "new-tokens": "continue_session(new tokens only): no comparison of the old prompt",
}
# (row name, how the turn starts, the depth of the request / session trees; the global tree keeps 64)
UPDATE_MODES = [
    ("retokenized", "retokenized", 32),
    ("shared", "shared", 32),
    ("new-tokens", "new-tokens", 32),
    ("retokenized, request depth 64", "retokenized", 64),
    ("new-tokens, request depth 64", "new-tokens", 64),
]


def update_time_at_long_prompts(sessions: list[RecordedSession], lo: int, hi: int, rebuilds: int) -> dict:
    """Per-turn `SuffixCache` update for prompts of lo to hi tokens: continued sessions against rebuilds.

    For each row of `UPDATE_MODES`, the sessions that reach `lo` tokens are replayed
    through a fresh bare cache (prompt, then the output, then stop; one mode at a
    time, so no other cache's memory is around), and the turns in the window are
    timed: every mode sees the same turns. A few prompts of the window are then
    built from scratch on an empty cache.
    """
    clock = time.perf_counter
    timed: dict[str, list[float]] = {}
    new_tokens: list[int] = []
    long_prompts: list[list[int]] = []
    for row, mode, depth in UPDATE_MODES:
        cache = SuffixCache(request_depth=depth)
        timed[row] = []
        for s, session in enumerate(sessions):
            if session.turns[-1][0] < lo:
                continue
            previous: list[int] = []  # prompt + output as this cache got them
            for t, turn in enumerate(session):
                rid, sid = ("u", s, t), ("u", s)
                new = turn.prompt_ids[len(previous):]
                if mode == "retokenized":
                    prompt = turn.prompt_ids  # new int objects, as a tokenizer returns them
                else:
                    prompt = previous + new
                t0 = clock()
                if mode == "new-tokens" and t:
                    cache.continue_session(rid, sid, new)
                else:
                    cache.start_request(rid, prompt, session_id=sid)
                elapsed = clock() - t0
                if lo <= len(prompt) < hi:
                    timed[row].append(elapsed)
                    if row == "retokenized":
                        new_tokens.append(len(new))
                        if len(long_prompts) < rebuilds and t % 5 == 2:
                            long_prompts.append(turn.prompt_ids)
                output = list(turn.output_ids)
                cache.extend(rid, output)
                cache.stop_request(rid)
                previous = prompt + output
        if cache.session_stats.session_rebuilds:
            raise RuntimeError("a recorded turn does not extend its session: the session builder is broken")
        del cache
        gc.collect()
    rebuild_s = []
    for k, prompt in enumerate(long_prompts):
        t0 = clock()
        SuffixCache().start_request(("rebuild", k), prompt)
        rebuild_s.append(clock() - t0)
    out: dict = {
        "prompt_tokens_range": [lo, hi],
        "turns": len(new_tokens),
        "new_tokens_p50": statistics.median(new_tokens) if new_tokens else 0,
        "new_tokens_max": max(new_tokens, default=0),
        "modes": {},
    }
    for row, mode, depth in UPDATE_MODES:
        secs = timed[row]
        out["modes"][row] = {
            "what": UPDATE_HOW[mode],
            "max_depth": depth,
            "update_p50_ms": round(percentile_ms(secs, 0.5), 3),
            "update_p99_ms": round(percentile_ms(secs, 0.99), 3),
        }
    out["rebuild"] = {
        "turns": len(rebuild_s),
        "prompt_tokens": [len(p) for p in long_prompts],
        "update_p50_ms": round(percentile_ms(rebuild_s, 0.5), 1),
        "us_per_prompt_token": round(1e6 * sum(rebuild_s) / max(1, sum(len(p) for p in long_prompts)), 2),
    }
    return out


def long_turn_updates(stats: SessionReplayStats, lo: int) -> dict:
    picked = [(s, n) for s, p, n in zip(stats.update_s, stats.update_prompt_tokens, stats.update_new_tokens) if p >= lo]
    return {
        "turns": len(picked),
        "update_p50_ms": round(percentile_ms([s for s, _ in picked], 0.5), 3),
        "update_p99_ms": round(percentile_ms([s for s, _ in picked], 0.99), 3),
        "new_tokens_p50": statistics.median([n for _, n in picked]) if picked else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", choices=["auto", "qwen", "words"], default="auto")
    parser.add_argument("--max-draft", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--drafters", nargs="*", default=list(DRAFTERS), choices=list(DRAFTERS))
    parser.add_argument("--tree", choices=("native", "python", "both"), default=None,
                        help="suffix tree implementation (THINKAHEAD_SUFFIX_IMPL); both: replay under each, check the "
                        "tokens per step are identical, and write agent_sessions_trees.json with the speed ratios")
    args = parser.parse_args()
    if args.tree == "both":
        return compare_trees(args)
    if args.tree is not None:
        os.environ[suffix_impl.ENV_VAR] = args.tree

    t_start = time.perf_counter()
    tok = load_tokenizer(args.tokenizer)
    t_tok = time.perf_counter() - t_start
    if args.quick:
        sessions = build_sessions(tok, n_code=1, tasks_per_session=8, n_react=1, problems_per_session=8)
    else:
        sessions = build_sessions(tok, n_code=3, tasks_per_session=40, n_react=3, problems_per_session=40)
    t_build = time.perf_counter() - t_start - t_tok
    shape = {
        w: {
            "sessions": sum(1 for s in sessions if s.workload == w),
            "turns": sum(len(s) for s in sessions if s.workload == w),
            "final_prompt_tokens": [s.turns[-1][0] for s in sessions if s.workload == w],
            "output_tokens": sum(o - p for s in sessions if s.workload == w for p, o in s.turns),
        }
        for w in ("code", "react")
    }
    print(f"tokenizer {tok.name} ({t_tok:.1f} s), sessions built in {t_build:.1f} s: {json.dumps(shape)}")

    results: dict[str, dict] = {}
    for name in args.drafters:
        drafter = DRAFTERS[name]()
        t0 = time.perf_counter()
        per_workload: dict[str, SessionReplayStats] = {"code": SessionReplayStats(), "react": SessionReplayStats()}
        total = SessionReplayStats()
        for session in sessions:
            one = replay_sessions(drafter, [session], max_tokens=args.max_draft, tag=name)
            for target in (per_workload[session.workload], total):
                _merge(target, one)
        row = {"all": total.summary(), **{w: s.summary() for w, s in per_workload.items()}}
        row["long_prompt_turns"] = long_turn_updates(total, 40_000)
        if isinstance(drafter, CombinedDrafter):
            row["pooled_rates"] = {s: round(r.rate, 3) for s, r in drafter.pooled.items()}
        row["replay_s"] = round(time.perf_counter() - t0, 1)
        results[name] = row
        print(
            f"{name:22s} tokens/step all {row['all']['tokens_per_step']:.3f}  code {row['code']['tokens_per_step']:.3f}"
            f"  react {row['react']['tokens_per_step']:.3f}  update p50 {row['all']['update_p50_ms']:.2f} ms"
            f" p99 {row['all']['update_p99_ms']:.2f} ms  ({row['replay_s']} s)"
        )

    del drafter
    gc.collect()
    lo, hi = (2_000, 1 << 30) if args.quick else (45_000, 60_000)
    updates = update_time_at_long_prompts(sessions, lo, hi, rebuilds=1 if args.quick else 3)
    print(f"update at {lo}-{hi} prompt tokens: {json.dumps(updates)}")

    gain = {}
    if "combined" in results and any(b in results for b in BASELINES):
        for w in ("all", "code", "react"):
            base = max(results[b][w]["tokens_per_step"] for b in BASELINES if b in results)
            gain[w] = round(results["combined"][w]["tokens_per_step"] / base - 1, 4) if base else 0.0
    out = {
        "tokenizer": tok.name,
        "max_draft": args.max_draft,
        "quick": args.quick,
        "workloads": shape,
        "drafters": results,
        "combined_gain_over_best_single": gain,
        "update_at_long_prompts": updates,
        "platform": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()},
        "runtime_s": round(time.perf_counter() - t_start, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    suffix = "_quick" if args.quick else ""
    (RESULTS / f"agent_sessions{suffix}.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / f"agent_sessions{suffix}.md").write_text(markdown(out))
    print(f"combined vs best single source: {gain}; total {out['runtime_s']} s")


def large_tool_turns(sessions: list[RecordedSession], impl: str, lo: int = 50_000, hi: int = 130_000,
                     new: int = 1_400, output: int = 40) -> dict:
    """Continued turns of one long agent session whose turns add large tool outputs (`new` tokens each).

    The conversation is the recorded sessions' text run together; it starts at `lo` prompt tokens and
    each turn appends `new` tokens of tool output plus `output` tokens the model wrote, up to `hi`. Timed:
    the turn's update, through `continue_session` (the agent passes the new tokens) and through
    `start_request` with the whole growing prompt (compared with the session's tokens first).
    """
    stream: list[int] = []
    for session in sessions:
        stream.extend(session.tokens.tolist())
    if len(stream) < hi + new + output:
        stream = (stream * (1 + (hi + new + output) // max(1, len(stream))))
    clock = time.perf_counter
    out: dict = {"impl": impl, "prompt_tokens": [lo, hi], "new_tokens_per_turn": new}
    for mode in ("continue_session", "start_request"):
        cache = SuffixCache(tree_impl=impl)
        end = lo
        cache.start_request(0, stream[:end], session_id="agent")
        cache.extend(0, stream[end:end + output])
        cache.stop_request(0)
        end += output
        times: list[float] = []
        turn = 1
        while end + new + output <= hi:
            t0 = clock()
            if mode == "continue_session":
                cache.continue_session(turn, "agent", stream[end:end + new])
            else:
                cache.start_request(turn, stream[:end + new], session_id="agent")
            times.append(clock() - t0)
            end += new
            cache.extend(turn, stream[end:end + output])
            cache.stop_request(turn)
            end += output
            turn += 1
        ordered = sorted(times)
        out[mode] = {"turns": len(ordered), "update_p50_ms": round(ordered[len(ordered) // 2] * 1e3, 3),
                     "update_p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 3)}
    return out


def compare_trees(args: argparse.Namespace) -> None:
    """Replay the sessions under the python and the native tree: same tokens per step, and the speed-ups."""
    tok = load_tokenizer(args.tokenizer)
    if args.quick:
        sessions = build_sessions(tok, n_code=1, tasks_per_session=8, n_react=1, problems_per_session=8)
    else:
        sessions = build_sessions(tok, n_code=3, tasks_per_session=40, n_react=3, problems_per_session=40)
    runs: dict[str, dict] = {}
    for impl in ("python", "native"):
        os.environ[suffix_impl.ENV_VAR] = impl
        rows = {}
        for name in args.drafters:
            drafter = DRAFTERS[name]()
            total = SessionReplayStats()
            t0 = time.perf_counter()
            for session in sessions:
                _merge(total, replay_sessions(drafter, [session], max_tokens=args.max_draft, tag=name))
            rows[name] = dict(total.summary(), replay_s=round(time.perf_counter() - t0, 2))
        runs[impl] = rows
    same = {name: runs["python"][name]["tokens_per_step"] == runs["native"][name]["tokens_per_step"]
            for name in args.drafters}
    ratios = {
        name: {key: round(runs["python"][name][key] / runs["native"][name][key], 1)
               for key in ("update_p50_ms", "update_p99_ms", "propose_p50_us", "replay_s")
               if runs["native"][name].get(key)}
        for name in args.drafters
    }
    large = {impl: large_tool_turns(sessions, impl) for impl in ("python", "native")}
    print(f"turns adding large tool outputs: {json.dumps(large)}")
    out = {"tokenizer": tok.name, "quick": args.quick, "max_draft": args.max_draft, "runs": runs,
           "large_tool_output_turns": large,
           "tokens_per_step_identical": same, "python_over_native": ratios,
           "platform": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"agent_sessions_trees{'_quick' if args.quick else ''}.json").write_text(json.dumps(out, indent=2) + "\n")
    for name in args.drafters:
        print(f"{name:22s} tokens/step python {runs['python'][name]['tokens_per_step']:.4f} native "
              f"{runs['native'][name]['tokens_per_step']:.4f} identical {same[name]}  python/native {ratios[name]}")


def _merge(target: SessionReplayStats, one: SessionReplayStats) -> None:
    for name in SessionReplayStats.__slots__:
        value = getattr(one, name)
        if isinstance(value, list):
            getattr(target, name).extend(value)
        else:
            setattr(target, name, getattr(target, name) + value)


def markdown(out: dict) -> str:
    lines = [
        "# Agent sessions in the simulator",
        "",
        "Synthetic multi-turn sessions built from GSM8K and HumanEval text (scripted outputs, see the script's "
        f"docstring), tokenizer {out['tokenizer']}, drafts of up to {out['max_draft']} tokens, greedy acceptance, "
        "one bonus token per verify step. "
        f"All drafters replay the same sessions in one run ({out['runtime_s']} s in all).",
        "",
        "| workload | sessions | turns | final prompt tokens | output tokens |",
        "|---|---|---|---|---|",
    ]
    for w, s in out["workloads"].items():
        finals = ", ".join(map(str, s["final_prompt_tokens"]))
        lines.append(f"| {w} | {s['sessions']} | {s['turns']} | {finals} | {s['output_tokens']} |")
    lines += [
        "",
        "## Tokens per verify step (accepted + 1)",
        "",
        "| drafter | all | code | react | draft precision | update p50 ms | update p99 ms "
        "| update p50 ms, prompts >= 40k | propose p50 us |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in out["drafters"].items():
        a = row["all"]
        lines.append(
            f"| {name} | {a['tokens_per_step']:.3f} | {row['code']['tokens_per_step']:.3f} "
            f"| {row['react']['tokens_per_step']:.3f} "
            f"| {a['draft_precision']:.3f} | {a['update_p50_ms']:.2f} | {a['update_p99_ms']:.2f} "
            f"| {row['long_prompt_turns']['update_p50_ms']:.2f} | {a['propose_p50_us']:.0f} |"
        )
    if out["combined_gain_over_best_single"]:
        g = out["combined_gain_over_best_single"]
        gains = ", ".join(f"{k} {100 * v:+.1f}%" for k, v in g.items())
        lines += ["", f"Combined over the best single source (per column): {gains}"]
    u = out["update_at_long_prompts"]
    lines += [
        "",
        f"## Per-turn cache update at {u['prompt_tokens_range'][0]}-{u['prompt_tokens_range'][1]} prompt tokens",
        "",
        f"The same {u['turns']} turns for every row; new tokens per turn p50 {u['new_tokens_p50']}, "
        f"max {u['new_tokens_max']}.",
        "",
        "| how the turn starts | update p50 ms | update p99 ms |",
        "|---|---|---|",
    ]
    for m in u["modes"].values():
        lines.append(
            f"| continued session, request depth {m['max_depth']}: {m['what']} | {m['update_p50_ms']} | {m['update_p99_ms']} |"
        )
    r = u["rebuild"]
    lines.append(
        f"| rebuild over the whole prompt, request depth 32 ({r['turns']} prompts of {r['prompt_tokens']} tokens, "
        f"{r['us_per_prompt_token']} us per token) | {r['update_p50_ms']} | |"
    )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
