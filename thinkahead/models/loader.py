"""`load_model(spec)`: one way to name a model everywhere (SDK, CLI, config files, server).

- a `LanguageModel` instance is used as it is;
- `openai:MODEL@URL` is any OpenAI-compatible server (`openai:qwen@http://localhost:8000/v1`);
- `sglang:URL` or `sglang:NAME@URL` is an SGLang server's native API (`sglang:http://localhost:30000`,
  `sglang:qwq@http://gpu1:30000`; NAME only labels traces), e.g. one that `thinkahead launch` started;
- everything else is a local transformers model: a registry name, `hf:ORG/NAME`, `gguf:PATH`, a
  model directory or a `.gguf` file (see `thinkahead.models.specs.resolve_model_spec`).
"""

from __future__ import annotations

import logging
from typing import Any

from thinkahead.models.base import LanguageModel

log = logging.getLogger(__name__)

REMOTE_PREFIXES = ("openai:", "sglang:")
# Specs whose backend can never score a given continuation, refused before anything loads: none today.
# `openai:` servers are probed instead, once, when scores are first needed (vLLM, SGLang and thinkahead
# serve score by echo, llama-server by its native /completion; any other is refused then, by name: see
# `thinkahead.models.remote_scores`); `sglang:` scores through /generate.
SCORELESS_PREFIXES: tuple[str, ...] = ()


def _openai_parts(spec: str) -> tuple[str, str]:
    model, sep, url = spec[len("openai:"):].partition("@")
    if not sep or not model or not url.startswith(("http://", "https://")):
        raise ValueError(f"bad OpenAI model spec {spec!r}: expected openai:MODEL@http(s)://HOST[:PORT]/v1")
    return model, url


def _sglang_parts(spec: str) -> tuple[str | None, str]:
    name: str | None = None
    url = spec[len("sglang:"):]
    if not url.startswith(("http://", "https://")):
        name, _, url = url.partition("@")
    if name == "" or not url.startswith(("http://", "https://")) or not url.split("://", 1)[1]:
        raise ValueError(f"bad SGLang model spec {spec!r}: expected sglang:[NAME@]http(s)://HOST:PORT")
    return name, url


def check_model_spec(spec: str) -> str:
    """`spec`, stripped, if it names a model (a remote URL that parses, a local model that resolves);
    a ValueError that says why and lists the accepted forms otherwise. Loads nothing."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"model spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec.startswith("openai:"):
        _openai_parts(spec)
    elif spec.startswith("sglang:"):
        _sglang_parts(spec)
    else:
        from thinkahead.models.specs import resolve_model_spec

        resolve_model_spec(spec)
    return spec


def check_hub_model_local(spec: str) -> None:
    """A ValueError unless a hub-id `spec` (`hf:ORG/NAME`, or a bare `ORG/NAME`) is in the local Hugging
    Face cache; other specs pass. Looks at the disk only: a model is checked when an orchestrator is
    built (its first run would otherwise fail deep in transformers with a long `OSError`)."""
    if spec.startswith(REMOTE_PREFIXES):
        return
    from thinkahead.models.specs import resolve_model_spec

    source = resolve_model_spec(spec)
    if source.kind != "hf" or source.location is None:
        return
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(source.location, "config.json"), str):
        return
    raise ValueError(f"model spec {spec!r}: {source.location} is not in the local Hugging Face cache "
                     f"({constants.HF_HUB_CACHE}) and thinkahead does not download hub models when it builds an "
                     f"orchestrator; fetch it first (`hf download {source.location}`), or give its local directory")


def scores_tokens(spec: str) -> bool:
    """Whether the model `spec` names may score tokens (log-probabilities of a given continuation), as far as
    the spec alone says: a remote server's own answer comes from its probe (`OpenAIModel.probe_scores`)."""
    return not spec.strip().startswith(SCORELESS_PREFIXES)


def load_pair(small: str | LanguageModel, large: str | LanguageModel, small_options: dict[str, Any] | None = None,
              large_options: dict[str, Any] | None = None) -> tuple[LanguageModel, LanguageModel]:
    """The small and the large model of an orchestrator. One spec with the same options for both loads once; a
    large local model whose `drafter` is a draft model's kind (`hybrid`, `draft-model`) drafts with the small one
    where that is local too, sharing its weights and scheduler thread (`LocalModel(draft=)`)."""
    from thinkahead.models.local import LocalModel
    from thinkahead.token_spec.names import AUTO_DRAFTER, MODEL_DRAFT_KINDS

    small_options, large_options = dict(small_options or {}), dict(large_options or {})
    small_model = load_model(small, **small_options)
    if isinstance(large, LanguageModel):
        return small_model, large
    if large == small and large_options == small_options:
        return small_model, small_model
    drafter = large_options.get("drafter", AUTO_DRAFTER)
    local_pair = isinstance(small_model, LocalModel) and not large.strip().startswith(REMOTE_PREFIXES)
    if drafter in MODEL_DRAFT_KINDS and local_pair:
        large_options["draft"] = small_model  # LocalModel checks it (its tokenizer, that it drafts alone)
    elif local_pair:  # one scheduler thread for both (LocalModel(thread_of=): a second thread slows both)
        large_options.setdefault("thread_of", small_model)
    return small_model, load_model(large, **large_options)


def load_model(spec: str | LanguageModel, **options: Any) -> LanguageModel:
    """The model that `spec` names; `options` go to the backend's constructor (e.g. dtype=)."""
    if isinstance(spec, LanguageModel):
        return spec
    spec = check_model_spec(spec)  # a precise error for a bad spec before any weights load
    from thinkahead.models.engine.config import ENGINE_SETTINGS

    remote_options = {k: v for k, v in options.items() if k not in (*ENGINE_SETTINGS, "draft", "thread_of")}  # local
    if spec.startswith("openai:"):
        from thinkahead.models.openai import OpenAIModel

        model, url = _openai_parts(spec)
        return OpenAIModel(model, base_url=url, **_packaged_tokenizer(model, remote_options))
    if spec.startswith("sglang:"):
        from thinkahead.models.sglang import SGLangModel

        name, url = _sglang_parts(spec)
        return SGLangModel(url, name, **_packaged_tokenizer(name, remote_options))
    from thinkahead.models.local import LocalModel

    return LocalModel(spec, **options)


def _packaged_tokenizer(name: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """`options`, with `tokenizer=name` when a remote model is named like a packaged model and no tokenizer is
    given: the server is taken to serve that model, so prompts are rendered with its chat template and counted
    with its tokenizer, as the local model's are (without one, a remote model gets the plain template). Only
    from a model prepared here: a remote model never downloads a local one's weights."""
    from thinkahead.models.registry import REGISTRY, prepared_path

    if name not in REGISTRY or options.get("tokenizer") is not None:
        return options
    if prepared_path(name) is None:
        log.warning("remote model %r is named like a packaged model that is not prepared here: its prompts get the "
                    "plain template (`thinkahead models prepare %s`, or give the model a tokenizer)", name, name)
        return options
    return {**options, "tokenizer": name}
