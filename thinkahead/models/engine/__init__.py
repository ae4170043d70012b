"""The local engine: everything that runs a model on this machine, behind one `EngineConfig`.

- `config`: `EngineConfig` (dtype, drafter, draft budget, KV budgets, batch rows, prefill pieces), every
  engine default defined once; `ModelConfig`, the CLI, `serve` and the SDK read it. `dtypes`: the dtypes.
- `scheduler`: `BatchScheduler`, one `step()` at a time for every live generation of a model (and of a
  drafting pair), with admission by KV budget, prompts read in pieces and goodput-sized drafts.
- `runner`: `HFEngine`, the model runner behind token_spec's `TargetEngine` protocol (forwards, KV rollback,
  ragged batches); `kv_cache`: the growing KV cache it keeps per sequence.
- `kernels`: the native linears (GGUF blocks, int8) and row-wise ops, each optional with a fallback or a
  refusal by name; `qwen2`: the fused Qwen2 model on them, with exact attention and rotary embeddings.
- `weights`: loading a model's weights (GGUF files read natively, checked, cached, rebuilt into the kernels'
  layout).

`thinkahead.models.local.LocalModel` is the `LanguageModel` over this engine. The engine imports
token_spec (the protocol and the drafters) and the model catalog (`thinkahead.models.registry`), never
the layers above.
"""
