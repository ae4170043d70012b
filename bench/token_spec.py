"""Token-level speculation on real models: ours against transformers, in one run.

Methods (all greedy, same prompts, same stop tokens, same max_new_tokens):
  hf-greedy            transformers `model.generate` (the baseline)
  hf-prompt-lookup     `generate(prompt_lookup_num_tokens=10)`
  hf-assisted          `generate(assistant_model=small)`
  suffix               ours: SuffixDecoding (per-request + global suffix trees)
  prompt-lookup        ours: n-gram lookup in the context
  draft-model          ours: the small model drafts up to 8 tokens a round, while it is sure
  hybrid               ours: per round the combined draft, the small model's or a plain step, whichever promises more
  combined             ours: recent context copies + local and global suffix trees in one tree draft
  head                 ours: the target's packaged draft head over its own hidden states, beside combined
  ours-plain           ours without speculation (one token per forward; its output is the reference
                       our speculative methods must equal)
  llama-plain          llama.cpp (llama-cpp-python) greedy on the same GGUF file, its own KV reuse
  llama-prompt-lookup  llama.cpp with llama-cpp-python's prompt-lookup draft model (10 tokens)
                       (both need llama-cpp-python: bench/llama_baseline.py says how to install it;
                       without it the default method list leaves them out)

Ours reuse the KV of earlier prompts that share a prefix (a KV prefix pool, as SGLang's radix cache
does; `--no-prefix-reuse` turns it off): a refine turn's prompt extends the previous turn's prompt and
answer, so only the new instruction is prefilled. transformers' `generate` re-reads the whole prompt
every turn. "decode tok/s" leaves the prefill out and compares the token loops alone. The methods take
turns conversation by conversation (each runs a whole conversation, then the next method), so a machine
whose speed drifts during the run weighs on every method alike.

Workloads (GSM8K and HumanEval read from their PyPI packages):
  cot        plain chain of thought on GSM8K problems
  refine     agentic self-refine: solve, then "check and rewrite your solution" x3
  pipeline   one sub-task prompt (an extraction agent) run over many problems
  code       rewrite a HumanEval solution with a small change

Writes bench/results/token_spec.{json,md,png}. Run:
  python bench/token_spec.py                       # Qwen2.5-Coder 1.5B target, 0.5B draft
  python bench/token_spec.py --quick               # a small smoke run
"""

from __future__ import annotations

from pathlib import Path
import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_data import gsm8k, humaneval  # noqa: E402

from llama_baseline import LLAMA_METHODS, PROMPT_LOOKUP_TOKENS, LlamaRunner, llama_version  # noqa: E402
from thinkahead.evals.report import finish_plot  # noqa: E402
from thinkahead.models.engine.weights.load import DTYPES, load_causal_lm  # noqa: E402
from thinkahead.models.engine.runner import HFEngine  # noqa: E402
from thinkahead.token_spec.decoder import SpeculativeDecoder  # noqa: E402
from thinkahead.token_spec.names import MAX_DRAFT  # noqa: E402
from thinkahead.token_spec.prefix_pool import KVPrefixPool  # noqa: E402
from thinkahead.token_spec.draft_head import find_head  # noqa: E402
from thinkahead.token_spec.presets import build_decoder  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ALL_METHODS = ["hf-greedy", "hf-prompt-lookup", "hf-assisted", "ours-plain", "suffix", "prompt-lookup", "combined",
               "draft-model", "hybrid", "head", *LLAMA_METHODS]
ALL_WORKLOADS = ["cot", "refine", "pipeline", "code"]

COT_INSTRUCTION = "Solve the problem step by step, then give the final answer as 'Answer: <number>'."
REFINE_INSTRUCTION = (
    "Check your solution above carefully, step by step. Then rewrite the complete solution, "
    "fixing any mistake, and end with 'Answer: <number>'."
)
PIPELINE_INSTRUCTION = (
    "You are the extraction agent of a math pipeline. List every quantity in the problem below, "
    "one per line as '- <what>: <value>', then write 'Question: ' and restate what is asked.\n\nProblem: "
)
CODE_INSTRUCTION = (
    "Rewrite this Python function: rename it to `solution` and add a one-line docstring. "
    "Keep the body otherwise unchanged. Reply with the code only.\n\n```python\n"
)


