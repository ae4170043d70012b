"""SUFFIX for SGLang: SuffixDecoding inside the engine, drafting from our `SuffixCache`.

A speculative-algorithm plugin, written against SGLang 0.5.23 (`PINNED_SGLANG_VERSION`), whose
source was read for it (paths are inside the `sglang` package):

- Discovery: `srt/plugins/__init__.py` `load_plugins()` calls every entry point of the group
  `sglang.srt.plugins` (restricted by the `SGLANG_PLUGINS` whitelist when that is set). It runs in
  the launcher before the arguments are parsed (`launch_server.py` `__main__`,
  `srt/entrypoints/engine.py`) and again in every scheduler process (`srt/managers/scheduler.py`),
  so `register()` below runs wherever the algorithm name is resolved. This package declares that
  entry point (`thinkahead_suffix`) in pyproject.toml.
- Registry: `srt/speculative/spec_info.py` `SpeculativeAlgorithm.register(name, supports_overlap=,
  validate_server_args=, spec_class=)` stores a `CustomSpecAlgo` (`srt/speculative/spec_registry.py`)
  whose factory returns the worker class; `from_string("SUFFIX")` then resolves it and
  `--speculative-algorithm` is a free string (`srt/arg_groups/fields/spec.py`). SUFFIX is not a
  reserved name in 0.5.23.
- Worker: SGLang's model-free NGRAM worker (`srt/speculative/ngram_worker.py` `NGRAMWorker`) drafts
  from `self.ngram_corpus` (`synchronize()`, `batch_get(req_ids, tails, total_lens) -> (tokens
  [bs*n], tree mask [bs*n*n])`, `batch_put(tails)`, `erase_match_state(rids)` when requests leave
  the decode batch, `reset()` on a cache flush) and verifies the tree with the target model
  (`eagle_sample`, KV moves, logprobs). `SuffixWorker` subclasses it and swaps the corpus for
  `SuffixCorpus`; verification stays SGLang's, so the output is exactly what the target model
  would decode (greedy) or its distribution (sampling), as with NGRAM.
- Dispatch: the scheduler, the CUDA-graph runner and `create_dummy_verify_input` branch on
  `is_ngram()` to build NGRAM verify batches, and `has_draft_kv()` sizes the KV reserve. The
  registered `spec_class` answers `is_ngram() -> True` and `has_draft_kv() -> False`, and its
  `handle_server_args` applies NGRAM's resolution (`srt/arg_groups/speculative_hook.py`
  `_handle_ngram`: 12 draft tokens by default, topk = max BFS breadth, no mixed chunks, 48 running
  requests unless set, no overlap on CPU) by plain field writes: plugins are handed a recorder
  (`srt/arg_groups/overrides.py` `record_foreign_defaults`) on which `_handle_ngram`'s own
  `declare_resolution` calls would be lost. It also shrinks the NGRAM trie the parent constructor
  preallocates (`--speculative-ngram-capacity`, 10M nodes by default) since SUFFIX never uses it.

What SUFFIX gives that NGRAM does not: SuffixDecoding's trees (a per-request tree over the
prompt and output, a global tree over earlier outputs with FIFO eviction, a draft budget that
grows with the match length, frequency-based probabilities with a cut-off), so agents' repeated
outputs are drafted from inside the engine. Limits in 0.5.23: `--speculative-ngram-external-*`
corpora and the `/add_external_corpus` endpoints (gated on the string "NGRAM" in
`srt/managers/tokenizer_control_mixin.py`) are not supported; LoRA, watermarking and SM100 NVFP4
checks that accept only the string "NGRAM" (`srt/arg_groups/lora_hook.py`, `validation_hook.py`,
`kv_cache_hook.py`) refuse SUFFIX. Drafting runs in Python in the scheduler process, per request
per decode step: measure it against NGRAM on the GPU before trusting it.

Settings come from the environment (the scheduler processes inherit it; SGLang's CLI has no
field for plugin options): `THINKAHEAD_SUFFIX_MAX_DEPTH` (24), `..._MAX_CACHED_REQUESTS`
(10000), `..._MAX_SPEC_FACTOR` (1.0), `..._MAX_SPEC_OFFSET` (0.0), `..._MIN_TOKEN_PROB` (0.1),
`..._TREE` (1: tree drafts, 0: chains), `..._CACHE_FILE` (a cache saved by `SuffixCache.save` to
start warm). The defaults are vLLM's for its "suffix" method, in tree mode since SGLang verifies
trees. The draft size per step is `--speculative-num-draft-tokens` minus one.

Nothing here imports SGLang until `register()` runs, so the module (and `SuffixCorpus`, the
format adapter) imports and is tested without it.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from thinkahead.token_spec.names import SUFFIX_MIN_TOKEN_PROB, SUFFIX_SPEC_FACTOR, SUFFIX_SPEC_OFFSET
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.suffix_cache import SuffixCache
from thinkahead.token_spec.suffix_drafts import check_spec_limits

PINNED_SGLANG_VERSION = "0.5.23"
ALGORITHM = "SUFFIX"
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "thinkahead_suffix"
UNUSED_TRIE_CAPACITY = 1024  # nodes of the NGRAM trie the parent worker builds and SUFFIX never fills
DEFAULT_NUM_DRAFT_TOKENS = 12  # NGRAM's default in 0.5.23, root slot included


@dataclass(frozen=True, slots=True)
class SuffixSettings:
    """The SuffixDecoding knobs of the plugin (see the module docstring for the variables)."""

    max_depth: int = 24
    max_cached_requests: int = 10_000
    max_spec_factor: float = SUFFIX_SPEC_FACTOR
    max_spec_offset: float = SUFFIX_SPEC_OFFSET
    min_token_prob: float = SUFFIX_MIN_TOKEN_PROB
    tree: bool = True
    cache_file: str | None = None

    def __post_init__(self) -> None:
        if self.max_depth < 2:
            raise ValueError(f"THINKAHEAD_SUFFIX_MAX_DEPTH must be >= 2, got {self.max_depth}")
        try:
            check_spec_limits(self.max_spec_factor, self.max_spec_offset, self.min_token_prob)
        except ValueError as exc:  # "<setting> must ...", named as the variable that set it
            setting, _, rest = str(exc).partition(" ")
            raise ValueError(f"THINKAHEAD_SUFFIX_{setting.upper()} {rest}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SuffixSettings:
        env = os.environ if environ is None else environ
        prefix = "THINKAHEAD_SUFFIX_"

        def read(name: str, kind: type, default: Any) -> Any:
            raw = env.get(prefix + name)
            if raw is None or raw.strip() == "":
                return default
            try:
                if kind is bool:
                    if raw.strip().lower() not in ("0", "1", "true", "false"):
                        raise ValueError(raw)
                    return raw.strip().lower() in ("1", "true")
                return kind(raw)
            except ValueError:
                raise ValueError(f"{prefix}{name} must be a {kind.__name__}, got {raw!r}") from None

        d = cls()
        return cls(
            max_depth=read("MAX_DEPTH", int, d.max_depth),
            max_cached_requests=read("MAX_CACHED_REQUESTS", int, d.max_cached_requests),
            max_spec_factor=read("MAX_SPEC_FACTOR", float, d.max_spec_factor),
            max_spec_offset=read("MAX_SPEC_OFFSET", float, d.max_spec_offset),
            min_token_prob=read("MIN_TOKEN_PROB", float, d.min_token_prob),
            tree=read("TREE", bool, d.tree),
            cache_file=env.get(prefix + "CACHE_FILE") or None,
        )

    def build_cache(self) -> SuffixCache:
        """The engine's cache: loaded from `cache_file` when given, else empty."""
        if self.cache_file:
            return SuffixCache.load(self.cache_file, max_depth=self.max_depth,
                                    max_cached_requests=self.max_cached_requests)
        return SuffixCache(max_depth=self.max_depth, max_cached_requests=self.max_cached_requests)


