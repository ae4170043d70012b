"""The model dtypes `load_causal_lm` accepts, defined once (no heavy imports: the CLI reads them).

- "bfloat16", "float32": transformers' own modules, weights dequantized to that dtype;
- "int8": batch-invariant int8 linears (thinkahead/models/engine/kernels/quantize.py) over the dequantized weights;
- "gguf": linears computed on a GGUF file's own 4/5/6/8-bit blocks (thinkahead/models/engine/kernels/kquant.py),
  nothing converted; GGUF sources only;
- "auto": "gguf" where it runs (a GGUF file of a supported architecture and block types, the native
  kernel built for this CPU), else "int8" (`weights.resolve_dtype`).
"""

from __future__ import annotations

BFLOAT16, FLOAT32, INT8, GGUF, AUTO = "bfloat16", "float32", "int8", "gguf", "auto"
DTYPES: tuple[str, ...] = (AUTO, BFLOAT16, FLOAT32, INT8, GGUF)
DEFAULT_DTYPE = AUTO  # what every entry point loads a local model as (LocalModel, the config, the CLI)
