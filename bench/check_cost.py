"""Where the cost of checking one drafted step goes, on the packaged large model (issue 18, item 2).

For one GSM8K train problem and the reasoning steps recorded for it in bench/results/router/pairs.jsonl
(the step at `--step` is the draft to check), measures in one process:

- a large-model decode step (plain greedy, a warm KV cache): the unit the target is stated in;
- the raw forward of k new tokens on top of a cached prefix, for several k (the verify pass itself);
- each verifier's check of the draft, cold (nothing cached) and warm (the large model's KV already
  holds the problem and the earlier steps, as it does inside a run), with the tokens it prefilled.

    python bench/check_cost.py                 # writes bench/results/check_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PAIRS = RESULTS / "router" / "pairs.jsonl"


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.machine()
    return " ".join(f for f in flags.split() if f.startswith(("avx", "fma", "amx")) or f in ("f16c",))


def kept_steps(problem_id: str) -> list[str]:
    """The steps a collect run kept for `problem_id` (the better-judged of each pair, small on ties)."""
    from thinkahead.verifiers.router_pairs import read_pairs

    pairs = sorted((p for p in read_pairs(PAIRS) if p.problem_id == problem_id), key=lambda p: p.step_index)
    return [p.kept_text for p in pairs]


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


async def measure(args: argparse.Namespace) -> dict:
    import torch

    from thinkahead.evals.loaders import gsm8k_tasks
    from thinkahead.models import LocalModel
    from thinkahead.models.base import GenerationRequest
    from thinkahead.verifiers.agreement import AgreementVerifier
    from thinkahead.verifiers.judge import LLMJudge

    task = next(t for t in gsm8k_tasks(args.problem + 1, 0, split="train") if t.id == f"gsm8k-train-{args.problem}")
    steps = kept_steps(task.id)
    if len(steps) <= args.step:
        raise SystemExit(f"{task.id} has {len(steps)} recorded steps; --step must be below that")
    large = LocalModel(args.large, dtype=args.dtype)
    engine = large.engine
    problem = [{"role": "user", "content": task.inputs["question"]}]
    before = "".join(steps[: args.step])
    draft = steps[args.step]
    messages = problem + ([{"role": "assistant", "content": before}] if before else [])
    out: dict = {"cpu_flags": cpu_flags(), "threads": torch.get_num_threads(), "model": args.large,
                 "dtype": args.dtype, "problem": task.id, "step": args.step,
                 "draft_tokens": len(large.encode(draft)), "prefix_tokens": len(large.encode(large.render(messages, bool(before))))}

    # a decode step: greedy plain generation after a prefilled prompt
    request = GenerationRequest(messages=messages, continue_final=bool(before), max_new_tokens=args.decode_tokens,
                                speculative=False)
    await large.generate(request)  # warm: the prompt's KV is in the pool afterwards
    decode = []
    for _ in range(args.repeat):
        c = await large.generate(request)
        decode.append(c.time_s / max(1, c.completion_tokens))
    out["decode_step_s"] = statistics.median(decode)

    # the raw forward of k tokens over a cached prefix
    prefix = large.encode(large.render(messages, bool(before)))
    filler = large.encode(draft * 4)
    session = engine.new_session()
    with torch.inference_mode():
        engine.forward(session, prefix, last_only=True)
    forward = {}
    for k in args.k:
        def run(k: int = k) -> None:
            with torch.inference_mode():
                engine.forward(session, filler[:k])
            engine.truncate(session, len(prefix))
        run()
        forward[k] = statistics.median(timed(run, args.repeat))
    out["forward_s"] = forward

    checks = {}
    for name, verifier in (("agreement", AgreementVerifier(large)), ("llm_judge", LLMJudge(large))):
        for state in ("cold", "warm"):
            times, prefilled = [], []
            for _ in range(args.repeat):
                large.prefix_pool.clear()
                if state == "warm":  # the KV of the reasoning so far, as the run's last large-model call left it
                    await large.generate(GenerationRequest(messages=messages, continue_final=bool(before),
                                                           max_new_tokens=1, speculative=False))
                n0 = engine.forwarded_tokens
                verdict = await verifier.judge(messages, draft)
                times.append(verdict.time_s)
                prefilled.append(engine.forwarded_tokens - n0)
            checks[f"{name}_{state}"] = {"s": statistics.median(times), "prefilled_tokens": max(prefilled),
                                         "vs_decode_step": statistics.median(times) / out["decode_step_s"]}
    out["checks"] = checks
    return out


def main() -> None:
    from thinkahead.config import default

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problem", type=int, default=0, help="GSM8K train problem with recorded steps")
    ap.add_argument("--step", type=int, default=2, help="which recorded step is the draft to check")
    ap.add_argument("--large", default=default("large.spec"))
    ap.add_argument("--dtype", default=default("large.dtype"))
    ap.add_argument("--k", type=int, nargs="+", default=[1, 4, 8, 16, 34, 64])
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "check_cost.json"))
    args = ap.parse_args()
    result = asyncio.run(measure(args))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