def draft_row(last_token: int, draft: Draft, num_draft_tokens: int) -> tuple[list[int], np.ndarray]:
    """One request's NGRAM-format draft: `num_draft_tokens` tokens and their ancestor mask.

    Slot 0 is the last context token (the root the verify step starts from), then the draft's
    tokens in its (topological) order, then padding: token 0 as a child of the root, as SGLang's
    own corpus pads (`kernels/jit/csrc/ngram_corpus/result.cpp` `fillResult`). `mask[i, j]` is 1
    when slot j is slot i or one of its ancestors.
    """
    n = num_draft_tokens
    tokens = [int(last_token)] + [int(t) for t in draft.token_ids[: n - 1]]
    parents = [-1] + [p + 1 for p in draft.parents[: n - 1]]  # draft root (-1) -> slot 0
    tokens += [0] * (n - len(tokens))
    parents += [0] * (n - len(parents))
    mask = np.zeros((n, n), dtype=np.int64)
    for i, p in enumerate(parents):
        if p >= 0:
            if p >= i:
                raise ValueError(f"draft is not in topological order: node {i - 1} has parent {p - 1}")
            mask[i] = mask[p]
        mask[i, i] = 1
    return tokens, mask


class SuffixCorpus:
    """Stands in for SGLang's `NgramCorpus` inside the NGRAM worker, backed by a `SuffixCache`.

    SGLang hands `batch_get` only each request's last tokens (`--speculative-ngram-max-trie-depth`
    of them) and its total length; the corpus keeps each live request's whole token list, starts
    its tree from the full prompt when the worker announces it (`begin`), and appends the tokens
    accepted since the previous call. Requests that left the decode batch are stopped (SGLang
    reports them at its next decode step), so their outputs join the global tree every later
    request drafts from.
    """

    def __init__(self, cache: SuffixCache, num_draft_tokens: int, settings: SuffixSettings | None = None) -> None:
        if num_draft_tokens < 2:
            raise ValueError(f"num_draft_tokens must be >= 2 (the root slot and one draft), got {num_draft_tokens}")
        self.cache = cache
        self.draft_token_num = num_draft_tokens
        self.settings = settings or SuffixSettings()
        self._tokens: dict[Hashable, list[int]] = {}  # live request -> prompt + output so far
        self._seen: dict[Hashable, int] = {}  # live request -> total length SGLang last reported
        self.drafted = 0  # draft tokens proposed (for tests and logs)

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._tokens

    # -- the request lifecycle ---------------------------------------------------------------------

    def begin(self, rid: Hashable, tokens: Sequence[int]) -> None:
        """Start a request's tree from its full prompt (plus any output already produced)."""
        if rid in self._tokens:
            self._stop(rid)
        tokens = [int(t) for t in tokens]
        self.cache.start_request(rid, tokens)
        self._tokens[rid] = tokens
        self._seen[rid] = len(tokens)

    def _advance(self, rid: Hashable, tail: Sequence[int], total_len: int) -> list[int]:
        """Bring a request up to `total_len` tokens, from the `tail` SGLang passed."""
        tail = [int(t) for t in tail]
        if rid not in self._tokens:
            self.begin(rid, tail)  # unannounced (e.g. after a flush): the tail is all we know
        new = total_len - self._seen[rid]
        if new < 0:  # the request was rewound (retracted): start over from what we know
            self.begin(rid, tail)
        elif new > 0:
            added = tail[-new:] if new <= len(tail) else tail
            self.cache.extend(rid, added)
            self._tokens[rid].extend(added)
        self._seen[rid] = total_len
        return self._tokens[rid]

    def _stop(self, rid: Hashable) -> None:
        if self._tokens.pop(rid, None) is not None:
            self._seen.pop(rid, None)
            self.cache.stop_request(rid)

    # -- NgramCorpus's interface -------------------------------------------------------------------

    def synchronize(self) -> None:
        """Nothing to wait for: the cache is updated synchronously."""

    def batch_get(
        self, req_ids: Sequence[Hashable], batch_tokens: Sequence[Sequence[int]], total_lens: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for a decode batch: (tokens [bs * n], ancestor masks [bs * n * n]), int64."""
        n = self.draft_token_num
        s = self.settings
        tokens_out: list[int] = []
        masks: list[np.ndarray] = []
        contexts = [
            self._advance(rid, tail, int(total)) for rid, tail, total in zip(req_ids, batch_tokens, total_lens, strict=True)
        ]
        # The whole batch in one call: with the native tree it drafts without holding the GIL.
        drafts = self.cache.speculate_batch(
            list(zip(req_ids, contexts)), max_tokens=n - 1, max_spec_factor=s.max_spec_factor,
            max_spec_offset=s.max_spec_offset, min_token_prob=s.min_token_prob, tree=s.tree,
        )
        for context, draft in zip(contexts, drafts):
            self.drafted += len(draft)
            row, mask = draft_row(context[-1], draft, n)
            tokens_out.extend(row)
            masks.append(mask.reshape(-1))
        empty = np.zeros(0, dtype=np.int64)
        return np.asarray(tokens_out, dtype=np.int64), (np.concatenate(masks) if masks else empty)

    def batch_put(self, batch_tokens: Sequence[Sequence[int]]) -> None:
        """Nothing: accepted tokens reach each request's tree in `batch_get`, where its id is known."""

    def erase_match_state(self, req_ids: Sequence[Hashable]) -> None:
        """Requests left the decode batch: stop them, so their outputs join the global tree."""
        for rid in req_ids:
            self._stop(rid)

    def reset(self) -> None:
        """A cache flush (`/flush_cache`): forget every request and every cached output."""
        for rid in list(self._tokens):
            self._stop(rid)
        self.cache.clear()

    def load_external_corpus_named(self, corpus_id: str, chunks: Any) -> int:
        raise ValueError(f"{ALGORITHM} does not load external n-gram corpora; use --speculative-algorithm NGRAM")

    def commit_external_corpus_load(self, corpus_id: str, loaded_token_count: int) -> None:
        raise ValueError(f"{ALGORITHM} does not load external n-gram corpora")

    def remove_external_corpus(self, corpus_id: str) -> None:
        raise ValueError(f"{ALGORITHM} has no external n-gram corpora")

    def list_external_corpora(self) -> dict[str, int]:
        return {}


# ------------------------------------------------------------------------------------------------
# SGLang wiring (imports sglang; runs in the server's processes)
# ------------------------------------------------------------------------------------------------


def validate_server_args(args: Any) -> None:
    """Refuse settings SUFFIX cannot honour (called by SGLang before `handle_server_args`)."""
    if getattr(args, "speculative_ngram_external_corpus_path", None) is not None:
        raise ValueError(f"--speculative-algorithm {ALGORITHM} does not use --speculative-ngram-external-corpus-path")
    depth = getattr(args, "speculative_ngram_max_trie_depth", None)
    drafts = getattr(args, "speculative_num_draft_tokens", None) or DEFAULT_NUM_DRAFT_TOKENS
    if depth is not None and depth < drafts:
        # the worker passes only the last `depth` tokens; fewer than one step's accepted tokens would lose some
        raise ValueError(f"--speculative-ngram-max-trie-depth ({depth}) must be >= --speculative-num-draft-tokens "
                         f"({drafts}) with {ALGORITHM}")
    SuffixSettings.from_env()  # bad THINKAHEAD_SUFFIX_* values fail at launch, not in the scheduler


def apply_ngram_resolution(args: Any) -> None:
    """NGRAM's server-argument resolution (`_handle_ngram` in 0.5.23), as plain field writes."""
    device = getattr(args, "device", "cuda")
    if device not in ("cuda", "cpu", "xpu"):
        raise ValueError(f"{ALGORITHM} speculative decoding only supports CUDA, CPU, or XPU devices, got {device!r}")
    if device == "cpu" and not args.disable_overlap_schedule:
        args.disable_overlap_schedule = True
    if args.max_running_requests is None:
        args.max_running_requests = 48
    args.enable_mixed_chunk = False
    args.speculative_eagle_topk = args.speculative_ngram_max_bfs_breadth
    if args.speculative_num_draft_tokens is None:
        args.speculative_num_draft_tokens = DEFAULT_NUM_DRAFT_TOKENS
    if args.speculative_num_steps is None:
        args.speculative_num_steps = args.speculative_num_draft_tokens // args.speculative_eagle_topk
    args.speculative_ngram_capacity = min(args.speculative_ngram_capacity, UNUSED_TRIE_CAPACITY)
    # _handle_ngram's two refusals (it reads them from the resolved view; plugins see the resolving one)
    page_size = getattr(args, "page_size", None) or 1
    if args.speculative_eagle_topk > 1 and page_size > 1 and getattr(args, "attention_backend", None) != "flashinfer":
        raise ValueError(f"{ALGORITHM}: tree drafts (speculative_eagle_topk={args.speculative_eagle_topk} > 1) with "
                         f"page_size={page_size} > 1 need --attention-backend flashinfer")
    dp_attention = bool(getattr(args, "enable_dp_attention", False))
    try:
        from sglang.srt.runtime_context import attn_dp_enabled_of

        dp_attention = dp_attention or bool(attn_dp_enabled_of(args))
    except (ImportError, AttributeError, TypeError):
        pass
    if dp_attention:
        raise ValueError(f"{ALGORITHM} speculative decoding does not support DP attention (as NGRAM)")


_WORKER: type | None = None


def worker_class() -> type:
    """`SuffixWorker`: SGLang's NGRAM worker drafting from a `SuffixCorpus` (built on first use)."""
    global _WORKER
    if _WORKER is not None:
        return _WORKER
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    class SuffixWorker(NGRAMWorker):
        """NGRAM's verify path, SuffixDecoding's drafts."""

        def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any) -> None:
            super().__init__(server_args, gpu_id, nccl_port, target_worker)
            settings = SuffixSettings.from_env()
            self.ngram_corpus = SuffixCorpus(settings.build_cache(), self.draft_token_num, settings)

        def _prepare_draft_tokens(self, batch: Any) -> Any:
            corpus = self.ngram_corpus
            for req in batch.reqs:
                if req.rid not in corpus:  # a new request: its tree covers the whole prompt
                    corpus.begin(req.rid, list(req.origin_input_ids_unpadded) + list(req.output_ids))
            return super()._prepare_draft_tokens(batch)

    _WORKER = SuffixWorker
    return SuffixWorker


