"""Step-level speculation on GSM8K: accuracy, time and who wrote the steps, policy by policy.

Runs each policy (large, small, specreason at several thresholds, arbitrage, reflect), with and
without token-level speculation, over the first N GSM8K test problems, with Qwen2.5-Coder 0.5B as
the small and 1.5B as the large model. Writes JSONL (one line per run, appended and resumable),
a markdown table and an accuracy-vs-time plot under bench/results/. Not a test.

    python bench/step_spec.py --problems 8 --dtype int8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_data import gsm8k  # noqa: E402

from thinkahead.evals.report import finish_plot  # noqa: E402
from thinkahead.step_spec.loop import StepBudget, StepLoop  # noqa: E402
from thinkahead.step_spec.policies import make_policy  # noqa: E402
from thinkahead.step_spec.segment import SegmentConfig  # noqa: E402
from thinkahead.verifiers.grading import MathChecker  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
INSTRUCTION = " Reason step by step and put the final answer in \\boxed{}."
# name -> (policy, options, token-level speculation)
CONFIGS: dict[str, tuple[str, dict, bool]] = {
    "large": ("large", {}, True),
    "large/no-token-spec": ("large", {}, False),
    "small": ("small", {}, True),
    "specreason@5": ("specreason", {"threshold": 5.0, "score_mode": "expected"}, True),
    "specreason@5/no-token-spec": ("specreason", {"threshold": 5.0, "score_mode": "expected"}, False),
    "specreason@7": ("specreason", {"threshold": 7.0}, True),
    "specreason@9": ("specreason", {"threshold": 9.0}, True),
    "arbitrage": ("arbitrage", {}, True),
    "reflect": ("reflect", {}, True),
    "specreason@5/lookahead": ("specreason", {"threshold": 5.0, "score_mode": "expected", "lookahead": True}, True),
}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval for k successes out of n."""
    if n == 0:
        return 0.0, 0.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(records: list[dict], order: list[str]) -> list[dict]:
    rows = []
    for name in order:
        rs = [r for r in records if r["config"] == name]
        if not rs:
            continue
        k, n = sum(r["correct"] for r in rs), len(rs)
        lo, hi = wilson(k, n)
        steps = sum(r["steps"] for r in rs)
        rows.append({
            "config": name, "n": n, "accuracy": k / n, "ci": [lo, hi],
            "time_per_problem_s": sum(r["time_s"] for r in rs) / n,
            "small_tokens": sum(r["tokens"]["small"] for r in rs) / n,
            "large_tokens": sum(r["tokens"]["large"] for r in rs) / n,
            "small_share": sum(r["small_steps"] for r in rs) / steps if steps else 0.0,
            "judge_calls": sum(r["judge_calls"] for r in rs) / n,
        })
    base = next((r for r in rows if r["config"] == "large"), None)
    for r in rows:
        r["speedup_vs_large"] = base["time_per_problem_s"] / r["time_per_problem_s"] if base else None
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Small `{meta['small']}`, large `{meta['large']}`, {meta['dtype']}, greedy, {meta['problems']} GSM8K test "
        f"problems, {meta['machine']}; `{meta['command']}`.",
        "",
        "| config | accuracy (95% CI) | s / problem | vs large | small tok | large tok | small share of steps | judge calls |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['accuracy']:.2f} ({r['ci'][0]:.2f}-{r['ci'][1]:.2f}) | {r['time_per_problem_s']:.1f} | "
            f"{r['speedup_vs_large']:.2f}x | {r['small_tokens']:.0f} | {r['large_tokens']:.0f} | "
            f"{r['small_share']:.2f} | {r['judge_calls']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.scatter(r["time_per_problem_s"], r["accuracy"])
        ax.annotate(r["config"], (r["time_per_problem_s"], r["accuracy"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    finish_plot(fig, ax, path, xlabel="seconds per problem (lower is better)", ylabel="GSM8K accuracy",
                title="Step-level speculation: accuracy vs time", dpi=110)


async def run_one(small, large, name: str, problem: dict, args) -> dict:
    policy_name, options, token_spec = CONFIGS[name]
    for model in (small, large):  # every run starts cold: no drafts from other configs' outputs
        model.suffix_cache.clear()
        model.prefix_pool.clear()
    loop = StepLoop(
        small, large, make_policy(policy_name, **options),
        SegmentConfig(max_step_tokens=args.step_tokens), StepBudget(max_steps=16, max_tokens=args.max_tokens),
        speculative=token_spec,
    )
    result = await loop.run(problem["question"] + INSTRUCTION)
    reference = problem["answer"]
    return {
        "config": name, "id": problem["id"], "correct": MathChecker().check(result.reasoning, reference),
        "time_s": result.time_s, "tokens": result.tokens, "steps": len([s for s in result.steps if s.verdict != "final"]),
        "small_steps": sum(1 for s in result.steps if s.author == "small" and s.verdict != "final"),
        "judge_calls": result.judge_calls, "stop_reason": result.stop_reason,
        "trace": [{"author": s.author, "verdict": s.verdict, "score": s.score, "text": s.text} for s in result.steps],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", default="qwen2.5-coder-0.5b")
    ap.add_argument("--large", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="int8")
    ap.add_argument("--problems", type=int, default=50)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--step-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--out", default=str(RESULTS / "step_spec"))
    args = ap.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")

    from thinkahead.models import LocalModel

    import platform

    import torch

    small, large = LocalModel(args.small, dtype=args.dtype), LocalModel(args.large, dtype=args.dtype)
    problems = [dict(p, id=f"gsm8k-test-{i}") for i, p in enumerate(gsm8k("test")[: args.problems])]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = out.with_suffix(".jsonl")
    done = set()
    records: list[dict] = []
    if runs.exists():
        records = [json.loads(line) for line in runs.read_text().splitlines() if line.strip()]
        done = {(r["config"], r["id"]) for r in records}
    meta = {
        "small": args.small, "large": args.large, "dtype": args.dtype, "problems": len(problems),
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "command": "python bench/step_spec.py " + " ".join(sys.argv[1:]),
    }
    with runs.open("a") as fh:
        for problem in problems:  # problem-major: every config sees the same problems if stopped early
            for name in names:
                if (name, problem["id"]) in done:
                    continue
                t = time.perf_counter()
                rec = asyncio.run(run_one(small, large, name, problem, args))
                records.append(rec)
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
                print(f"{name:28s} {problem['id']:16s} correct={rec['correct']!s:5s} {time.perf_counter() - t:6.1f}s "
                      f"small_share={rec['small_steps']}/{rec['steps']}", flush=True)
    rows = summarize(records, names)
    out.with_suffix(".md").write_text(markdown(rows, meta))
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
