"""Goodput-sized speculation against fixed draft lengths, by load (issue 34's sweep).

The same greedy "copy this text" requests (`--requests`, 16 by default: GSM8K test questions 400-415 to copy word
for word, so drafts from the prompt hit often) to one `LocalModel` (dtype gguf), N in flight at a time (each that
ends lets the next start), for N in `--streams`, under each arm:
`fixed-K` verifies K drafted tokens every round whatever the load (a `FixedController(K)` decoder, the
scheduler's goodput plan off), `adaptive` is the library's default (the suffix drafter's calibrated worths: each
step verifies the draft rows that pay, over every sequence), `unpriced` (with `--extra unpriced`) sizes each
sequence's chain by its acceptance rate instead (the scheduler's goodput plan in a batch, the adaptive controller
alone). Every arm uses the suffix drafter over a fresh suffix cache and prefix pool, so no run drafts from
another's outputs. Reported: aggregate tok/s per arm and load (`--repeat`: the median of interleaved runs), and
adaptive against the best fixed arm at that load.

Writes bench/results/goodput_sweep.json, .md and .png (matplotlib, the bench extra). Run:
  python bench/goodput_sweep.py                       # 1.5B, streams 1,2,4,8,16, fixed 0,2,4,8,16
  python bench/goodput_sweep.py --model qwen2.5-coder-0.5b --streams 1,4 --fixed 0,4 --tokens 24   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from decode_profile import cpu_flags  # bench/ is the script's folder

from thinkahead.evals.data import gsm8k
from thinkahead.models import LocalModel
from thinkahead.models.base import GenerationRequest
from thinkahead.token_spec.controller import FixedController
from thinkahead.token_spec.decoder import SpeculativeDecoder
from thinkahead.token_spec.presets import build_decoder

RESULTS = Path(__file__).resolve().parent / "results"


def request(question: str, tokens: int) -> GenerationRequest:
    messages = [{"role": "user", "content": f"Copy this text word for word, then stop:\n\n{question}"}]
    return GenerationRequest(messages=messages, max_new_tokens=tokens, temperature=0)


def use_arm(model: LocalModel, arm: str) -> None:
    """Point the model's speculative decoder and scheduler at `arm` (a fresh cache and pool either way)."""
    model.suffix_cache.clear()
    model.prefix_pool.clear()
    common = dict(tokenizer=model.tokenizer, cache=model.suffix_cache, prefix_pool=model.prefix_pool)
    decoder = build_decoder("suffix", model.engine, **common)
    inner = decoder.drafter.inner  # the suffix drafter, without its calibrated worths
    if arm == "unpriced":
        decoder = SpeculativeDecoder(model.engine, inner, decoder.controller, model.tokenizer,
                                     prefix_pool=model.prefix_pool)
    elif arm != "adaptive":
        decoder = SpeculativeDecoder(model.engine, inner, FixedController(int(arm.split("-")[1])), model.tokenizer,
                                     prefix_pool=model.prefix_pool)
    model._speculative = decoder
    model.scheduler.goodput = arm in ("adaptive", "unpriced")


async def together(model: LocalModel, requests: list[GenerationRequest],
                   streams: int | None = None) -> tuple[int, float]:
    """Tokens made and seconds taken by `requests`, `streams` in flight at a time (all at once if None): each
    that ends lets the next start, as a server's clients or `run --concurrency` do."""
    gate = asyncio.Semaphore(streams or len(requests))

    async def one(r: GenerationRequest) -> int:
        async with gate:
            return (await model.generate(r)).completion_tokens

    t0 = time.perf_counter()
    made = await asyncio.gather(*(one(r) for r in requests))
    return sum(made), time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--streams", default="1,2,4,8,16")
    parser.add_argument("--fixed", default="0,2,4,8,16")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--requests", type=int, help="requests per cell (default: the most streams)")
    parser.add_argument("--extra", default="", help="more arms: unpriced (chains sized by acceptance rates)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per cell (interleaved), the median reported")
    parser.add_argument("--out", type=Path, default=RESULTS / "goodput_sweep.json")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    arms = [f"fixed-{k}" for k in args.fixed.split(",")] + ["adaptive"] + [a for a in args.extra.split(",") if a]
    questions = [r["question"] for r in gsm8k("test")[400:400 + (args.requests or max(streams))]]
    load = os.getloadavg()
    model = LocalModel(args.model, dtype="gguf", drafter="suffix")
    # warm, two at once: the scheduler measures its forward cost by rows (once per engine) before any arm runs
    asyncio.run(together(model, [request("Two plus two.", 4), request("Three times three.", 4)]))
    runs: dict[str, dict[int, list[float]]] = {arm: {n: [] for n in streams} for arm in arms}
    for _ in range(args.repeat):
        for n in streams:
            for arm in arms:
                use_arm(model, arm)
                made, wall = asyncio.run(together(model, [request(q, args.tokens) for q in questions], n))
                runs[arm][n].append(made / wall)
                print(f"streams {n:2d} {arm:9s} {made / wall:6.1f} tok/s", flush=True)
    rates = {arm: {n: statistics.median(r) for n, r in by_n.items()} for arm, by_n in runs.items()}
    result = {"model": args.model, "tokens": args.tokens, "cpu": cpu_flags(), "load_average_before": load,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "repeat": args.repeat,
              "tok_s": rates, "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"`python bench/goodput_sweep.py`: {args.model} (dtype gguf), {len(questions)} requests of "
             f"{args.tokens} tokens at most, "
             f"{result['cpu']}, load average {load[0]:.2f} before, {result['date']}. Aggregate tok/s"
             f"{f' (the median of {args.repeat} interleaved runs)' if args.repeat > 1 else ''}:", "",
             "| streams | " + " | ".join(arms) + " | adaptive / best fixed |",
             "|---:|" + "---:|" * (len(arms) + 1)]
    for n in streams:
        best = max(rates[a][n] for a in arms if a.startswith("fixed"))
        lines.append(f"| {n} | " + " | ".join(f"{rates[a][n]:.1f}" for a in arms) +
                     f" | {rates['adaptive'][n] / best:.2f}x |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in arms:
        ax.plot(streams, [rates[arm][n] for n in streams], marker="o", label=arm,
                linewidth=2.5 if arm == "adaptive" else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_xticks(streams, [str(n) for n in streams])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tok/s")
    ax.set_title(f"{args.model}: draft length by goodput vs fixed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
