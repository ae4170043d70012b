"""Where the milliseconds of one decode step go: the int8 model's forward, op by op.

Loads a packaged model (default: Qwen2.5-Coder-1.5B, int8 as thinkahead runs it), prefills a GSM8K
chain-of-thought prompt, then decodes greedily one token per forward through `HFEngine` (the path
every plain decode step of ours takes). Reports, per decode step:
  - wall time of the engine forward, and of the bare `model(...)` call under it;
  - torch.profiler self-CPU time by op kind: the int8 linears (fbgemm `linear_dynamic`, activation
    scaling), attention (float64 SDPA and its casts), KV cache updates, the rest;
  - our native linear kernels (gguf, int8), timed around each call (the profiler sees no op inside);
  - the share of time outside torch ops and our kernels (Python: transformers' modules, our wrappers).
and the same for a verify forward of k tokens, so the cost curve of speculation is visible.

    python bench/decode_profile.py                      # 1.5B int8, 32 steps
    python bench/decode_profile.py --model qwen2.5-coder-0.5b --steps 64
    python bench/decode_profile.py --threads 1            # a loaded machine: see --help

Writes bench/results/decode_profile.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_data import gsm8k  # noqa: E402

from thinkahead.models.engine.weights.load import DTYPES, load_causal_lm  # noqa: E402
from thinkahead.models.engine.runner import HFEngine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = (  # (kind, substrings of a profiler op name), first match wins
    ("int8 linear (fbgemm)", ("quantized::linear_with_input_q_dq", "quantized::linear_dynamic", "quantized::linear")),
    ("activation scaling (ours)", ("aten::amax", "aten::div", "aten::clamp_min", "aten::abs",
                                   "aten::linalg_vector_norm")),
    ("attention (float64 sdpa)", ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_to_copy",
                                  "aten::baddbmm", "aten::bmm", "aten::softmax", "aten::_softmax", "aten::matmul")),
    ("concatenation (KV append, anchor row)", ("aten::cat",)),
    ("norms and activations", ("aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt", "aten::silu",
                               "aten::neg", "aten::sigmoid")),
    ("copies and views", ("aten::copy_", "aten::view", "aten::reshape", "aten::transpose", "aten::contiguous",
                          "aten::expand", "aten::slice", "aten::select", "aten::index", "aten::clone",
                          "aten::empty", "aten::to", "aten::unsqueeze", "aten::as_strided")),
)


def kind_of(name: str) -> str:
    for kind, keys in KINDS:
        if any(name.startswith(k) for k in keys):
            return kind
    return "other ops"


def cpu_flags() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
    named = " ".join(f for f in wanted if f in flags) or "none of " + ", ".join(wanted)
    return f"{named}, GGUF kernels {gguf_kernels()}"


def gguf_kernels() -> str:
    """Which build of the GGUF dot products runs here (kquant.py: the 512-bit one only where it pays)."""
    from thinkahead.models.engine.kernels import kquant

    return "unavailable" if kquant.unavailable_reason() else kquant.kernel().isa()


def save_result(out: Path, result: dict, markdown, load_before: tuple[float, float, float]) -> None:
    """`result` as OUT (JSON, with the load average before and after) and its markdown table as OUT.md, printed."""
    result["load_average"] = {"before": load_before, "after": os.getloadavg()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result, load_before)
    out.with_suffix(".md").write_text(table)
    print(table, end="")


NATIVE_KERNELS = "native linears (ours: gguf / int8 kernels, timed around each call)"


@contextlib.contextmanager
def timed_native_kernels(spent: list[float]):
    """Add the wall time of every call of our native linear kernels to spent[0] (the profiler sees no torch
    op inside them: without this they would count as time outside torch ops)."""
    from thinkahead.models.engine.kernels import int8_kernel, kquant

    def timing(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper

    originals = (kquant.GGUFLinear.forward, int8_kernel.linear)
    kquant.GGUFLinear.forward, int8_kernel.linear = timing(originals[0]), timing(originals[1])
    try:
        yield
    finally:
        kquant.GGUFLinear.forward, int8_kernel.linear = originals


def profile_forwards(engine: HFEngine, session, tokens: list[list[int]]) -> dict[str, float]:
    """Self-CPU ms per forward by op kind, over forwards of the given token lists (then rolled back)."""
    from torch.profiler import ProfilerActivity, profile

    start, native = session.length, [0.0]
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof, timed_native_kernels(native):
        t0 = time.perf_counter()
        for feed in tokens:
            engine.forward(session, feed)
        wall = time.perf_counter() - t0
    engine.truncate(session, start)
    by_kind: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        by_kind[kind_of(event.key)] += event.self_cpu_time_total / 1000.0
    by_kind[NATIVE_KERNELS] = 1000 * native[0]
    n = len(tokens)
    out = {k: round(v / n, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    out["(profiled wall)"] = round(1000 * wall / n, 3)
    out["(outside torch ops)"] = round(1000 * wall / n - sum(by_kind.values()) / n, 3)
    return out


def timed(engine: HFEngine, session, feed: list[int], repeats: int) -> float:
    """Median ms of a forward of `feed` on top of the session (rolled back after each)."""
    start, times = session.length, []
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.forward(session, feed)
            times.append(1000 * (time.perf_counter() - t0))
            engine.truncate(session, start)
    return round(median(times), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="int8", choices=DTYPES)
    ap.add_argument("--steps", type=int, default=32, help="decode steps to time and profile")
    ap.add_argument("--verify", default="1,2,4,8,16", help="verify widths k to time")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (0: torch's default). On a loaded machine 2 threads can be far "
                         "slower than 1: every parallel region waits for a descheduled worker")
    ap.add_argument("--out", default=str(RESULTS / "decode_profile"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    model, tokenizer = load_causal_lm(args.model, args.dtype)
    load_s = time.perf_counter() - t0
    engine = HFEngine(model)
    question = gsm8k("test")[0]["question"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    session = engine.new_session()
    with torch.inference_mode():
        logits = engine.forward(session, prompt, last_only=True)
        token = int(logits[-1].argmax())
        # decode greedily: the real path, one token per forward
        decoded, step_ms = [token], []
        for _ in range(args.steps):
            t = time.perf_counter()
            logits = engine.forward(session, [decoded[-1]])
            step_ms.append(1000 * (time.perf_counter() - t))
            decoded.append(int(logits[-1].argmax()))
    # profile the same decode steps again from the same place
    engine.truncate(session, len(prompt))
    profile = profile_forwards(engine, session, [[t] for t in decoded[: args.steps]])
    bare = []
    with torch.inference_mode():
        for t in decoded[:8]:
            ids = torch.tensor([[t]])
            s = time.perf_counter()
            model(input_ids=ids, use_cache=True, **{engine._cache_arg: session.cache})
            bare.append(1000 * (time.perf_counter() - s))
            session.length += 1
    engine.truncate(session, len(prompt))
    widths = [int(k) for k in args.verify.split(",")]
    verify = {k: timed(engine, session, decoded[:k], repeats=5) for k in widths}
    result = {
        "meta": {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
                 "cpu_flags": cpu_flags(), "machine": platform.machine(), "torch": torch.__version__,
                 "prompt_tokens": len(prompt), "load_s": round(load_s, 1),
                 "machine_load_average_1m": round(os.getloadavg()[0], 2),
                 "command": "python bench/decode_profile.py " + " ".join(sys.argv[1:])},
        "decode_step_ms_p50": round(median(step_ms), 2),
        "decode_tok_per_s": round(1000 / median(step_ms), 2),
        "bare_model_call_ms_p50": round(median(bare), 2),
        "profile_ms_per_step": profile,
        "verify_ms_by_k": verify,
        "verify_vs_decode": {k: round(v / verify[1], 2) for k, v in verify.items()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"`{result['meta']['command']}`: {args.model} {args.dtype}, {result['meta']['threads']} threads, "
             f"CPU flags {result['meta']['cpu_flags']}, prompt {len(prompt)} tokens, machine load average "
             f"{result['meta']['machine_load_average_1m']} at the end.", "",
             f"Decode step p50 {result['decode_step_ms_p50']} ms ({result['decode_tok_per_s']} tok/s); "
             f"the bare model call (no engine) {result['bare_model_call_ms_p50']} ms.", "",
             "| where (self CPU per decode step) | ms |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in profile.items()]
    lines += ["", "| verify width k | ms | vs k=1 |", "|---:|---:|---:|"]
    lines += [f"| {k} | {v} | {result['verify_vs_decode'][k]}x |" for k, v in verify.items()]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
