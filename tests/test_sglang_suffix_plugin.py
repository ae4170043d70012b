"""The SUFFIX speculative plugin for SGLang (`thinkahead.token_spec.backends.sglang_suffix`).

Draft rows in SGLang's token/tree-mask format, the suffix corpus following requests the way
SGLang's NGRAM worker feeds it, settings from the environment, registration into a stub of
SGLang 0.5.23's spec registry, `plugin_status`, and the declared entry point. SGLang is not
installed here: the plugin runs against that stub.
"""

from __future__ import annotations

import sys
import tomllib
import types
from typing import Any

import numpy as np
import pytest

from tests.sglang_fixtures import ROOT

# -- the SUFFIX plugin -----------------------------------------------------------------------------


def parents_from_mask(mask: np.ndarray) -> list[int]:
    """SGLang's reading of a tree mask (`reconstruct_indices_from_tree_mask`): the parent of node i
    is the largest j < i marked in row i, else -1."""
    n = mask.shape[0]
    return [max((j for j in range(i) if mask[i, j]), default=-1) for i in range(n)]


def test_draft_rows_in_sglang_format() -> None:
    from thinkahead.token_spec.backends.sglang_suffix import draft_row
    from thinkahead.token_spec.draft import Draft

    tree = Draft(token_ids=[11, 12, 13, 14], parents=[-1, 0, -1, 2], probs=[0.9, 0.8, 0.5, 0.4])
    tokens, mask = draft_row(7, tree, 6)
    assert tokens == [7, 11, 12, 13, 14, 0]  # root = last context token; padding is token 0 under the root
    assert parents_from_mask(mask) == [-1, 0, 1, 0, 3, 0]
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [1, 0, 0, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 0, 1]]
    chain = Draft.chain([5, 6, 7, 8, 9, 10, 11])
    tokens, mask = draft_row(4, chain, 4)  # longer than the budget: cut to n - 1 drafts
    assert tokens == [4, 5, 6, 7] and parents_from_mask(mask) == [-1, 0, 1, 2]
    with pytest.raises(ValueError, match="topological"):
        draft_row(1, Draft(token_ids=[1, 2], parents=[1, -1], probs=[1, 1]), 3)


def test_suffix_corpus_follows_requests_and_shares_outputs() -> None:
    from thinkahead.token_spec.backends.sglang_suffix import SuffixCorpus, SuffixSettings
    from thinkahead.token_spec.suffix_cache import SuffixCache

    corpus = SuffixCorpus(SuffixCache(max_depth=16), 5, SuffixSettings(max_depth=16, tree=False, max_spec_factor=4.0))
    prompt = [1, 2, 3, 4, 5, 6] * 3
    corpus.begin("a", prompt)  # the worker announces a new request with its whole prompt
    tokens, masks = corpus.batch_get(["a"], [prompt[-4:]], [len(prompt)])
    assert tokens.dtype == np.int64 and masks.dtype == np.int64 and masks.shape == (25,)
    assert tokens.tolist() == [6, 1, 2, 3, 4]  # the prompt repeats: the draft continues the pattern
    # two accepted tokens later SGLang passes only the tail and the new total length
    tokens, _ = corpus.batch_get(["a"], [(prompt + [1, 2])[-4:]], [len(prompt) + 2])
    assert tokens.tolist() == [2, 3, 4, 5, 6] and corpus._tokens["a"] == prompt + [1, 2]
    # a jump larger than the tail (tokens were lost) and a rewind are absorbed, not fatal
    corpus.batch_get(["a"], [[9, 9, 9]], [len(prompt) + 40])
    assert corpus._tokens["a"] == prompt + [1, 2, 9, 9, 9]
    corpus.batch_get(["a"], [[1, 2, 3]], [3])  # restarted: the old output went to the global tree
    assert corpus._tokens["a"] == [1, 2, 3] and corpus.cache.cached_requests == ["a"]
    corpus.batch_put([[1, 2, 3]])  # a no-op: tokens arrive in batch_get, where the request id is known
    # a finished request's output joins the global tree; an unannounced request drafts from it
    corpus.begin("b", [40, 41])
    for out in ([70], [70, 71, 72, 73]):
        corpus.batch_get(["b"], [[40, 41] + out], [2 + len(out)])
    corpus.erase_match_state(["b", "never-seen"])
    assert corpus.cache.cached_requests == ["a", "b"] and "b" not in corpus
    tokens, _ = corpus.batch_get(["c"], [[8, 70]], [2])
    assert tokens.tolist() == [70, 71, 72, 73, 0]
    corpus.reset()
    assert corpus.cache.cached_requests == [] and corpus.cache.active_requests == []
    with pytest.raises(ValueError, match="external"):
        corpus.load_external_corpus_named("c", [[1]])
    assert corpus.list_external_corpora() == {}


