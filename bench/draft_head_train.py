"""Train a draft head (thinkahead/token_spec/draft_head.py) for a packaged model from its own outputs.

1. Outputs: the model's own greedy answers to GSM8K train problems (`--generate N`, appended to `--texts`, one
   JSON line {question, output} each; resumable). Held out: the `answer_reasoning` of a runs store of the model on
   other problems (`--eval-runs`, e.g. bench/results/step_frontier/runs-large.jsonl: GSM8K test problems, which
   the benchmarks use, so the head never trains on them), else the last `--holdout` share of the texts.
2. Hidden states: one forward of the model over each prompt + output (the engine's own normed last hidden
   states, what its output layer reads).
3. Training: at every output position t, from the hidden state h_t (which chose token t+1) and token t+1's
   embedding the head's feature must give token t+2 through the model's output rows over its first `--vocab`
   ids; fed its own feature and token t+2 it must give token t+3 (so a chain of guesses works), and its first
   feature is pulled towards h_{t+1} (EAGLE's feature loss). The script reports how often the head's chain is
   right on the held-out texts, by depth and by its own confidence (also written next to `--out`, as .json).

  python bench/draft_head_train.py --generate 400 --texts /tmp/gsm8k_train_outputs.jsonl \\
      --eval-runs bench/results/step_frontier/runs-large.jsonl --out token_spec/heads/qwen2.5-coder-1.5b.safetensors
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from pathlib import Path

import torch

from thinkahead.models import LocalModel
from thinkahead.models.base import GenerationRequest
from thinkahead.token_spec.draft_head import HEAD_VOCAB, HEAD_WIDTH, DraftHead

INSTRUCTION = "\n\nPut the final answer in \\boxed{}."  # as the cot workflow's tasks end (evals/suites.py)
FEATURE_WEIGHT = 0.1  # the feature loss's weight beside the two cross-entropies


def generate(model: LocalModel, path: Path, count: int, streams: int = 16, tokens: int = 400) -> None:
    """The model's greedy answers to GSM8K train problems 0..count-1 not yet in `path`, appended as they finish."""
    from thinkahead.evals.data import gsm8k

    done = {json.loads(line)["i"] for line in path.open()} if path.exists() else set()
    todo = [(i, r) for i, r in enumerate(gsm8k("train")[:count]) if i not in done]

    async def run() -> None:
        gate = asyncio.Semaphore(streams)
        with path.open("a") as out:
            async def one(i: int, record: dict) -> None:
                async with gate:
                    question = record["question"] + INSTRUCTION
                    reply = await model.generate(GenerationRequest(
                        messages=[{"role": "user", "content": question}], max_new_tokens=tokens, temperature=0))
                    out.write(json.dumps({"i": i, "question": question, "output": reply.text}) + "\n")
                    out.flush()
            await asyncio.gather(*(one(i, r) for i, r in todo))

    asyncio.run(run())


def read_texts(texts: list[Path]) -> list[tuple[str, str]]:
    return [(r["question"], r["output"]) for path in texts for r in map(json.loads, path.open())]


def read_runs(runs: list[Path]) -> list[tuple[str, str]]:
    pairs = []
    for path in runs:
        for record in map(json.loads, path.open()):
            outputs = record.get("outputs") or {}
            if "answer_reasoning" in outputs:
                pairs.append((record["input"]["question"], outputs["answer_reasoning"]))
    return pairs


def hidden_states(model: LocalModel, pairs: list[tuple[str, str]]) -> list[dict]:
    """Per pair: its token ids, the index t0 of the last prompt token, and the hidden states from t0 on."""
    from transformers import DynamicCache

    net, out = model.engine.model, []
    with torch.inference_mode():
        for question, output in pairs:
            prompt = model.tokenizer.encode(model.render([{"role": "user", "content": question}]))
            ids = prompt + model.tokenizer.encode(output)
            hidden = net.final_hidden(torch.tensor([ids]), None, None, DynamicCache(config=net.config))[0]
            out.append({"ids": ids, "t0": len(prompt) - 1, "h": hidden[len(prompt) - 1:].to(torch.bfloat16)})
    return out


def examples(records: list[dict], embed) -> dict[str, torch.Tensor]:
    """h_t, h_{t+1}, and tokens t+1, t+2, t+3 at every position where all exist."""
    h0, h1, tokens = [], [], []
    for r in records:
        ids, t0, h = r["ids"], r["t0"], r["h"]
        n = len(ids) - t0 - 3  # positions t0 .. t0 + n - 1 have tokens t+1 .. t+3
        if n <= 0:
            continue
        h0.append(h[:n])
        h1.append(h[1:n + 1])
        tokens.append(torch.tensor([ids[t0 + j + 1:t0 + j + 4] for j in range(n)]))
    tokens_t = torch.cat(tokens)
    with torch.inference_mode():
        e1 = torch.cat([embed(tokens_t[i:i + 4096, 0]) for i in range(0, len(tokens_t), 4096)]).to(torch.bfloat16)
        e2 = torch.cat([embed(tokens_t[i:i + 4096, 1]) for i in range(0, len(tokens_t), 4096)]).to(torch.bfloat16)
    return {"h0": torch.cat(h0), "h1": torch.cat(h1), "tokens": tokens_t, "e1": e1, "e2": e2}