def register() -> None:
    """The `sglang.srt.plugins` entry point: register SUFFIX with SGLang's algorithm registry."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec

    if get_spec(ALGORITHM) is not None:  # plugins load once per process; be safe if called again
        return

    class SuffixAlgo(CustomSpecAlgo):
        """Dispatched as NGRAM everywhere SGLang builds verify batches; drafts from SuffixCorpus."""

        def is_ngram(self) -> bool:
            return True

        def has_draft_kv(self) -> bool:
            return False

        def handle_server_args(self, server_args: Any) -> None:
            apply_ngram_resolution(server_args)

    SpeculativeAlgorithm.register(
        ALGORITHM, supports_overlap=True, validate_server_args=validate_server_args, spec_class=SuffixAlgo
    )(lambda server_args: worker_class())


def plugin_status() -> tuple[bool, str]:
    """Whether the SGLang in this environment can run SUFFIX, and a sentence saying why (not).

    `thinkahead launch` asks this in the server's Python and falls back to NGRAM when it is False.
    """
    from importlib import metadata

    try:
        import sglang
    except ImportError:
        return False, "sglang is not installed in this environment"
    version = getattr(sglang, "__version__", "?")
    try:
        from sglang.srt.speculative.ngram_worker import NGRAMWorker
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.speculative.spec_registry import CustomSpecAlgo  # noqa: F401
    except ImportError as exc:
        return False, f"SGLang {version}: cannot import its speculative registry and NGRAM worker ({exc})"
    register_fn = getattr(SpeculativeAlgorithm, "register", None)
    if register_fn is None or "spec_class" not in inspect.signature(register_fn).parameters:
        return False, f"SGLang {version}: SpeculativeAlgorithm.register is missing or takes no spec_class"
    if not hasattr(NGRAMWorker, "_prepare_draft_tokens"):
        return False, f"SGLang {version}: NGRAMWorker has no _prepare_draft_tokens to hook"
    names = {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    if ENTRY_POINT_NAME not in names:
        return False, (f"the {ENTRY_POINT_GROUP} entry point {ENTRY_POINT_NAME!r} is not installed "
                       "(install thinkahead into the server's environment)")
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed and ENTRY_POINT_NAME not in {x.strip() for x in allowed.split(",")}:
        return False, f"SGLANG_PLUGINS={allowed!r} does not list {ENTRY_POINT_NAME}"
    if version != PINNED_SGLANG_VERSION:
        return True, f"SGLang {version} (the plugin was written against {PINNED_SGLANG_VERSION})"
    return True, f"SGLang {version}"


__all__ = [
    "ALGORITHM", "PINNED_SGLANG_VERSION", "SuffixCorpus", "SuffixSettings", "draft_row", "plugin_status",
    "register", "worker_class",
]
