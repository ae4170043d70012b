"""How well cheap signals predict the steps the large model must fix, on held-out train problems.

Reads bench/results/router/pairs.jsonl (with the agreement labels) and labels.jsonl (the small
model's confidence in each of its steps, from bench/label_pairs.py), splits the problems as the
shipped router was split (every third problem held out), and reports on the held-out pairs:

- the shipped pre-draft router (verifiers/routers/): ROC AUC, share routed, recall;
- each single feature's ROC AUC, pre-draft (what Arbitrage may use) and post-draft (the small
  model's own log-probabilities over the step it wrote: what the confidence gate uses);
- the confidence gate at several thresholds: share of steps checked and recall of failing steps,
  the threshold picked on the training problems (the lowest one keeping recall >= 0.85 there).

    python bench/router_eval.py          # writes bench/results/router_eval.json
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
GATES = (-0.02, -0.05, -0.1, -0.2, -0.3, -0.5, -1.0)


def main() -> None:
    from thinkahead.verifiers.router import load_router
    from thinkahead.verifiers.router_pairs import label, read_pairs
    from thinkahead.verifiers.router_training import evaluate, roc_auc, split_problems

    router = load_router("trained")
    made = router.provenance
    pairs = read_pairs(RESULTS / "router" / "pairs.jsonl")
    labels = {f"{r['problem_id']}#{r['step_index']}": r
              for r in map(json.loads, (RESULTS / "router" / "labels.jsonl").read_text().splitlines())}
    train, held = split_problems(pairs, made["holdout_every"])
    out: dict = {"pairs": len(pairs), "heldout_pairs": len(held), "router": evaluate(router, held, "agreement")}

    def column(rows, name):
        if name.startswith("conf_"):
            return [labels[f"{p.problem_id}#{p.step_index}"][name] for p in rows]
        return [p.features.to_vector((name,))[0] for p in rows]

    y_held = [label(p, rule="agreement") for p in held]
    names = list(router.feature_names) + [k for k in next(iter(labels.values())) if k.startswith("conf_")]
    aucs = {}
    for name in names:
        auc = roc_auc(column(held, name), y_held)
        aucs[name] = max(auc, 1 - auc)  # a feature may predict either way
    out["feature_auc"] = aucs

    def gate_rows(rows, cut):
        y = np.asarray([label(p, rule="agreement") for p in rows])
        checked = np.asarray(column(rows, "conf_min_digit_logprob")) < cut
        return {"gate": cut, "checked": float(checked.mean()), "recall": float(checked[y == 1].mean())}

    out["gate_heldout"] = [gate_rows(held, g) for g in GATES]
    picked = min((g for g in GATES if gate_rows(train, g)["recall"] >= 0.85), default=GATES[0])
    out["gate_picked_on_train"] = picked
    out["gate_auc_heldout"] = 1 - roc_auc(column(held, "conf_min_digit_logprob"), y_held)
    (RESULTS / "router_eval.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