# --------------------------------------------------------------------------- workloads
class Conversation:
    """Prompts for one workload item; `reply` feeds the model's answer back (agent loops)."""

    def __init__(self, turns: list[str], max_new_tokens: int) -> None:
        self.turns = turns
        self.max_new_tokens = max_new_tokens


def build_workloads(names: list[str], sizes: dict[str, int], max_new: dict[str, int]) -> dict[str, list[Conversation]]:
    problems = gsm8k("test")
    out: dict[str, list[Conversation]] = {}
    if "cot" in names:
        out["cot"] = [
            Conversation([f"{p['question']}\n\n{COT_INSTRUCTION}"], max_new["cot"]) for p in problems[: sizes["cot"]]
        ]
    if "refine" in names:
        base = problems[100:]
        out["refine"] = [
            Conversation([f"{p['question']}\n\n{COT_INSTRUCTION}"] + [REFINE_INSTRUCTION] * 3, max_new["refine"])
            for p in base[: sizes["refine"]]
        ]
    if "pipeline" in names:
        base = problems[200:]
        out["pipeline"] = [
            Conversation([PIPELINE_INSTRUCTION + p["question"]], max_new["pipeline"]) for p in base[: sizes["pipeline"]]
        ]
    if "code" in names:
        tasks = humaneval()
        out["code"] = [
            Conversation([CODE_INSTRUCTION + t["prompt"] + t["canonical_solution"] + "```"], max_new["code"])
            for t in tasks[: sizes["code"]]
        ]
    return out


# --------------------------------------------------------------------------- methods
class Runner:
    """Generates one reply for a list of token ids; returns (new ids, stats dict)."""

    def __init__(
        self,
        name: str,
        target,
        tokenizer,
        draft=None,
        stop_ids: list[int] | None = None,
        prefix_reuse: bool = True,
        attention: str = "sdpa",
        max_draft: int = MAX_DRAFT,
        spec: str = "",
    ) -> None:
        self.name = name
        self.spec = spec  # the target's model spec: its packaged draft head ("head")
        self.target = target
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids or []
        self.decoder: SpeculativeDecoder | None = None
        self.draft = draft
        # transformers' methods run as a user would run them (sdpa attention); ours use `attention`, the
        # implementation the model was loaded with (float64 attention for int8: token-exact speculation).
        self.attention = "sdpa" if name.startswith("hf-") else attention
        if not name.startswith("hf-"):
            kind = "none" if name == "ours-plain" else name
            engine = HFEngine(target)
            self.decoder = build_decoder(
                kind,
                engine,
                draft_engine=HFEngine(draft) if kind in ("draft-model", "hybrid") else None,
                max_draft=PROMPT_LOOKUP_TOKENS if kind == "prompt-lookup" else max_draft,  # as transformers' prompt lookup
                prefix_pool=KVPrefixPool(engine) if prefix_reuse else None,
                draft_head=find_head(None, self.spec, target.config.hidden_size, self.spec) if kind == "head" else None,
            )

    def generate(self, prompt_ids: list[int], max_new_tokens: int, session_id: str | None = None) -> tuple[list[int], dict]:
        """`session_id` names the conversation: each turn's prompt extends the last one (agent sessions)."""
        for model in (self.target, self.draft):
            if model is not None and model.config._attn_implementation != self.attention:
                model.set_attn_implementation(self.attention)
        if self.decoder is not None:
            r = self.decoder.generate(prompt_ids, max_new_tokens, stop_token_ids=self.stop_ids, session_id=session_id)
            return r.token_ids, r.stats.to_dict()
        kwargs: dict = dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=self.stop_ids)
        kwargs["pad_token_id"] = self.tokenizer.pad_token_id or self.stop_ids[0]
        if self.name == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        elif self.name == "hf-assisted":
            kwargs["assistant_model"] = self.draft
        ids = torch.tensor([prompt_ids])
        clock = FirstTokenClock()
        with torch.inference_mode():
            out = self.target.generate(ids, attention_mask=torch.ones_like(ids), streamer=clock, **kwargs)
        new = out[0, len(prompt_ids):].tolist()
        return new, {"first_token_s": clock.first_token_s}


