"""A long prompt joins a busy model (issue 34): do the streams already decoding, and the short requests that join
beside it, wait for its prefill?

One `LocalModel` (the GGUF kernels, its `BatchScheduler`, default settings). `--streams` greedy chat completions
of GSM8K test problems (300..) decode (`--tokens` each, streamed). Once every one has its first token, `--joiners`
short GSM8K problems join, and in the second phase a prompt of `--long` tokens (GSM8K train problems one after
another, then a question about them) joins at the same moment, just before them. Measured per phase, in the same
process: each joiner's time to first token, the longest gap between two tokens of any decoding stream while the
joiners start, and the long prompt's own time to first token. The first phase (no long prompt) is the baseline.
Every joiner's tokens must be the same in both phases (greedy, batch-invariant kernels).

Writes bench/results/long_prompt_join.json and .md (the CPU's flags and the load average go in them):
  python bench/long_prompt_join.py                                  # 1.5B, 16 streams, an 8k-token prompt
  python bench/long_prompt_join.py --model qwen2.5-coder-0.5b --streams 4 --long 1024 --tokens 32   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from decode_profile import cpu_flags, save_result  # bench/ is the script's folder

from thinkahead.evals.data import gsm8k
from thinkahead.models import LocalModel
from thinkahead.models.base import Completion, GenerationRequest, TextDelta

RESULTS = Path(__file__).resolve().parent / "results"
OFFSET = 300  # GSM8K test problems 300.. (no policy was tuned on them)
SYSTEM = "Solve the problem step by step, then give the final answer."


def request(question: str, tokens: int) -> GenerationRequest:
    return GenerationRequest(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                             max_new_tokens=tokens, temperature=0)


def long_question(model: LocalModel, tokens: int) -> str:
    """GSM8K train problems, numbered, until the text holds `tokens` tokens, then a question about them."""
    parts: list[str] = []
    for i, row in enumerate(gsm8k("train")):
        parts.append(f"Problem {i + 1}: {row['question']}")
        if len(model.encode("\n\n".join(parts))) >= tokens:
            break
    return "\n\n".join(parts) + "\n\nWhich of the problems above mentions the largest amount of money?"


class Timed:
    """A streamed generation: when it was sent, and when each piece of its text came."""

    def __init__(self) -> None:
        self.sent = 0.0
        self.times: list[float] = []
        self.done: Completion | None = None

    async def run(self, model: LocalModel, req: GenerationRequest, first: asyncio.Event | None = None) -> None:
        self.sent = time.perf_counter()
        async for item in model.stream(req):
            if isinstance(item, TextDelta):
                self.times.extend([time.perf_counter()] * max(len(item.token_ids), 1))
                if first is not None and not first.is_set():
                    first.set()
            else:
                self.done = item

    def ttft(self) -> float:
        return self.times[0] - self.sent if self.times else float("inf")

    def longest_gap(self, start: float, end: float) -> float:
        """The longest wait between two of its tokens that overlaps [start, end]."""
        gaps = [b - a for a, b in zip(self.times, self.times[1:]) if b >= start and a <= end]
        return max(gaps, default=0.0)


async def phase(model: LocalModel, questions: list[str], joiners: list[str], long: str | None,
                tokens: int) -> dict[str, Any]:
    streams = [Timed() for _ in questions]
    firsts = [asyncio.Event() for _ in questions]
    decoding = [asyncio.create_task(s.run(model, request(q, tokens), f)) for s, q, f in zip(streams, questions, firsts)]
    await asyncio.gather(*(f.wait() for f in firsts))
    joined = time.perf_counter()
    late = Timed()
    extra = [asyncio.create_task(late.run(model, request(long, 8)))] if long is not None else []
    await asyncio.sleep(0)  # the long prompt is submitted first
    joins = [Timed() for _ in joiners]
    await asyncio.gather(*(j.run(model, request(q, 16)) for j, q in zip(joins, joiners)))
    settled = max(j.times[0] for j in joins)
    await asyncio.gather(*decoding, *extra)
    return {
        "joiner_ttft_s": [round(j.ttft(), 3) for j in joins],
        "decoder_longest_gap_s": round(max(s.longest_gap(joined, settled) for s in streams), 3),
        "long_ttft_s": round(late.ttft(), 2) if long is not None else None,
        "long_prompt_tokens": late.done.prompt_tokens if late.done is not None else None,
        "joiner_tokens": [j.done.token_ids if j.done else [] for j in joins],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--joiners", type=int, default=4)
    parser.add_argument("--long", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prefill-chunk", type=int, help="the engine's prefill_chunk (default: EngineConfig's)")
    parser.add_argument("--out", type=Path, default=RESULTS / "long_prompt_join.json")
    args = parser.parse_args()
    rows = gsm8k("test")[OFFSET:OFFSET + args.streams + args.joiners]
    questions = [r["question"] for r in rows[:args.streams]]
    joiners = [r["question"] for r in rows[args.streams:]]
    load_before = os.getloadavg()
    model = LocalModel(args.model, **({} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}))
    long = long_question(model, args.long)
    asyncio.run(phase(model, questions[:1], joiners[:1], None, 4))  # warm the kernels and the template
    result: dict[str, Any] = {"model": args.model, "streams": args.streams, "tokens": args.tokens, "cpu": cpu_flags(),
                              "threads": __import__("torch").get_num_threads(), "prefill_chunk": model.scheduler.prefill_chunk,
                              "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    for name, prompt in (("without the long prompt", None), ("with the long prompt", long)):
        model.prefix_pool.clear()
        model.suffix_cache.clear()
        result[name] = asyncio.run(phase(model, questions, joiners, prompt, args.tokens))
    a, b = result["without the long prompt"], result["with the long prompt"]
    result["joiners_exact"] = a.pop("joiner_tokens") == b.pop("joiner_tokens")
    save_result(args.out, result, markdown, load_before)


def markdown(result: dict[str, Any], load: tuple[float, float, float]) -> str:
    lines = [f"`python bench/long_prompt_join.py`: {result['model']}, {result['streams']} streams decoding "
             f"({result['tokens']} tokens each), prefill pieces of {result['prefill_chunk']} tokens, "
             f"{result['threads']} threads, {result['cpu']}, load average {load[0]:.2f} before, {result['date']}.", "",
             "| phase | joiners' time to first token, s | longest gap of a decoding stream while they start, s "
             "| long prompt: tokens, time to first token s |", "|---|---|---:|---|"]
    for name in ("without the long prompt", "with the long prompt"):
        r = result[name]
        long = f"{r['long_prompt_tokens']}, {r['long_ttft_s']}" if r["long_ttft_s"] is not None else "-"
        lines.append(f"| {name} | {', '.join(f'{t:.2f}' for t in r['joiner_ttft_s'])} | "
                     f"{r['decoder_longest_gap_s']:.2f} | {long} |")
    lines.append("")
    lines.append(f"Each joiner's tokens the same in both phases: {'yes' if result['joiners_exact'] else 'NO'}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
