"""Orchestration overhead per reasoning step: everything but model time, measured with ScriptedModel.

Runs the `cot` workflow under `specreason` (a draft and a judge call per step) on instant scripted
models, for batches of 1 to 1000 runs, and subtracts the cost of making the same model calls
directly (the baseline, measured in the same process). Target: under 1 ms per step, flat in the
number of runs (linear total time).

    python bench/orchestrator_overhead.py [--steps 8] [--runs 1,10,100,1000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path

from thinkahead.models import GenerationRequest, ScriptedModel
from thinkahead.orchestrator import Runtime
from thinkahead.step_spec.loop import StepBudget
from thinkahead.step_spec.policies import make_policy
from thinkahead.workflows import cot

RESULTS = Path(__file__).parent / "results"


def models(steps: int) -> tuple[ScriptedModel, ScriptedModel]:
    step_texts = [f"Step {i}: we add {i} and {i + 1} to get {2 * i + 1}.\n\n" for i in range(steps - 1)]
    script = step_texts + ["So the answer is \\boxed{42}."]

    def small_out(prompt: str, request: GenerationRequest) -> str:
        # the step number is how many steps the continued reasoning already holds
        return script[min(prompt.count("\n\nStep ") + prompt.count("Step 0:"), len(script) - 1)]

    return ScriptedModel(outputs=small_out), ScriptedModel(outputs=["unused"], logprobs=[{"9": -0.01}])


async def orchestrated(runs: int, steps: int, concurrency: int) -> tuple[float, int]:
    small, large = models(steps)
    rt = Runtime(small, large, make_policy("specreason"), concurrency=concurrency,
                 step_budget=StepBudget(max_steps=steps + 2, max_tokens=None))
    graph = cot().compile()
    t0 = time.perf_counter()
    results = await rt.map(graph, [(str(i), {"question": f"Problem {i}: add things."}) for i in range(runs)])
    elapsed = time.perf_counter() - t0
    if not all(r.ok and r.answer == "42" for r in results):
        raise RuntimeError("a scripted run failed: " + str([r.error for r in results if not r.ok][:1]))
    return elapsed, sum(len(r.steps()) for r in results)


async def direct_calls(n_steps: int, steps: int) -> float:
    """The same number of model calls (a generate and a judge per step) made directly."""
    small, large = models(steps)
    prompt = "Problem: add things.\n\nStep 0: we add 0 and 1 to get 1.\n\n"
    t0 = time.perf_counter()
    for _ in range(n_steps):
        await small.generate(GenerationRequest(prompt=prompt, max_new_tokens=128, stop=["\n\n"]))
        await large.next_token_logprobs(prompt, 10)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--runs", default="1,10,100,1000")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    rows = []
    for runs in [int(x) for x in args.runs.split(",")]:
        elapsed, n_steps = asyncio.run(orchestrated(runs, args.steps, args.concurrency))
        baseline = asyncio.run(direct_calls(n_steps, args.steps))
        per_step_ms = (elapsed - baseline) / n_steps * 1e3
        rows.append({"runs": runs, "steps": n_steps, "wall_s": round(elapsed, 4), "direct_calls_s": round(baseline, 4),
                     "overhead_ms_per_step": round(per_step_ms, 4), "ms_per_run": round(elapsed / runs * 1e3, 3)})
        print(f"runs {runs:>5}  steps {n_steps:>6}  wall {elapsed:7.3f}s  direct calls {baseline:6.3f}s  "
              f"overhead {per_step_ms:.3f} ms/step  {elapsed / runs * 1e3:.2f} ms/run")
    RESULTS.mkdir(exist_ok=True)
    out = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
           "steps_per_run": args.steps, "concurrency": args.concurrency, "rows": rows}
    (RESULTS / "orchestrator_overhead.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {RESULTS / 'orchestrator_overhead.json'}")


if __name__ == "__main__":
    main()
