"""Plain decode with the previous and the current int8 linear forward, side by side on one loaded model.

The previous `RowwiseInt8Linear.forward` (an anchor row appended by `cat` to pin fbgemm's dynamic
range, then sliced off) and the current one (fbgemm's fp32-output kernel with fixed quantization
parameters, no extra row) are swapped in alternately, step by step, over the same greedy decode
steps, so a loaded machine slows both alike. Checks that both give bit-identical logits, and reports
each one's median wall and process-CPU ms per step and tok/s.

    python bench/int8_decode_ab.py --steps 32 --threads 1

Writes bench/results/int8_decode_ab.{json,md} (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from statistics import median

import torch

os.environ.setdefault("THINKAHEAD_INT8_KERNEL", "fbgemm")  # this bench times fbgemm's packed weights

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_data import gsm8k
from thinkahead.models.engine.runner import HFEngine

from thinkahead.models.engine.kernels.quantize import RowwiseInt8Linear
from thinkahead.models.engine.weights.load import load_causal_lm

RESULTS = Path(__file__).resolve().parent / "results"


def anchor_row_forward(self: RowwiseInt8Linear, x: torch.Tensor) -> torch.Tensor:
    """The forward before this change (kept here as the baseline)."""
    shape = x.shape
    rows = x.reshape(-1, self.in_features).float()
    anchor = _ANCHORS.get(self.in_features)
    if anchor is None:
        anchor = _ANCHORS[self.in_features] = torch.zeros(1, self.in_features)
        anchor[0, 0], anchor[0, 1] = 1.0, -1.0
    row_max = rows.abs().amax(1, keepdim=True).clamp_min(1e-30)
    scaled = torch.cat([rows / row_max, anchor])
    out = torch.ops.quantized.linear_dynamic(scaled, self._packed, True)[:-1] * row_max
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*shape[:-1], self.out_features)


_ANCHORS: dict[int, torch.Tensor] = {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--out", default=str(RESULTS / "int8_decode_ab"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_causal_lm(args.model, "int8")
    engine = HFEngine(model)
    question = gsm8k("test")[0]["question"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    current = RowwiseInt8Linear.forward
    variants = {"anchor row (before)": anchor_row_forward, "fp32-output kernel (now)": current}
    session = engine.new_session()
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    identical = True
    try:
        with torch.inference_mode():
            token = int(engine.forward(session, prompt, last_only=True)[-1].argmax())
            for step in range(args.steps):
                start, logits = session.length, {}
                order = list(variants) if step % 2 == 0 else list(reversed(variants))
                for name in order:
                    RowwiseInt8Linear.forward = variants[name]
                    w0, c0 = time.perf_counter(), time.process_time()
                    logits[name] = engine.forward(session, [token])
                    cpu[name].append(1000 * (time.process_time() - c0))
                    wall[name].append(1000 * (time.perf_counter() - w0))
                    engine.truncate(session, start)
                first, second = logits.values()
                identical = identical and torch.equal(first, second)
                engine.forward(session, [token])
                token = int(first[-1].argmax())
    finally:
        RowwiseInt8Linear.forward = current
    rows = [{"forward": name, "wall_ms_p50": round(median(wall[name]), 2), "cpu_ms_p50": round(median(cpu[name]), 2),
             "tok_per_s_wall": round(1000 / median(wall[name]), 2)} for name in variants]
    result = {"meta": {"model": args.model, "threads": torch.get_num_threads(), "steps": args.steps,
                       "prompt_tokens": len(prompt), "torch": torch.__version__,
                       "command": "python bench/int8_decode_ab.py " + " ".join(sys.argv[1:])},
              "logits_bit_identical": identical, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [(f"`{result['meta']['command']}`: {args.model} int8, {result['meta']['threads']} threads, "
              f"{args.steps} decode steps alternated; logits bit-identical: {identical}."), "",
             "| forward | wall ms/step (p50) | CPU ms/step (p50, all threads) | tok/s (wall) |", "|---|---:|---:|---:|"]
    lines += [f"| {r['forward']} | {r['wall_ms_p50']} | {r['cpu_ms_p50']} | {r['tok_per_s_wall']} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
