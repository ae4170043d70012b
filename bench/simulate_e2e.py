"""`thinkahead simulate` end to end, native suffix tree against the Python one (issue 19's last target).

Runs the whole command as a user does, one process per run, on the committed agent recordings, with
`THINKAHEAD_SUFFIX_IMPL=python` and `=native` taking turns (a round is one run of each), and keeps the
best wall time of each. Checks on the way that both print the same tokens per verify step and
precision (the update column is a timing). Two ways to start the command:

- "module": `python -m thinkahead simulate ...` on this interpreter (what the console script runs);
- "script": the `thinkahead` found on PATH (here a pyenv shim, which adds its own start-up to both).

and two bytecode settings: as the environment is (where `PYTHONDONTWRITEBYTECODE` is set, as on this
machine, every run compiles the modules it imports again), and with compiled bytecode (written once to
a private cache, `PYTHONPYCACHEPREFIX`, as an installed package has it). Also times `python -c pass`
(the interpreter's own start) in the same rounds.

    flock /tmp/machine.lock python bench/simulate_e2e.py [--rounds 7] [--out bench/results/suffix_native_simulate.json]
"""

from __future__ import annotations

from pathlib import Path
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RECORDINGS = ("tools-bfcl-20/tokens.jsonl", "agentic-refine/tokens-speculative-run.jsonl",
              "agentic-codefix/tokens.jsonl", "react-gsm8k/tokens.jsonl")
MODEL = "qwen2.5-coder-1.5b"
DRAFTERS = "suffix,suffix-tree,prompt-lookup,prompt-lookup-recent,combined"
IMPLS = ("python", "native")


def simulate_args() -> list[str]:
    return ["simulate", *(str(RESULTS / r) for r in RECORDINGS), "--model", MODEL, "--drafters", DRAFTERS]


def run(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, done.stdout


def numbers(stdout: str) -> list[list[str]]:
    """The printed table without its timing column: drafter, tok/verify, precision."""
    return [line.split()[:3] for line in stdout.splitlines()[2:]]


def cpu() -> dict[str, object]:
    """The machine, the CPU's model name and the flags that matter here, from /proc/cpuinfo (where there is one)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = sorted({f for f in text.split() if f in ("avx2", "fma", "avx512_vnni", "avx512f")})
    return {"machine": platform.machine(), "model": model, "python": platform.python_version(), "flags": flags}


def measure(entry: list[str], env: dict[str, str], rounds: int) -> dict[str, object]:
    walls: dict[str, list[float]] = {impl: [] for impl in (*IMPLS, "python -c pass")}
    printed: dict[str, list[list[str]]] = {}
    for _ in range(rounds):
        for impl in IMPLS:
            wall, out = run([*entry, *simulate_args()], {**env, "THINKAHEAD_SUFFIX_IMPL": impl})
            walls[impl].append(wall)
            printed.setdefault(impl, numbers(out))
            if numbers(out) != printed[impl]:
                raise SystemExit(f"{impl}: the printed numbers changed between runs")
        walls["python -c pass"].append(run([sys.executable, "-c", "pass"], env)[0])
    if printed["native"] != printed["python"]:
        raise SystemExit(f"the trees print different numbers:\n{printed}")
    best = {k: min(v) for k, v in walls.items()}
    return {
        "best_s": {k: round(v, 4) for k, v in best.items()},
        "all_s": {k: [round(x, 4) for x in v] for k, v in walls.items()},
        "python_over_native": round(best["python"] / best["native"], 2),
        "printed": printed["native"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="runs of each tree per setting (best of them is kept)")
    ap.add_argument("--out", default=str(RESULTS / "suffix_native_simulate.json"))
    args = ap.parse_args()
    script = shutil.which("thinkahead")
    entries = {"module": [sys.executable, "-m", "thinkahead"]}
    if script:
        entries["script"] = [script]
    result: dict[str, object] = {
        "command": "python bench/simulate_e2e.py " + " ".join(sys.argv[1:]),
        "simulate": "thinkahead " + " ".join(simulate_args()).replace(str(ROOT) + "/", ""),
        "cpu": cpu(),
        "entries": {name: " ".join(entry).replace(str(ROOT) + "/", "") for name, entry in entries.items()},
        "load_before": list(os.getloadavg()),
    }
    with tempfile.TemporaryDirectory(prefix="thinkahead-pyc-") as pyc:
        compiled = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        compiled["PYTHONPYCACHEPREFIX"] = pyc
        settings = {"as_is": dict(os.environ), "bytecode": compiled}
        for impl in IMPLS:  # fill the private bytecode cache (both trees' modules)
            run([sys.executable, "-m", "thinkahead", *simulate_args()], {**compiled, "THINKAHEAD_SUFFIX_IMPL": impl})
        for setting, env in settings.items():
            for name, entry in entries.items():
                key = f"{name}/{setting}"
                result[key] = measure(entry, env, args.rounds)
                best = result[key]["best_s"]
                print(f"{key:18s} python {best['python']:.3f} s  native {best['native']:.3f} s  "
                      f"= {result[key]['python_over_native']:.2f}x   (python -c pass {best['python -c pass']:.3f} s)",
                      flush=True)
    result["load_after"] = list(os.getloadavg())
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