def output_rows(model: LocalModel, vocab: int) -> torch.Tensor:
    """The output layer's weight rows of ids below `vocab` `[vocab, hidden]`, read back through the layer."""
    head, size = model.engine.model.lm_head, model.engine.model.config.hidden_size
    eye = torch.eye(size)
    with torch.inference_mode():
        return torch.cat([head(eye[i:i + 256])[:, :vocab] for i in range(0, size, 256)]).T.contiguous()


def steps(head: DraftHead, w: torch.Tensor, batch: dict[str, torch.Tensor], e2: torch.Tensor):
    """Both depths' logits and the first feature."""
    f1 = head(batch["h0"].float(), batch["e1"].float())
    f2 = head(f1, e2.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return f1, f1 @ w.T, f2 @ w.T


def train(head: DraftHead, w: torch.Tensor, data: dict, epochs: int, lr: float, batch_size: int = 256) -> None:
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    rows = len(data["tokens"])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=epochs * ((rows + batch_size - 1) // batch_size))
    vocab = w.shape[0]
    for epoch in range(epochs):
        t0, total, perm = time.time(), 0.0, torch.randperm(rows)
        for i in range(0, rows, batch_size):
            b = {k: v[perm[i:i + batch_size]] for k, v in data.items()}
            f1, l1, l2 = steps(head, w, b, b["e2"])
            y = b["tokens"]
            loss = (torch.nn.functional.cross_entropy(l1.float(), torch.where(y[:, 1] < vocab, y[:, 1], -100))
                    + torch.nn.functional.cross_entropy(l2.float(), torch.where(y[:, 2] < vocab, y[:, 2], -100))
                    + FEATURE_WEIGHT * torch.nn.functional.mse_loss(f1, b["h1"].float()))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss) * len(y)
        logging.info("epoch %d: loss %.3f (%.0f s)", epoch, total / rows, time.time() - t0)


def evaluate(head: DraftHead, w: torch.Tensor, data: dict, embed) -> dict:
    """The head's chain as the drafter runs it (its own first guess fed back) on held-out positions."""
    out = {}
    with torch.no_grad():
        f1 = head(data["h0"].float(), data["e1"].float())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            p1, g1 = torch.softmax((f1 @ w.T).float(), -1).max(-1)
        with torch.inference_mode():
            e_guess = embed(g1).float()
        f2 = head(f1, e_guess)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            p2, g2 = torch.softmax((f2 @ w.T).float(), -1).max(-1)
    y = data["tokens"]
    hit1, hit2 = g1 == y[:, 1], (g1 == y[:, 1]) & (g2 == y[:, 2])
    out["positions"] = len(y)
    out["depth1"] = round(float(hit1.float().mean()), 4)
    out["depth2_given_depth1"] = round(float(hit2.float().sum() / hit1.float().sum().clamp(min=1)), 4)
    out["depth1_by_confidence"] = {f">={c}": [round(float((p1 >= c).float().mean()), 3),
                                               round(float(hit1[p1 >= c].float().mean()), 3)] for c in (0.3, 0.5, 0.7, 0.9)}
    out["depth2_by_confidence"] = {f">={c}": [round(float((hit1 & (p2 >= c)).float().sum() / hit1.sum()), 3),
                                               round(float(hit2[hit1 & (p2 >= c)].float().mean()), 3)]
                                   for c in (0.3, 0.5, 0.7, 0.9)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--texts", type=Path, action="append", default=[], help="JSONL of {question, output}")
    parser.add_argument("--eval-runs", type=Path, action="append", default=[],
                        help="a runs store of the model on other problems: held out")
    parser.add_argument("--generate", type=int, default=0, help="answer GSM8K train problems 0..N-1 into --texts")
    parser.add_argument("--width", type=int, default=HEAD_WIDTH)
    parser.add_argument("--vocab", type=int, default=HEAD_VOCAB)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--holdout", type=float, default=0.1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(0)
    model = LocalModel(args.model, drafter="none")
    if args.generate:
        if not args.texts:
            parser.error("--generate needs --texts FILE to write the outputs to")
        generate(model, args.texts[0], args.generate)
    pairs, held_out = read_texts(args.texts), read_runs(args.eval_runs)
    if not held_out:
        cut = len(pairs) - max(1, int(len(pairs) * args.holdout))
        pairs, held_out = pairs[:cut], pairs[cut:]
    logging.info("%d texts to train on, %d held out; reading hidden states", len(pairs), len(held_out))
    embed = model.engine.model.get_input_embeddings()
    train_data = examples(hidden_states(model, pairs), embed)
    test_data = examples(hidden_states(model, held_out), embed)
    w = output_rows(model, args.vocab).to(torch.bfloat16)
    head = DraftHead(model.engine.model.config.hidden_size, args.width, args.vocab, model=args.model)
    logging.info("training on %d positions", len(train_data["tokens"]))
    train(head, w, train_data, args.epochs, args.lr)
    report = {"texts": len(pairs), "held_out_texts": len(held_out), "train_positions": len(train_data["tokens"]),
              "width": args.width, "vocab": args.vocab, "epochs": args.epochs,
              "held_out": evaluate(head.eval(), w, test_data, embed)}
    print(json.dumps(report, indent=1))
    head.save(args.out)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
