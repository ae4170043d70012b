"""Goodput-sized speculation against fixed draft lengths, by load (issue 34's sweep).

N concurrent greedy "copy this text" requests (each a different GSM8K test question to copy word for word:
drafts from the prompt hit often) to one `LocalModel` (dtype gguf), for N in `--streams`, under each arm:
`fixed-K` verifies K drafted tokens every round whatever the load (a `FixedController(K)` decoder, the
scheduler's goodput plan off), `adaptive` is the library's default (the adaptive controller alone, the
scheduler's goodput plan in a batch). Every arm uses the suffix drafter over a fresh suffix cache and prefix
pool, so no run drafts from another's outputs. Reported: aggregate tok/s per arm and load, and whether
adaptive is within `--tolerance` of the best fixed arm at that load.

Writes bench/results/goodput_sweep.json, .md and .png (matplotlib, the bench extra). Run:
  python bench/goodput_sweep.py                       # 1.5B, streams 1,2,4,8,16, fixed 0,2,4,8,16
  python bench/goodput_sweep.py --model qwen2.5-coder-0.5b --streams 1,4 --fixed 0,4 --tokens 24   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from thinkahead.token_spec.value_calibration import CalibratedDrafter

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
    if arm == "priced":
        decoder = SpeculativeDecoder(model.engine, CalibratedDrafter(decoder.drafter), decoder.controller,
                                     model.tokenizer, prefix_pool=model.prefix_pool)
    elif arm != "adaptive":
        decoder = SpeculativeDecoder(model.engine, decoder.drafter, FixedController(int(arm.split("-")[1])),
                                     model.tokenizer, prefix_pool=model.prefix_pool)
    model._speculative = decoder
    model.scheduler.goodput = arm in ("adaptive", "priced")


async def together(model: LocalModel, requests: list[GenerationRequest]) -> tuple[int, float]:
    t0 = time.perf_counter()
    done = await asyncio.gather(*(model.generate(r) for r in requests))
    return sum(c.completion_tokens for c in done), time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--streams", default="1,2,4,8,16")
    parser.add_argument("--fixed", default="0,2,4,8,16")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--extra", default="", help="more arms, e.g. priced")
    parser.add_argument("--tolerance", type=float, default=0.05, help="adaptive within this share of the best")
    parser.add_argument("--out", type=Path, default=RESULTS / "goodput_sweep.json")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    arms = [f"fixed-{k}" for k in args.fixed.split(",")] + ["adaptive"] + [a for a in args.extra.split(",") if a]
    questions = [r["question"] for r in gsm8k("test")[400:400 + max(streams)]]
    load = os.getloadavg()
    model = LocalModel(args.model, dtype="gguf", drafter="suffix")
    # warm, two at once: the scheduler measures its forward cost by rows (once per engine) before any arm runs
    asyncio.run(together(model, [request("Two plus two.", 4), request("Three times three.", 4)]))
    rates: dict[str, dict[int, float]] = {arm: {} for arm in arms}
    for n in streams:
        for arm in arms:
            use_arm(model, arm)
            made, wall = asyncio.run(together(model, [request(q, args.tokens) for q in questions[:n]]))
            rates[arm][n] = made / wall
            print(f"streams {n:2d} {arm:9s} {rates[arm][n]:6.1f} tok/s", flush=True)
    result = {"model": args.model, "tokens": args.tokens, "cpu": cpu_flags(), "load_average_before": load,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "tok_s": rates}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"`python bench/goodput_sweep.py`: {args.model} (dtype gguf), {args.tokens} tokens per stream, "
             f"{result['cpu']}, load average {load[0]:.2f} before, {result['date']}. Aggregate tok/s:", "",
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
