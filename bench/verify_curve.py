"""The cost of one forward over k new tokens, ours against llama.cpp, on the same GGUF file in one process.

Speculation pays when verifying k drafted tokens costs little more than decoding one; prefill of a
prompt is the same forward at large k. For each k, both engines run a forward of k tokens after the
same cached context (ours: the fused GGUF model with its KV cache, logits for every new token, as a
verify needs them; llama.cpp: `Llama.eval` after the same context, through llama-cpp-python), in
turns, best of --rounds. "prefill" rows: a forward of k tokens from an empty cache keeping only the
last token's logits, as a prompt's prefill does in both engines.

    python bench/verify_curve.py                       # 1.5B, k = 1 2 4 8 16 24 32, prefill 100
    python bench/verify_curve.py --ks 1,4,16 --rounds 5

Needs llama-cpp-python (bench/llama_baseline.py says how to install it). Writes
bench/results/verify_curve_gguf.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # see bench/llama_baseline.py

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_baseline import INSTALL_HINT, gguf_path, llama_version  # noqa: E402
from token_spec import cpu_features  # noqa: E402

from thinkahead.models.engine.weights.load import load_causal_lm  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--ks", default="1,2,4,8,16,24,32", help="verify widths: new tokens per forward")
    ap.add_argument("--context", type=int, default=100, help="cached tokens before each verify")
    ap.add_argument("--prefill", default="100", help="prompt lengths to prefill from an empty cache")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "verify_curve_gguf"))
    args = ap.parse_args()
    if llama_version() is None:
        sys.exit(INSTALL_HINT)
    from llama_cpp import Llama

    ks = [int(k) for k in args.ks.split(",")]
    prefills = [int(k) for k in args.prefill.split(",") if k]
    if min(ks + prefills + [args.context, args.rounds]) < 1:
        ap.error("widths, lengths, --context and --rounds must be >= 1")
    threads = torch.get_num_threads()
    model, _ = load_causal_lm(args.model, "gguf")
    llm = Llama(model_path=str(gguf_path(args.model)), n_ctx=4096, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False)
    ids = [(1000 + 7 * i) % 30000 + 200 for i in range(args.context + max(ks + prefills))]
    context, new = ids[:args.context], ids[args.context:]

    with torch.no_grad():
        cache = model(torch.tensor([context]), use_cache=True).past_key_values

        def ours_verify(k: int) -> float:
            start = time.perf_counter()
            model(torch.tensor([new[:k]]), past_key_values=cache, use_cache=True)
            seconds = time.perf_counter() - start
            cache.crop(-k)
            return seconds

        def ours_prefill(k: int) -> float:
            start = time.perf_counter()
            model(torch.tensor([ids[:k]]), use_cache=True, logits_to_keep=1)
            return time.perf_counter() - start

        def llama_verify(k: int) -> float:
            llm.reset()
            llm.eval(context)
            start = time.perf_counter()
            llm.eval(new[:k])
            return time.perf_counter() - start

        def llama_prefill(k: int) -> float:
            llm.reset()
            start = time.perf_counter()
            llm.eval(ids[:k])
            return time.perf_counter() - start

        rows = []
        forwards = [("verify", k, ours_verify, llama_verify) for k in ks]
        forwards += [("prefill", k, ours_prefill, llama_prefill) for k in prefills]
        for kind, k, ours, theirs in forwards:
            best_ours, best_llama = float("inf"), float("inf")
            for _ in range(args.rounds):  # in turns: a drifting machine weighs on both
                best_ours = min(best_ours, ours(k))
                best_llama = min(best_llama, theirs(k))
            rows.append({"kind": kind, "k": k, "ours_ms": round(1e3 * best_ours, 1), "llama_ms": round(1e3 * best_llama, 1),
                         "ours_vs_llama": round(best_ours / best_llama, 3)})
            print(f"{kind:8s} k={k:4d} ours {rows[-1]['ours_ms']:8.1f} ms  llama.cpp {rows[-1]['llama_ms']:8.1f} ms  "
                  f"time ratio {rows[-1]['ours_vs_llama']:.2f}", flush=True)
    one = {r["k"]: r for r in rows if r["kind"] == "verify"}.get(1)
    meta = {"model": args.model, "context": args.context, "rounds": args.rounds, "threads": threads,
            "cpu": cpu_features(), "llama_cpp_python": llama_version(), "torch": torch.__version__,
            "command": "python bench/verify_curve.py " + " ".join(sys.argv[1:]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [(f"`{meta['command']}`: {args.model} GGUF, {threads} threads, CPU flags {meta['cpu']}, "
              f"llama-cpp-python {meta['llama_cpp_python']}, best of {args.rounds} in turns, {meta['started']}."), "",
             "| forward | new tokens k | ours ms | llama.cpp ms | ours / llama.cpp (time) | ours vs our k=1 |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        vs_one = f"{r['ours_ms'] / one['ours_ms']:.2f}x" if one and r["kind"] == "verify" else ""
        where = f"after {args.context} cached" if r["kind"] == "verify" else "empty cache, last logits"
        lines.append(f"| {r['kind']} ({where}) | {r['k']} | {r['ours_ms']} | {r['llama_ms']} | {r['ours_vs_llama']:.2f} | {vs_one} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
