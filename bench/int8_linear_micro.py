"""Micro-benchmark of single linear layers of the int8 engine: kernel candidates side by side.

For each shape of Qwen2.5-1.5B (q/o 1536x1536, k/v 1536x256, gate/up 1536x8960, down 8960x1536,
lm_head 1536x151936) and batch 1 and 8, times every candidate alternately in one process (medians),
so a loaded machine inflates all of them alike, and checks that each candidate's rows are
bit-identical alone and in a batch (the exactness every speculative verify relies on).

    python bench/int8_linear_micro.py                    # all shapes
    python bench/int8_linear_micro.py --shapes 1536x8960 --repeats 50

Writes bench/results/int8_linear_micro.{json,md} (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from statistics import median

import torch

os.environ.setdefault("THINKAHEAD_INT8_KERNEL", "fbgemm")  # this bench times fbgemm's packed weights

from thinkahead.models.engine.kernels.quantize import RowwiseInt8Linear

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = ("1536x1536", "1536x256", "1536x8960", "8960x1536", "1536x151936")


def reference_forward(layer: RowwiseInt8Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """The forward RowwiseInt8Linear had before this work: abs/amax/clamp/div, an anchor row by cat."""
    anchor = torch.zeros(1, layer.in_features)
    anchor[0, 0], anchor[0, 1] = 1.0, -1.0
    packed = layer._packed

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, layer.in_features).float()
        row_max = rows.abs().amax(1, keepdim=True).clamp_min(1e-30)
        scaled = torch.cat([rows / row_max, anchor])
        out = torch.ops.quantized.linear_dynamic(scaled, packed, True)[:-1] * row_max
        if layer.bias is not None:
            out = out + layer.bias
        return out

    return run


def raw_dynamic(layer: RowwiseInt8Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """fbgemm's kernel alone (not batch-invariant): the floor for any fbgemm-based forward."""
    packed = layer._packed
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)


def float_mm(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """fp32 MKL matmul (4x the bytes of int8): what the weights would cost unquantized."""
    wt = weight.t().contiguous().t()
    return lambda x: torch.nn.functional.linear(x, wt)


def int4_pack(weight: torch.Tensor, group: int = 32) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """aten's CPU int4 weight kernel (groupwise scale/zero, float activations)."""
    try:
        n, k = weight.shape
        w = weight.reshape(n, k // group, group)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        zero = lo + 8 * scale
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.stack([scale.t(), zero.t()], -1).contiguous()  # [k/group, n, 2]
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)
    except Exception as exc:  # noqa: BLE001 - a candidate this build lacks is reported, not fatal
        print(f"int4pack unavailable: {exc}", file=sys.stderr)
        return None


def int_mm(layer: RowwiseInt8Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch._int_mm (int8 x int8 -> int32) with our own per-row quantization."""
    qweight, _ = torch.ops.quantized.linear_unpack(layer._packed)
    wt = qweight.int_repr().t().contiguous()
    scales = qweight.q_per_channel_scales().float()

    def run(x: torch.Tensor) -> torch.Tensor:
        row_max = x.abs().amax(1, keepdim=True).clamp_min(1e-30)
        q = (x * (127 / row_max)).round_().to(torch.int8)
        return torch._int_mm(q, wt) * (scales * (row_max / 127))

    return run


def with_threads(fn: Callable, threads: int) -> Callable:
    def run(x: torch.Tensor) -> torch.Tensor:
        torch.set_num_threads(threads)
        return fn(x)

    return run


def time_alternating(cands: dict[str, Callable], x: torch.Tensor, repeats: int, clock: Callable[[], float]
                     ) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in cands}
    with torch.inference_mode():
        for fn in cands.values():
            fn(x)
        for _ in range(repeats):
            for name, fn in cands.items():
                t0 = clock()
                fn(x)
                times[name].append(1000 * (clock() - t0))
    return {name: round(median(t), 4) for name, t in times.items()}


def batch_invariant(fn: Callable, x: torch.Tensor) -> bool:
    with torch.inference_mode():
        full = fn(x)
        return all(torch.equal(fn(x[i : i + 1])[0], full[i]) for i in range(x.shape[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="INxOUT, comma-separated")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--candidates", default="", help="semicolon-separated subset (default: all)")
    ap.add_argument("--threads", default="", help="comma-separated thread counts to alternate (default: torch's)")
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                    help="cpu: this thread's CPU time (meaningful with --threads 1 on a loaded machine, where "
                         "preemption inflates wall times)")
    ap.add_argument("--out", default=str(RESULTS / "int8_linear_micro"))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.backends.quantized.engine = "fbgemm"
    rows = []
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        linear = torch.nn.Linear(k, n, bias=n <= 1536)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layer = RowwiseInt8Linear(linear)
        cands: dict[str, Callable | None] = {
            "reference (anchor row, cat)": reference_forward(layer),
            "RowwiseInt8Linear now": layer,
            "fbgemm linear_dynamic alone": raw_dynamic(layer),
            "fp32 matmul": float_mm(linear.weight.detach()),
            "int4pack (group 32)": int4_pack(linear.weight.detach()),
            "torch._int_mm": int_mm(layer),
        }
        wanted = [c for c in args.candidates.split(";") if c]
        live = {name: fn for name, fn in cands.items() if fn is not None and (not wanted or name in wanted)}
        if args.threads:
            live = {f"{name} @{n}t": with_threads(fn, int(n)) for name, fn in live.items()
                    for n in args.threads.split(",")}
        for batch in (int(b) for b in args.batches.split(",")):
            x = torch.randn(batch, k)
            clock = time.thread_time if args.clock == "cpu" else time.perf_counter
            ms = time_alternating(live, x, args.repeats, clock)
            invariant = {name: batch_invariant(fn, torch.randn(8, k)) for name, fn in live.items()}
            base = next((v for name, v in ms.items() if name.startswith("reference")), None)
            for name in live:
                rows.append({"shape": shape, "batch": batch, "candidate": name, "ms": ms[name],
                             "vs_reference": round(ms[name] / base, 3) if base else None,
                             "rows_bit_identical": invariant[name]})
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads or torch.get_num_threads(), "torch": torch.__version__, "repeats": args.repeats,
            "clock": args.clock,
            "command": "python bench/int8_linear_micro.py " + " ".join(sys.argv[1:])}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [(f"`{meta['command']}`, {meta['threads']} threads, torch {meta['torch']}, {args.clock} clock "
              "(medians, candidates alternated)."), "",
             "| shape in x out | batch | candidate | ms | vs reference | rows bit-identical alone/batched |",
             "|---|---:|---|---:|---:|---|"]
    lines += [f"| {r['shape']} | {r['batch']} | {r['candidate']} | {r['ms']} | {r['vs_reference']} | "
              f"{'yes' if r['rows_bit_identical'] else 'NO'} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
