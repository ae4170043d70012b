"""The native AVX2 int8 linear against fbgemm's, on the shapes of Qwen2.5-1.5B, rows 1 to 64.

Both kernels run behind `RowwiseInt8Linear` (built with THINKAHEAD_INT8_KERNEL=fbgemm, and native) from
the same float weights, alternated in one process (medians), each timed call preceded by a read of a
buffer larger than the L3 cache so that weights come from memory as in a decode step (which streams
1.5 GB of weights). For every shape and row count it checks that the native output equals fbgemm's bit
for bit, that every row computed alone equals the same row in the batch, and that 1 and 2 threads give
the same bits. It also times building each kernel's weights (fbgemm's prepack runs at every model load).

    python bench/int8_kernel_micro.py
    python bench/int8_kernel_micro.py --shapes 1536x1536 --rows 1,8 --repeats 5

Writes bench/results/int8_kernel_micro.{json,md} (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

import torch

from thinkahead.models.engine.kernels import int8_kernel
from thinkahead.models.engine.kernels.quantize import RowwiseInt8Linear

RESULTS = Path(__file__).resolve().parent / "results"
# (in x out, what it is in Qwen2.5-1.5B)
SHAPES = {"1536x2048": "q/k/v fused", "1536x1536": "o_proj", "1536x17920": "gate/up fused",
          "8960x1536": "down_proj", "1536x151936": "lm_head"}
ROWS = (1, 2, 4, 8, 16, 32, 64)
FLUSH_BYTES = 96 << 20  # three times this CPU's 32 MB L3


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    have = set(flags.split(":", 1)[1].split())
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")
    return " ".join(f if f in have else f"no {f}" for f in wanted)


def build(linear: torch.nn.Linear, kernel: str) -> tuple[RowwiseInt8Linear, float]:
    os.environ[int8_kernel.ENV_KERNEL] = kernel
    try:
        t0 = time.perf_counter()
        layer = RowwiseInt8Linear(linear)
        return layer, time.perf_counter() - t0
    finally:
        del os.environ[int8_kernel.ENV_KERNEL]


def timed(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, flush: torch.Tensor) -> float:
    flush.sum()  # evict the weights from the caches (and leave torch's threads as a decode step does)
    t0 = time.perf_counter()
    layer(x)
    return 1000 * (time.perf_counter() - t0)


def rows_alone_equal(layer: RowwiseInt8Linear, x: torch.Tensor, full: torch.Tensor) -> bool:
    return all(torch.equal(layer(x[i : i + 1])[0], full[i]) for i in range(x.shape[0]))


def same_with_threads(layer: RowwiseInt8Linear, x: torch.Tensor, full: torch.Tensor) -> bool:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return torch.equal(layer(x), full)
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="INxOUT, comma-separated")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=str(RESULTS / "int8_kernel_micro"))
    args = ap.parse_args()
    if not int8_kernel.native_available():
        raise SystemExit("the native int8 kernel is not available here (build it: python setup.py build_ext --inplace)")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    torch.backends.quantized.engine = "fbgemm"
    flush = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32)
    load_before = os.getloadavg()
    rows_out, builds = [], []
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        linear = torch.nn.Linear(k, n, bias=n <= 2048)  # q/k/v carry a bias in Qwen2
        fbgemm, fbgemm_s = build(linear, int8_kernel.FBGEMM)
        native, native_s = build(linear, int8_kernel.NATIVE)
        builds.append({"shape": shape, "layer": SHAPES.get(shape, ""), "fbgemm_build_s": round(fbgemm_s, 3),
                       "native_build_s": round(native_s, 3)})
        print(json.dumps(builds[-1]), flush=True)
        with torch.inference_mode():
            for m in (int(v) for v in args.rows.split(",")):
                x = torch.randn(m, k)
                x[0] *= 50.0  # an outlier row
                ref, got = fbgemm(x), native(x)
                times: dict[str, list[float]] = {"fbgemm": [], "native": []}
                for _ in range(args.repeats):
                    times["fbgemm"].append(timed(fbgemm, x, flush))
                    times["native"].append(timed(native, x, flush))
                fb, nat = median(times["fbgemm"]), median(times["native"])
                row = {"shape": shape, "layer": SHAPES.get(shape, ""), "rows": m, "fbgemm_ms": round(fb, 3),
                       "native_ms": round(nat, 3), "speedup": round(fb / nat, 2),
                       "native_weight_gb_s": round(k * n / nat / 1e6, 1),
                       "bit_identical_to_fbgemm": torch.equal(ref, got),
                       "max_abs_diff": float((ref - got).abs().max()),
                       "rows_alone_equal_batch": rows_alone_equal(native, x, got),
                       "same_bits_1_and_n_threads": same_with_threads(native, x, got)}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    meta = {"command": "python bench/int8_kernel_micro.py " + " ".join(sys.argv[1:]),
            "cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(),
            "threads": torch.get_num_threads(), "native_threading": int8_kernel.EXTENSION.load().threading(),
            "torch": torch.__version__, "repeats": args.repeats,
            "load_average_before": [round(v, 2) for v in load_before],
            "load_average_after": [round(v, 2) for v in os.getloadavg()]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "builds": builds, "rows": rows_out}, indent=1) + "\n")
    lines = [(f"`{meta['command']}`: CPU flags {meta['cpu_flags']}; {meta['threads']} threads (native on "
              f"{meta['native_threading']}), torch {meta['torch']}, medians of {args.repeats} alternated calls, "
              f"weights evicted from the caches before each; load average {meta['load_average_before'][0]} before, "
              f"{meta['load_average_after'][0]} after."), "",
             ("| layer | in x out | rows | fbgemm ms | native ms | fbgemm / native | native GB/s of weights "
              "| bit-identical to fbgemm | rows alone = batched | 1 thread = n threads |"),
             "|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    yes = {True: "yes", False: "NO"}
    lines += [f"| {r['layer']} | {r['shape']} | {r['rows']} | {r['fbgemm_ms']} | {r['native_ms']} | {r['speedup']} | "
              f"{r['native_weight_gb_s']} | {yes[r['bit_identical_to_fbgemm']]} | {yes[r['rows_alone_equal_batch']]} | "
              f"{yes[r['same_bits_1_and_n_threads']]} |" for r in rows_out]
    lines += ["", "Building the weights (quantize + fbgemm prepack, or quantize + native layout), seconds:", "",
              "| layer | in x out | fbgemm | native |", "|---|---|---:|---:|"]
    lines += [f"| {b['layer']} | {b['shape']} | {b['fbgemm_build_s']} | {b['native_build_s']} |" for b in builds]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