def test_suffix_settings_from_environment() -> None:
    from thinkahead.token_spec.backends.sglang_suffix import SuffixSettings

    s = SuffixSettings.from_env({"THINKAHEAD_SUFFIX_MAX_DEPTH": "32", "THINKAHEAD_SUFFIX_TREE": "0",
                                 "THINKAHEAD_SUFFIX_MIN_TOKEN_PROB": "0.2"})
    assert (s.max_depth, s.tree, s.min_token_prob, s.max_cached_requests) == (32, False, 0.2, 10_000)
    assert SuffixSettings.from_env({}) == SuffixSettings()
    with pytest.raises(ValueError, match="THINKAHEAD_SUFFIX_MAX_DEPTH must be a int"):
        SuffixSettings.from_env({"THINKAHEAD_SUFFIX_MAX_DEPTH": "deep"})
    with pytest.raises(ValueError, match="MIN_TOKEN_PROB"):
        SuffixSettings.from_env({"THINKAHEAD_SUFFIX_MIN_TOKEN_PROB": "2"})
    for name in ("MAX_SPEC_FACTOR", "MAX_SPEC_OFFSET"):  # NaN and inf drafted nothing, silently
        for value in ("nan", "inf"):
            with pytest.raises(ValueError, match=f"THINKAHEAD_SUFFIX_{name} must be a finite number"):
                SuffixSettings.from_env({f"THINKAHEAD_SUFFIX_{name}": value})


