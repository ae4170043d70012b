"""Collect Arbitrage router training pairs on GSM8K *train* problems with the packaged models.

Each step of each problem is written by both models from the same prefix (`--policy collect`:
step_spec/routing.py::CollectPairs); the large model's judge scores both, and the pair, with the
features the router sees before the step is written, is appended to the pairs file. The models
load once for the whole batch (`thinkahead reason --policy collect` loads them per problem).

Resumable: a problem whose id is already in the problems file is skipped, so a killed run goes on
where it stopped. Test problems are never used (the report runs on GSM8K test 26-50).

    python bench/collect_pairs.py --n 40                  # train problems 0-39
    python bench/collect_pairs.py --n 40 --offset 40      # the next 40
    thinkahead router train bench/results/router/pairs.jsonl -o router.json

Writes bench/results/router/pairs.jsonl (one line per step pair) and problems.jsonl (one line per
problem: answer, correct, steps, pairs, seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "router"


def done_ids(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    return {json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()}


def drop_unfinished(pairs_path: Path, done: set[str]) -> None:
    """Pairs of a problem that a killed run left half done go (the problem is collected again)."""
    if not pairs_path.is_file():
        return
    lines = pairs_path.read_text().splitlines(keepends=True)
    keep = [line for line in lines if line.strip() and line.endswith("\n") and json.loads(line)["problem_id"] in done]
    if len(keep) != len(lines):
        tmp = pairs_path.with_suffix(".tmp")
        tmp.write_text("".join(keep))
        tmp.replace(pairs_path)
        logging.info("dropped %d pairs of unfinished problems", len(lines) - len(keep))


async def collect(args: argparse.Namespace) -> None:
    from thinkahead.config import default
    from thinkahead.evals.loaders import gsm8k_tasks
    from thinkahead.models import LocalModel
    from thinkahead.step_spec.loop import StepBudget, StepLoop
    from thinkahead.step_spec.routing import CollectPairs
    from thinkahead.verifiers.grading import get_checker
    from thinkahead.verifiers.grading.final_answer import extract_final_answer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pairs_path, problems_path = out / "pairs.jsonl", out / "problems.jsonl"
    done = done_ids(problems_path)
    drop_unfinished(pairs_path, done)
    tasks = [t for t in gsm8k_tasks(args.n, args.offset, split="train") if t.id not in done]
    logging.info("%d train problems to collect (%s)", len(tasks), problems_path)
    if not tasks:
        return
    t0 = time.perf_counter()
    small = LocalModel(args.small, dtype=args.dtype)
    large = LocalModel(args.large, dtype=args.dtype)
    logging.info("models loaded in %.1f s", time.perf_counter() - t0)
    checker = get_checker("math")
    budget = StepBudget(max_steps=default("steps.max_steps"), max_tokens=default("steps.max_tokens"))
    for task in tasks:
        policy = CollectPairs(pairs_path, problem_id=task.id)
        start = time.perf_counter()
        result = await StepLoop(small, large, policy, budget=budget).run(task.inputs["question"])
        answer = extract_final_answer(result.reasoning) or result.answer
        record = {"id": task.id, "answer": answer, "reference": task.reference,
                  "correct": bool(checker.check(answer, task.reference)), "steps": len(result.steps),
                  "pairs": sum(s.verdict == "collected" for s in result.steps),  # one pair per collected step
                  "stop_reason": result.stop_reason,
                  "seconds": round(time.perf_counter() - start, 1), "machine": platform.machine(),
                  "small": args.small, "large": args.large, "dtype": args.dtype}
        with problems_path.open("a") as f:  # after the pairs: a problem listed here is complete
            f.write(json.dumps(record) + "\n")
        logging.info("%s: %d pairs, correct=%s, %.0f s", task.id, record["pairs"], record["correct"], record["seconds"])


def main() -> None:
    from thinkahead.config import default

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40, help="how many train problems")
    ap.add_argument("--offset", type=int, default=0, help="first train problem")
    ap.add_argument("--small", default=default("small.spec"))
    ap.add_argument("--large", default=default("large.spec"))
    ap.add_argument("--dtype", default=default("large.dtype"))
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    asyncio.run(collect(args))


if __name__ == "__main__":
    main()
