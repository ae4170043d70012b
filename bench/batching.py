"""Many streams at once on one local model (issue 34): aggregate decode throughput against one stream at a time.

N concurrent greedy chat completions of N distinct GSM8K test problems (chain of thought, `--tokens` each), sent
to one `LocalModel` (the GGUF kernels, its `BatchScheduler`) with asyncio, for N in `--streams`; the baseline is
the same problems one at a time (N = 1) in the same process. Per arm (`--arms`: "plain" decodes one token per
forward, "suffix" is the model's suffix drafter), the suffix cache and the KV prefix pool are cleared before
every N, so no run drafts from another's outputs. Reported per N: aggregate tok/s (all completion tokens over
the wall time), the ratio to the arm's own one-at-a-time rate, the slowest reply, the largest time to first
token, the largest batch the scheduler ran, and whether every reply's tokens equal the one-at-a-time reply's.

Writes bench/results/batching.json and prints a markdown table; the CPU's flags and the load average go in the
JSON (timings on a busy machine do not compare). Run:
  python bench/batching.py                         # 1.5B, streams 1,2,4,8, 128 tokens, arms plain,suffix
  python bench/batching.py --model qwen2.5-coder-0.5b --streams 1,4 --tokens 32   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from thinkahead.evals.data import gsm8k
from thinkahead.models import LocalModel
from thinkahead.models.base import Completion, GenerationRequest

RESULTS = Path(__file__).resolve().parent / "results"
OFFSET = 300  # GSM8K test problems 300.. (no policy was tuned on them)


def cpu_flags() -> str:
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    return f"{model}; {' '.join(f for f in wanted if f in flags)}"


def request(question: str, tokens: int, speculative: bool) -> GenerationRequest:
    messages = [{"role": "system", "content": "Solve the problem step by step, then give the final answer."},
                {"role": "user", "content": question}]
    return GenerationRequest(messages=messages, max_new_tokens=tokens, temperature=0, speculative=speculative)


def fresh(model: LocalModel) -> None:
    model.suffix_cache.clear()
    model.prefix_pool.clear()


async def together(model: LocalModel, requests: list[GenerationRequest]) -> tuple[list[Completion], float]:
    t0 = time.perf_counter()
    done = await asyncio.gather(*(model.generate(r) for r in requests))
    return list(done), time.perf_counter() - t0


def run_arm(model: LocalModel, questions: list[str], streams: list[int], tokens: int, speculative: bool) -> list[dict]:
    most = max(streams)
    fresh(model)
    solo, solo_s = [], 0.0
    for q in questions[:most]:  # the baseline: one at a time
        model.prefix_pool.clear()
        done, wall = asyncio.run(together(model, [request(q, tokens, speculative)]))
        solo.append(done[0])
        solo_s += wall
    solo_rate = sum(c.completion_tokens for c in solo) / solo_s
    rows = [{"streams": 1, "tok_s": solo_rate, "ratio": 1.0, "slowest_s": max(c.time_s for c in solo),
             "max_ttft_s": max(c.first_token_s or 0.0 for c in solo), "peak_batch": 1, "exact": True}]
    for n in [s for s in streams if s > 1]:
        fresh(model)
        model.scheduler.peak_batch = 0
        done, wall = asyncio.run(together(model, [request(q, tokens, speculative) for q in questions[:n]]))
        rate = sum(c.completion_tokens for c in done) / wall
        rows.append({"streams": n, "tok_s": rate, "ratio": rate / solo_rate, "slowest_s": wall,
                     "max_ttft_s": max(c.first_token_s or 0.0 for c in done), "peak_batch": model.scheduler.peak_batch,
                     "exact": all(c.token_ids == s.token_ids for c, s in zip(done, solo))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--arms", default="plain,suffix")
    parser.add_argument("--out", type=Path, default=RESULTS / "batching.json")
    args = parser.parse_args()
    streams = sorted({int(s) for s in args.streams.split(",")} | {1})
    questions = [r["question"] for r in gsm8k("test")[OFFSET:OFFSET + max(streams)]]
    load_before = os.getloadavg()
    model = LocalModel(args.model, dtype="gguf", drafter="suffix")
    asyncio.run(together(model, [request("What is 2 + 3?", 4, False)]))  # warm the kernels and the template
    result: dict[str, Any] = {"model": args.model, "tokens": args.tokens, "cpu": cpu_flags(),
                              "threads": __import__("torch").get_num_threads(),
                              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "arms": {}}
    for arm in args.arms.split(","):
        if arm not in ("plain", "suffix"):
            parser.error(f"unknown arm {arm!r}: plain or suffix")
        result["arms"][arm] = run_arm(model, questions, streams, args.tokens, speculative=arm == "suffix")
    result["load_average"] = {"before": load_before, "after": os.getloadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.model}, {args.tokens} tokens per stream, {result['cpu']}, load {load_before[0]:.2f}")
    print("| arm | streams | aggregate tok/s | vs one at a time | slowest reply s | max TTFT s | peak batch | exact |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for arm, rows in result["arms"].items():
        for r in rows:
            print(f"| {arm} | {r['streams']} | {r['tok_s']:.1f} | {r['ratio']:.2f}x | {r['slowest_s']:.1f} | "
                  f"{r['max_ttft_s']:.2f} | {r['peak_batch']} | {r['exact']} |")


if __name__ == "__main__":
    main()