@pytest.fixture
def stub_sglang(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """The slice of SGLang 0.5.23's API the plugin touches (spec_info / spec_registry / ngram_worker)."""
    registry: dict[str, Any] = {}

    class CustomSpecAlgo:
        def __init__(self, name, factory, *, supports_overlap=False, validate_server_args=None):
            self.name, self.factory = name, factory
            self.supports_overlap, self.validate_server_args = supports_overlap, validate_server_args

        def is_ngram(self) -> bool:
            return False

        def has_draft_kv(self) -> bool:
            return True

        def handle_server_args(self, server_args) -> None:
            pass

        def create_worker(self, server_args):
            return self.factory(server_args)

    class SpeculativeAlgorithm:
        @classmethod
        def register(cls, name, *, supports_overlap=False, validate_server_args=None, spec_class=CustomSpecAlgo):
            def decorator(factory):
                registry[name.upper()] = spec_class(name.upper(), factory, supports_overlap=supports_overlap,
                                                    validate_server_args=validate_server_args)
                return factory
            return decorator

    class NGRAMWorker:
        def __init__(self, server_args, gpu_id, nccl_port, target_worker):
            self.draft_token_num, self.max_trie_depth = 4, 18
            self.ngram_corpus = "the C++ NgramCorpus"

        def _prepare_draft_tokens(self, batch):  # as 0.5.23: tails and total lengths
            return self.ngram_corpus.batch_get(
                [r.rid for r in batch.reqs],
                [(list(r.origin_input_ids_unpadded) + list(r.output_ids))[-self.max_trie_depth:] for r in batch.reqs],
                [len(r.origin_input_ids_unpadded) + len(r.output_ids) for r in batch.reqs])

    modules = {
        "sglang": types.ModuleType("sglang"),
        "sglang.srt.speculative.spec_info": types.SimpleNamespace(SpeculativeAlgorithm=SpeculativeAlgorithm),
        "sglang.srt.speculative.spec_registry": types.SimpleNamespace(CustomSpecAlgo=CustomSpecAlgo,
                                                                      get_spec=lambda n: registry.get(n.upper())),
        "sglang.srt.speculative.ngram_worker": types.SimpleNamespace(NGRAMWorker=NGRAMWorker),
    }
    modules["sglang"].__version__ = "0.5.23"
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    import thinkahead.token_spec.backends.sglang_suffix as plugin

    monkeypatch.setattr(plugin, "_WORKER", None)
    return types.SimpleNamespace(registry=registry, NGRAMWorker=NGRAMWorker, plugin=plugin)


def test_register_wires_suffix_into_the_registry(stub_sglang: types.SimpleNamespace,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = stub_sglang.plugin
    plugin.register()
    plugin.register()  # a second load in the same process is harmless
    algo = stub_sglang.registry["SUFFIX"]
    assert algo.is_ngram() and not algo.has_draft_kv() and algo.supports_overlap
    args = types.SimpleNamespace(device="cuda", disable_overlap_schedule=False, max_running_requests=None,
                                 enable_mixed_chunk=True, speculative_ngram_max_bfs_breadth=10,
                                 speculative_eagle_topk=None, speculative_num_draft_tokens=None,
                                 speculative_num_steps=None, speculative_ngram_capacity=10_000_000, page_size=1,
                                 speculative_ngram_external_corpus_path=None, speculative_ngram_max_trie_depth=18)
    algo.validate_server_args(args)
    algo.handle_server_args(args)
    assert (args.max_running_requests, args.enable_mixed_chunk, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens, args.speculative_num_steps, args.speculative_ngram_capacity) == (
        48, False, 10, 12, 1, 1024)
    with pytest.raises(ValueError, match="max-trie-depth"):
        algo.validate_server_args(types.SimpleNamespace(speculative_ngram_external_corpus_path=None,
                                                        speculative_ngram_max_trie_depth=8,
                                                        speculative_num_draft_tokens=None))
    monkeypatch.setenv("THINKAHEAD_SUFFIX_MAX_DEPTH", "20")
    worker_cls = algo.create_worker(args)
    assert issubclass(worker_cls, stub_sglang.NGRAMWorker)
    worker = worker_cls(args, 0, 0, None)
    assert isinstance(worker.ngram_corpus, plugin.SuffixCorpus) and worker.ngram_corpus.cache.max_depth == 20
    req = types.SimpleNamespace(rid="r", origin_input_ids_unpadded=[3, 1, 4, 1, 5, 9, 2, 6] * 4, output_ids=[3, 1])
    tokens, _ = worker._prepare_draft_tokens(types.SimpleNamespace(reqs=[req]))
    assert worker.ngram_corpus._tokens["r"] == req.origin_input_ids_unpadded + [3, 1]  # the whole prompt, not a tail
    assert tokens.tolist() == [1, 4, 1, 5]


def test_plugin_status_names_what_is_missing(stub_sglang: types.SimpleNamespace,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    plugin = stub_sglang.plugin
    installed: list[Any] = []
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [ep for ep in installed if group == ep.group])
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    ok, why = plugin.plugin_status()
    assert not ok and "entry point 'thinkahead_suffix' is not installed" in why
    installed.append(types.SimpleNamespace(name="thinkahead_suffix", group="sglang.srt.plugins"))
    assert plugin.plugin_status() == (True, "SGLang 0.5.23")
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    assert plugin.plugin_status() == (False, "SGLANG_PLUGINS='someone_else' does not list thinkahead_suffix")
    monkeypatch.delenv("SGLANG_PLUGINS")
    sys.modules["sglang"].__version__ = "0.6.0"
    assert plugin.plugin_status() == (True, "SGLang 0.6.0 (the plugin was written against 0.5.23)")


def test_plugin_entry_point_is_declared() -> None:
    from importlib import import_module

    from thinkahead.token_spec.backends import sglang_suffix

    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    target = eps[sglang_suffix.ENTRY_POINT_GROUP][sglang_suffix.ENTRY_POINT_NAME]
    module, _, attr = target.partition(":")
    assert getattr(import_module(module), attr) is sglang_suffix.register
    assert sglang_suffix.plugin_status() == (False, "sglang is not installed in this environment")
