"""Many streams at once on one local model (issue 34): aggregate decode throughput against one stream at a time.

N concurrent greedy chat completions of N distinct GSM8K test problems (chain of thought, `--tokens` each), sent
to one `LocalModel` (the GGUF kernels, its `BatchScheduler`) with asyncio, for N in `--streams`; the baseline is
the same problems one at a time (N = 1) in the same process. Per arm (`--arms`: "plain" decodes one token per
forward; any other is a drafter's name, e.g. "suffix", "combined", "head": a `LocalModel` with it), the suffix cache and the KV prefix pool are cleared before
every N, so no run drafts from another's outputs. Reported per N: aggregate tok/s (all completion tokens over
the wall time), the ratio to the arm's own one-at-a-time rate, the slowest reply, the largest time to first
token, the largest batch the scheduler ran, and whether every reply's tokens equal the one-at-a-time reply's.

The baseline users would pick, `--llama-server BINARY` (optional, never in CI): llama.cpp's own server on the
same GGUF file, `-t 2 --parallel <most streams>` (continuous batching), sent the same chat requests (greedy,
the same token limit) for each N, in three settings: plain, `--spec-type ngram-simple`, and the 0.5B as `-md`
draft model. Its decode rate is what it reports (`timings.predicted_per_second`), summed over the streams.
Build it from the llama.cpp source that llama-cpp-python's sdist vendors (about 10 minutes on 2 cores):
  pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
  cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF && cmake --build build --target llama-server -j 2
On a CPU with AMX (Intel Sapphire Rapids on) that build's AMX matmul segfaults at the first forward
(ggml_backend_amx_mul_mat, seen on a 2-vCPU Xeon); build its AVX-512 kernels without AMX there instead:
  cmake -B build -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON \
      -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF

Writes bench/results/batching.json and .md (a markdown table, also printed); the CPU's flags and the load
average go in them (timings on a busy machine do not compare). Run:
  python bench/batching.py                         # 1.5B, streams 1,2,4,8, 128 tokens, arms plain,suffix
  python bench/batching.py --llama-server build/bin/llama-server   # with llama.cpp's server beside ours
  python bench/batching.py --model qwen2.5-coder-0.5b --streams 1,4 --tokens 32   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from decode_profile import cpu_flags, save_result  # bench/ is the script's folder

from thinkahead.evals.data import gsm8k
from thinkahead.models import LocalModel
from thinkahead.models.base import Completion, GenerationRequest
from thinkahead.models.registry import prepare
from thinkahead.token_spec.names import DRAFTER_KINDS

RESULTS = Path(__file__).resolve().parent / "results"
OFFSET = 300  # GSM8K test problems 300.. (no policy was tuned on them)


SYSTEM = "Solve the problem step by step, then give the final answer."
LLAMA_SETTINGS = {"llama-server": [], "llama-server ngram": ["--spec-type", "ngram-simple"],
                  "llama-server -md 0.5B": ["-md", "DRAFT"]}


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def request(question: str, tokens: int, speculative: bool) -> GenerationRequest:
    return GenerationRequest(messages=messages(question), max_new_tokens=tokens, temperature=0, speculative=speculative)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def llama_together(url: str, questions: list[str], tokens: int) -> tuple[list[dict], float]:
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(q: str) -> dict:
            body = {"messages": messages(q), "max_tokens": tokens, "temperature": 0, "seed": 0}
            reply = await client.post(f"{url}/v1/chat/completions", json=body)
            reply.raise_for_status()
            return reply.json()

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(q) for q in questions))
        return list(done), time.perf_counter() - t0


def llama_arm(binary: str, model: str, extra: list[str], questions: list[str], streams: list[int],
              tokens: int) -> list[dict]:
    """llama.cpp's server on the same GGUF, `--parallel` the most streams, each N as for ours."""
    port, most = free_port(), max(streams)
    extra = [prepare("qwen2.5-coder-0.5b") if a == "DRAFT" else a for a in extra]
    cmd = [binary, "-m", str(prepare(model)), "-t", "2", "--parallel", str(most), "-c", str(1024 * most),
           "--host", "127.0.0.1", "--port", str(port), *map(str, extra)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        asyncio.run(llama_together(url, ["What is 2 + 3?"], 4))  # warm
        rows = []
        for n in streams:
            if n == 1:
                runs = [asyncio.run(llama_together(url, [q], tokens)) for q in questions[:most]]
                done, wall = [d for r, _ in runs for d in r], sum(w for _, w in runs)
            else:
                done, wall = asyncio.run(llama_together(url, questions[:n], tokens))
            made = sum(d["usage"]["completion_tokens"] for d in done)
            decode = sum(d["timings"]["predicted_per_second"] for d in done) / (len(done) if n == 1 else 1)
            rows.append({"streams": n, "tok_s": made / wall, "decode_tok_s": decode, "slowest_s": wall if n > 1 else
                         max(d["timings"]["prompt_ms"] + d["timings"]["predicted_ms"] for d in done) / 1000})
        return rows
    finally:
        server.terminate()
        server.wait(timeout=30)


def fresh(model: LocalModel) -> None:
    model.suffix_cache.clear()
    model.prefix_pool.clear()


async def together(model: LocalModel, requests: list[GenerationRequest]) -> tuple[list[Completion], float]:
    t0 = time.perf_counter()
    done = await asyncio.gather(*(model.generate(r) for r in requests))
    return list(done), time.perf_counter() - t0


def decode_rate(c: Completion) -> float:
    """A reply's decode speed: the tokens after its first over the time after its first."""
    return (c.completion_tokens - 1) / max(c.time_s - (c.first_token_s or 0.0), 1e-9)


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
    solo_decode = sum(decode_rate(c) for c in solo) / len(solo)
    rows = [{"streams": 1, "tok_s": solo_rate, "ratio": 1.0, "decode_tok_s": solo_decode, "decode_ratio": 1.0,
             "slowest_s": max(c.time_s for c in solo), "max_ttft_s": max(c.first_token_s or 0.0 for c in solo),
             "peak_batch": 1, "exact": True}]
    for n in [s for s in streams if s > 1]:
        fresh(model)
        model.scheduler.peak_batch = 0
        done, wall = asyncio.run(together(model, [request(q, tokens, speculative) for q in questions[:n]]))
        rate = sum(c.completion_tokens for c in done) / wall
        decode = sum(decode_rate(c) for c in done)
        rows.append({"streams": n, "tok_s": rate, "ratio": rate / solo_rate, "decode_tok_s": decode,
                     "decode_ratio": decode / solo_decode, "slowest_s": wall,
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
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary: its arms beside ours (see above)")
    args = parser.parse_args()
    streams = sorted({int(s) for s in args.streams.split(",")} | {1})
    questions = [r["question"] for r in gsm8k("test")[OFFSET:OFFSET + max(streams)]]
    load_before = os.getloadavg()
    arms = args.arms.split(",")
    unknown = [a for a in arms if a != "plain" and a not in DRAFTER_KINDS]
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(unknown)}: plain or a drafter ({', '.join(DRAFTER_KINDS)})")
    models = {arm: LocalModel(args.model, dtype="gguf", drafter="none" if arm == "plain" else arm) for arm in arms}
    for model in models.values():
        # warm the kernels and the template; two drafting at once: the scheduler measures its forward cost by rows
        asyncio.run(together(model, [request("What is 2 + 3?", 4, True), request("What is 4 + 5?", 4, True)]))
    result: dict[str, Any] = {"model": args.model, "tokens": args.tokens, "cpu": cpu_flags(),
                              "threads": __import__("torch").get_num_threads(),
                              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "arms": {}}
    for arm, model in models.items():
        result["arms"][arm] = run_arm(model, questions, streams, args.tokens, speculative=arm != "plain")
    if args.llama_server:
        result["llama_server"] = {name: llama_arm(args.llama_server, args.model, extra, questions,
                                                  [s for s in streams if s <= 8], args.tokens)
                                  for name, extra in LLAMA_SETTINGS.items()}
    save_result(args.out, result, markdown, load_before)


def markdown(result: dict[str, Any], load: tuple[float, float, float]) -> str:
    lines = [f"`python bench/batching.py`: {result['model']} (dtype gguf), {result['tokens']} tokens per stream, "
             f"{result['threads']} threads, {result['cpu']}, load average {load[0]:.2f} before, {result['date']}.", "",
             "| arm | streams | aggregate tok/s | vs one at a time | decode tok/s (sum of streams) | vs one at a time "
             "| slowest reply s | max time to first token s | peak batch | every reply = its solo reply |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for arm, rows in result["arms"].items():
        for r in rows:
            lines.append(f"| {arm} | {r['streams']} | {r['tok_s']:.1f} | {r['ratio']:.2f}x | {r['decode_tok_s']:.1f} | "
                         f"{r['decode_ratio']:.2f}x | {r['slowest_s']:.1f} | {r['max_ttft_s']:.2f} | "
                         f"{r['peak_batch']} | {'yes' if r['exact'] else 'NO'} |")
    if result.get("llama_server"):
        ours = {r["streams"]: r for r in result["arms"]["plain"]}
        lines += ["", "llama.cpp's server on the same file and requests, `-t 2 --parallel "
                  f"{max(r['streams'] for rows in result['llama_server'].values() for r in rows)}`:", "",
                  "| setting | streams | aggregate tok/s | decode tok/s (sum of streams) | slowest reply s "
                  "| ours (plain) / it, aggregate |", "|---|---:|---:|---:|---:|---:|"]
        for name, rows in result["llama_server"].items():
            for r in rows:
                mine = ours.get(r["streams"])
                ratio = f"{mine['tok_s'] / r['tok_s']:.2f}x" if mine else ""
                lines.append(f"| {name} | {r['streams']} | {r['tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
                             f"{r['slowest_s']:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