class FirstTokenClock:
    """A `generate` streamer that only notes when the first new token arrives (the prompt comes first)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.calls = 0
        self.first_token_s = 0.0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_s = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def run_conversation(runner: Runner, wname: str, ci: int, conv: Conversation, log) -> list[dict]:
    """Every turn of one conversation; one record per generation."""
    records = []
    messages: list[dict] = []
    for ti, turn in enumerate(conv.turns):
        messages.append({"role": "user", "content": turn})
        prompt = chat_ids(runner.tokenizer, messages)
        t0 = time.perf_counter()
        new, stats = runner.generate(prompt, conv.max_new_tokens, session_id=f"{wname}-{ci}")
        wall = time.perf_counter() - t0
        text_ids = [t for t in new if t not in runner.stop_ids]
        messages.append({"role": "assistant", "content": runner.tokenizer.decode(text_ids, skip_special_tokens=True)})
        rec = {
            "method": runner.name, "workload": wname, "item": ci, "turn": ti,
            "prompt_tokens": len(prompt), "new_tokens": len(new), "wall_s": wall,
            "token_ids": new,
            **{k: v for k, v in stats.items() if k.startswith("spec_") or k.endswith("_s") or k == "cached_tokens"},
        }
        records.append(rec)
        log(f"{runner.name:17s} {wname:8s} item {ci} turn {ti}: {len(new):4d} tok {wall:6.1f}s "
            f"{len(new) / wall:5.2f} tok/s accept_len {stats.get('spec_accept_length', 0):.2f}")
    return records


# --------------------------------------------------------------------------- report
def summarize(records: list[dict], methods: list[str], workloads: list[str]) -> list[dict]:
    """One row per (workload, method): speed against the transformers and llama.cpp baselines, acceptance,
    exactness."""
    by_key = {(r["method"], r["workload"], r["item"], r["turn"]): r for r in records}
    rows = []
    for w in workloads:
        groups = {m: [r for r in records if r["method"] == m and r["workload"] == w] for m in methods}
        groups = {m: rs for m, rs in groups.items() if rs}
        speed = {m: _speed(rs) for m, rs in groups.items()}  # every method's first, so any can be a baseline
        for m, rs in groups.items():
            tokens = sum(r["new_tokens"] for r in rs)
            wall = sum(r["wall_s"] for r in rs)
            verify = sum(r.get("spec_verify_ct", 0) for r in rs)
            draft_s = sum(r.get("draft_time_s", 0.0) for r in rs)
            prompt = sum(r["prompt_tokens"] for r in rs)
            rows.append({
                "workload": w, "method": m, "tokens": tokens, "wall_s": round(wall, 2),
                "tokens_per_s": round(speed[m][0], 3),
                "speedup": _ratio(speed, m, "hf-greedy", 0),
                "vs_hf_prompt_lookup": _ratio(speed, m, "hf-prompt-lookup", 0),
                "vs_llama_plain": _ratio(speed, m, "llama-plain", 0),
                "vs_llama_prompt_lookup": _ratio(speed, m, "llama-prompt-lookup", 0),
                "decode_tokens_per_s": round(speed[m][1], 3),
                "decode_speedup": _ratio(speed, m, "hf-greedy", 1),
                "accept_length": round(tokens / verify, 3) if verify else None,
                "draft_ms_per_token": round(1000 * draft_s / tokens, 3) if verify and tokens else None,
                "prompt_reused": round(sum(r.get("cached_tokens", 0) for r in rs) / prompt, 3) if prompt else 0.0,
                "same_as_ours_plain": _agreement(rs, by_key, "ours-plain", every_turn=True),
                "same_as_hf_greedy": _agreement(rs, by_key, "hf-greedy", every_turn=False),
            })
    return rows


def _speed(rs: list[dict]) -> tuple[float, float]:
    """(end-to-end tok/s, decode tok/s without the first token) of some generations."""
    tokens, wall = sum(r["new_tokens"] for r in rs), sum(r["wall_s"] for r in rs)
    decode_wall = sum(r["wall_s"] - r.get("first_token_s", 0.0) for r in rs)
    decode_tokens = sum(max(r["new_tokens"] - 1, 0) for r in rs)
    return tokens / wall if wall else 0.0, decode_tokens / decode_wall if decode_wall else 0.0


def _ratio(speed: dict[str, tuple[float, float]], method: str, baseline: str, column: int) -> float | None:
    if baseline not in speed or not speed[baseline][column]:
        return None
    return round(speed[method][column] / speed[baseline][column], 3)


def _agreement(rs: list[dict], by_key: dict, reference: str, every_turn: bool) -> str:
    """'k/n': generations whose tokens equal the reference method's (first turns only, unless every_turn).

    Later turns only compare like with like when every earlier turn agreed (their prompts hold the
    earlier answers), which is what an exact method must achieve against ours-plain.
    """
    same = [
        r["token_ids"] == by_key[(reference, r["workload"], r["item"], r["turn"])]["token_ids"]
        for r in rs
        if (reference, r["workload"], r["item"], r["turn"]) in by_key and (every_turn or r["turn"] == 0)
    ]
    return f"{sum(same)}/{len(same)}" if same and rs[0]["method"] != reference else ""


def markdown(rows: list[dict], meta: dict) -> str:
    def x(v: float | None) -> str:
        return f"{v:.2f}x" if v else ""

    lines = [
        f"Target `{meta['target']}`, draft `{meta['draft']}`, {meta['dtype']}, greedy, "
        f"{meta['threads']} threads, {meta['machine']}; `{meta['command']}`.",
        "",
        "| workload | method | tokens | tok/s (end to end) | vs hf-greedy | vs hf-prompt-lookup | vs llama-plain "
        "| vs llama-prompt-lookup | decode tok/s | decode vs hf-greedy | accept len | draft ms/tok | prompt KV reused "
        "| output = ours-plain | first turn = hf-greedy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        al = f"{r['accept_length']:.2f}" if r["accept_length"] else ""
        dm = f"{r['draft_ms_per_token']:.2f}" if r["draft_ms_per_token"] is not None else ""
        reused = f"{100 * r['prompt_reused']:.0f}%" if r.get("prompt_reused") else ""
        lines.append(
            f"| {r['workload']} | {r['method']} | {r['tokens']} | {r['tokens_per_s']:.2f} | {x(r['speedup'])} "
            f"| {x(r.get('vs_hf_prompt_lookup'))} | {x(r.get('vs_llama_plain'))} "
            f"| {x(r.get('vs_llama_prompt_lookup'))} | {r['decode_tokens_per_s']:.2f} | {x(r['decode_speedup'])} | {al} "
            f"| {dm} | {reused} | {r.get('same_as_ours_plain', '')} | {r['same_as_hf_greedy']} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ys = [next((r["speedup"] or 0 for r in rows if r["method"] == m and r["workload"] == w), 0) for w in workloads]
        ax1.bar([k + i * width for k in range(len(workloads))], ys, width, label=m)
    ax1.axhline(1.0, color="black", lw=0.8)
    ax1.set_xticks([k + 0.4 - width / 2 for k in range(len(workloads))], workloads)
    ax1.set_ylabel("tokens/s relative to hf-greedy")
    ax1.set_title("Speed by workload")
    ax1.legend(fontsize=7)
    for m in ("suffix", "combined", "hybrid", "prompt-lookup"):
        seq = [r for r in records if r["method"] == m and r.get("spec_verify_ct")]
        if seq:
            ax2.plot(range(len(seq)), [r["new_tokens"] / r["spec_verify_ct"] for r in seq], marker=".", label=m)
    ax2.legend(fontsize=7)
    finish_plot(fig, ax2, path, xlabel="generation index in the run (the global suffix cache warms)",
                ylabel="tokens per verify step", title="Acceptance as the cache warms", grid=False, dpi=110)


# --------------------------------------------------------------------------- main
def cpu_features() -> str:
    """The CPU features that decide whether bf16 matmuls are native (they change every ratio here)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "flags unknown"
    wanted = ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"]
    return " ".join(f if f in flags else f"no {f}" for f in wanted)



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="int8: batch-invariant int8 linears (thinkahead/models/engine/kernels/quantize.py); gguf: the GGUF file's own blocks (kquant.py)")
    ap.add_argument("--methods", default=None, help="comma-separated (default: all; llama-* only when llama-cpp-python is installed)")
    ap.add_argument("--workloads", default=",".join(ALL_WORKLOADS))
    ap.add_argument("--quick", action="store_true", help="1 item per workload, short outputs")
    ap.add_argument("--items", type=int, default=None, help="items per workload (default: cot 2, refine 2, pipeline 5, code 2)")
    ap.add_argument("--out", default=str(RESULTS / "token_spec"))
    ap.add_argument("--reuse", default="", help="METHODS=FILE.json: take these methods' records from an earlier run")
    ap.add_argument("--max-draft", type=int, default=MAX_DRAFT,
                    help=f"draft tokens per verify round at most, ours except prompt-lookup (default {MAX_DRAFT}, the product's)")
    ap.add_argument("--no-prefix-reuse", action="store_true", help="ours prefill every prompt whole, as transformers does")
    args = ap.parse_args()

    methods = args.methods.split(",") if args.methods else [
        m for m in ALL_METHODS if m not in LLAMA_METHODS or llama_version() is not None]
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(ALL_METHODS)}")
    names = args.workloads.split(",")
    sizes = {"cot": 2, "refine": 2, "pipeline": 5, "code": 2}
    max_new = {"cot": 160, "refine": 256, "pipeline": 80, "code": 128}
    if args.quick:
        sizes = {k: 1 for k in sizes}
        max_new = {k: 32 for k in max_new}
    if args.max_draft < 1:
        ap.error(f"--max-draft must be >= 1, got {args.max_draft}")
    if args.items is not None:
        if args.items < 1:
            ap.error(f"--items must be >= 1, got {args.items}")
        sizes = {k: args.items for k in sizes}
    workloads = build_workloads(names, sizes, max_new)

    t0 = time.perf_counter()
    target, tokenizer = load_causal_lm(args.target, args.dtype)
    draft = None
    if any(m in ("hf-assisted", "draft-model", "hybrid") for m in methods):
        draft, _ = load_causal_lm(args.draft, args.dtype)
    load_s = time.perf_counter() - t0
    loaded_attention = target.config._attn_implementation
    stop_ids = [t for t in {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")} if isinstance(t, int)]

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "target": args.target, "draft": args.draft, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} CPU ({cpu_features()}), {torch.get_num_threads()} threads, torch {torch.__version__}",
        "command": "python bench/token_spec.py " + " ".join(sys.argv[1:]), "load_s": round(load_s, 1),
        # ours: the config's attention name; on native layers (fused Qwen2, int8/gguf) attention is native float32
        "attention": {"transformers": "sdpa", "ours": loaded_attention},
        "native_layers": bool(getattr(target, "_native_layers", False)),
        "llama_cpp_python": llama_version(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "sizes": sizes, "max_new_tokens": max_new, "max_draft": args.max_draft, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    records: list[dict] = []
    if args.reuse:
        reused, path = args.reuse.split("=", 1)
        earlier = json.loads(Path(path).read_text())
        keep = set(reused.split(","))
        records = [dict(r, reused_from=earlier["meta"].get("started")) for r in earlier["records"] if r["method"] in keep]
        meta["reused"] = {"methods": sorted(keep), "from_run_started": earlier["meta"].get("started")}
        methods = [m for m in methods if m not in keep]

    def log(msg: str) -> None:
        print(msg, flush=True)

    runners = {m: LlamaRunner(m, args.target, tokenizer, stop_ids, threads=torch.get_num_threads()) if m in LLAMA_METHODS
               else Runner(m, target, tokenizer, draft, stop_ids, prefix_reuse=not args.no_prefix_reuse, max_draft=args.max_draft,
                           attention=loaded_attention, spec=args.target) for m in methods}
    # Conversation by conversation, every method in turn: a machine that slows down over a long run slows
    # every method alike (method by method, the first ones ran minutes before the last).
    for wname, convs in workloads.items():
        for ci, conv in enumerate(convs):
            for m in methods:
                records += run_conversation(runners[m], wname, ci, conv, log)
                rows = summarize(records, [x for x in ALL_METHODS if any(r["method"] == x for r in records)], names)
                out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": rows, "records": records}, indent=1))
    order = [m for m in ALL_METHODS if any(r["method"] == m for r in records)]
    rows = summarize(records, order, names)
    out.with_suffix(".md").write_text(markdown(rows, meta))
    plot(rows, records, out.with_suffix(".png"))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
