"""Label collected router pairs with the large model's token agreement, and the small model's own confidence.

The paper's label (large judge score - small judge score > margin) gives almost no positives on the
packaged pair: the LLM judge scores both models' steps within about one point of each other. This
adds, for each pair of bench/results/router/pairs.jsonl, what the agreement verifier says of the
small model's step (the large model re-reads it from the same prefix: the worst gap of a token with
digits, and whether it fails at margin 1), and what the small model itself thought of each token it
wrote (its log-probabilities: the signals a gate could read without the large model).

The prefix of each step is rebuilt from the file: a collect run kept the better-judged step of each
pair (the small one on ties). Resumable: labelled pairs are skipped.

    python bench/label_pairs.py                  # writes bench/results/router/labels.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "router"


def key(row: dict) -> str:
    return f"{row['problem_id']}#{row['step_index']}"


async def label(args: argparse.Namespace) -> None:
    from thinkahead.evals.loaders import gsm8k_tasks
    from thinkahead.models import LocalModel
    from thinkahead.verifiers.router_labels import label_small_step
    from thinkahead.verifiers.router_pairs import read_pairs

    pairs = [json.loads(line) for line in Path(args.pairs).read_text().splitlines() if line.strip()]
    out = Path(args.out)
    done = {key(json.loads(line)) for line in out.read_text().splitlines() if line.strip()} if out.is_file() else set()
    todo = [p for p in pairs if key(p) not in done]
    logging.info("%d pairs to label (%d done)", len(todo), len(done))
    if not todo:
        merge(Path(args.pairs), out)
        return
    n = 1 + max(int(p["problem_id"].rsplit("-", 1)[1]) for p in pairs)
    questions = {t.id: t.inputs["question"] for t in gsm8k_tasks(n, 0, split="train")}
    small = LocalModel(args.small, dtype=args.dtype)
    large = LocalModel(args.large, dtype=args.dtype)
    kept: dict[str, list[tuple[int, str]]] = {}
    for p in sorted(read_pairs(args.pairs), key=lambda p: (p.problem_id, p.step_index)):
        kept.setdefault(p.problem_id, []).append((p.step_index, p.kept_text))
    for p in todo:
        t0 = time.perf_counter()
        reasoning = "".join(text for i, text in kept[p["problem_id"]] if i < p["step_index"])
        messages = [{"role": "user", "content": questions[p["problem_id"]]}]
        if reasoning:
            messages.append({"role": "assistant", "content": reasoning})
        row = {"problem_id": p["problem_id"], "step_index": p["step_index"]}
        row.update(await label_small_step(small, large, messages, p["small_text"], margin=args.margin))
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        logging.info("%s: fails=%s gap=%.2f (%.1f s)", key(p), row["small_fails"], row["small_gap"],
                     time.perf_counter() - t0)
    merge(Path(args.pairs), out)


def merge(pairs_path: Path, labels_path: Path) -> None:
    """Write each pair's agreement label (`small_fails`, `small_gap`) into the pairs file, atomically."""
    from thinkahead.verifiers.router_pairs import pairs_lock

    labels = {key(row): row for row in map(json.loads, labels_path.read_text().splitlines()) if row}
    with pairs_lock(pairs_path):  # a collect run appending meanwhile waits, and its lines are kept
        lines = []
        for line in pairs_path.read_text().splitlines():
            if not line.strip():
                continue
            pair = json.loads(line)
            row = labels.get(key(pair))
            if row is not None:
                pair["small_fails"], pair["small_gap"] = row["small_fails"], row["small_gap"]
            lines.append(json.dumps(pair, ensure_ascii=False) + "\n")
        tmp = pairs_path.with_suffix(".tmp")
        tmp.write_text("".join(lines))
        tmp.replace(pairs_path)
    logging.info("merged %d agreement labels into %s", len(labels), pairs_path)


def main() -> None:
    from thinkahead.config import default

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default=str(RESULTS / "pairs.jsonl"))
    ap.add_argument("--out", default=str(RESULTS / "labels.jsonl"))
    ap.add_argument("--margin", type=float, default=1.0, help="agreement margin (nats) for a token with digits")
    ap.add_argument("--small", default=default("small.spec"))
    ap.add_argument("--large", default=default("large.spec"))
    ap.add_argument("--dtype", default=default("large.dtype"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    asyncio.run(label(args))


if __name__ == "__main__":
    main()
