"""The native int8 kernel against fbgemm's inside the real model: decode steps and verify forwards.

Loads Qwen2.5-Coder-1.5B int8 from its weight-cache entry (fbgemm's packed weights), gives every
int8 linear both kernels' weights, and alternates them in one process: greedy decode steps from a
GSM8K-style prompt (p50 per step) and verify forwards of k tokens, for several rounds. Checks that
both kernels give bit-identical logits on every step.

    python bench/int8_kernel_decode.py                 # needs a weight-cache entry of the 1.5B int8
    python bench/int8_kernel_decode.py --steps 32 --rounds 3
    python bench/int8_kernel_decode.py --threads 1 --out bench/results/int8_kernel_micro_decode_1thread

Writes bench/results/int8_kernel_micro_decode.{json,md} (or --out): shown on the int8_kernel_micro page.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_kernel_micro import cpu_flags

from thinkahead.models.engine.kernels import int8_kernel
from thinkahead.models.engine.kernels.quantize import (
    X_SCALE,
    X_ZERO_POINT,
    RowwiseInt8Linear,
    unpack_int8,
)

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May? Let's think step by step.")


def load(label: str) -> tuple[Any, Any]:
    """The newest weight-cache entry of `label` (whatever its key), rebuilt as the loader would."""
    from thinkahead.models.registry import default_cache_dir
    from thinkahead.models.engine.weights.rebuild import rebuild

    entries = sorted((default_cache_dir() / "weight-cache").glob(f"{label}-int8-*"), key=lambda p: p.stat().st_mtime)
    if not entries:
        raise SystemExit(f"no weight-cache entry for {label} int8: load it once (thinkahead run) first")
    return rebuild(entries[-1], entries[-1] / "model.safetensors", "int8", label)


def run(model: Any, ids: torch.Tensor, steps: int, widths: list[int]) -> tuple[float, dict[int, float], torch.Tensor]:
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        logits, times = [out.logits[:, -1]], []
        for _ in range(steps):
            token = logits[-1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            times.append(1000 * (time.perf_counter() - t0))
            logits.append(out.logits[:, -1])
        verify = {}
        for k in widths:
            ks = []
            for _ in range(3):
                t0 = time.perf_counter()
                model(input_ids=torch.full((1, k), 100), past_key_values=cache, use_cache=True)
                ks.append(1000 * (time.perf_counter() - t0))
                cache.crop(-k)
            verify[k] = round(median(ks), 1)
    return round(median(times), 1), verify, torch.cat(logits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--widths", default="1,4,8,16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=str(RESULTS / "int8_kernel_micro_decode"))
    args = ap.parse_args()
    if not int8_kernel.native_available():
        raise SystemExit("the native int8 kernel is not available here (build it: python setup.py build_ext --inplace)")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    model, tokenizer = load(args.model)
    layers = [m for m in model.modules() if isinstance(m, RowwiseInt8Linear)]
    kernels = {"fbgemm": {m: m._packed for m in layers},
               "native": {m: int8_kernel.pack(*unpack_int8(m._packed), X_SCALE, X_ZERO_POINT) for m in layers}}
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    widths = [int(k) for k in args.widths.split(",")]
    rounds: list[dict[str, Any]] = []
    logits: dict[str, torch.Tensor] = {}
    for r in range(args.rounds):
        for name, packed in kernels.items():
            for m in layers:
                m._packed = packed[m]
            step_ms, verify, logits[name] = run(model, ids, args.steps, widths)
            rounds.append({"round": r, "kernel": name, "decode_step_ms_p50": step_ms, "verify_ms": verify})
            print(json.dumps(rounds[-1]), flush=True)
    identical = torch.equal(logits["fbgemm"], logits["native"])
    summary = {name: {"decode_step_ms": round(median(x["decode_step_ms_p50"] for x in rounds if x["kernel"] == name), 1),
                      "verify_ms": {k: round(median(x["verify_ms"][k] for x in rounds if x["kernel"] == name), 1)
                                    for k in widths}}
               for name in kernels}
    meta = {"command": "python bench/int8_kernel_decode.py " + " ".join(sys.argv[1:]), "model": args.model,
            "cpu_flags": cpu_flags(), "threads": torch.get_num_threads(),
            "native_threading": int8_kernel.EXTENSION.load().threading(), "torch": torch.__version__,
            "prompt_tokens": int(ids.shape[1]), "steps": args.steps, "logits_bit_identical": identical,
            "load_average_before": [round(v, 2) for v in load_before],
            "load_average_after": [round(v, 2) for v in os.getloadavg()]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "rounds": rounds}, indent=1) + "\n")
    lines = [(f"`{meta['command']}`: {args.model} int8, CPU flags {meta['cpu_flags']}, {meta['threads']} threads "
              f"(native on {meta['native_threading']}), prompt {meta['prompt_tokens']} tokens, {args.steps} greedy "
              f"steps x {args.rounds} rounds alternated; logits bit-identical on every step: "
              f"{'yes' if identical else 'NO'}; load average {meta['load_average_before'][0]} before, "
              f"{meta['load_average_after'][0]} after."), "",
             "| kernel | decode step ms (median of round p50s) | " + " | ".join(f"verify k={k} ms" for k in widths) + " |",
             "|---|---:|" + "---:|" * len(widths)]
    lines += [f"| {name} | {s['decode_step_ms']} | " + " | ".join(str(s["verify_ms"][k]) for k in widths) + " |"
              for name, s in summary.items()]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
