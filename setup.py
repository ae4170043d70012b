"""The optional native extensions; everything else is in pyproject.toml.

- The suffix tree (token_spec/native/: suffix_tree.hpp and its .cpp files): where it cannot be
  built the pure-Python tree is used (with one warning, see token_spec/suffix_impl.py).
- The AVX2 int8 linear (thinkahead/models/engine/kernels/native/int8_linear.cpp): where it cannot be built, or the
  CPU lacks AVX2/FMA, int8 models use fbgemm's kernels (see thinkahead/models/engine/kernels/int8_kernel.py). Its
  AVX2 code is compiled per function (target attributes), so the module imports on any x86-64.

- Linears on a GGUF file's own quantized blocks (thinkahead/models/engine/kernels/native/kquant_linear.cpp): where
  it cannot be built, dtype "gguf" is refused by name (see thinkahead/models/engine/kernels/kquant.py).
- The row-wise ops of a Qwen2 decoder layer (thinkahead/models/engine/kernels/native/layer_ops.cpp): where it cannot
  be built, fused Qwen2 models run those ops in torch (see thinkahead/models/engine/kernels/layer_ops.py).

All four are `optional`: the package installs without them.
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

# One job each: appending and matching, removal, drafting, CombinedDrafter's merge, the simulator's verify
# rounds, the Python module.
NATIVE_SOURCES = ("tree", "eviction", "drafting", "combined", "replay", "bindings")

NATIVE_MODELS = "thinkahead/models/engine/kernels/native"


def models_extension(name: str, source: str, *headers: str) -> Pybind11Extension:
    """A kernel of the local engine (thinkahead.models.engine.kernels): its threads come from parallel.hpp (which dlopens torch's libgomp:
    libc has dlopen from glibc 2.34, older ones need libdl). Every multiply and add rounds on its own (no
    contraction to FMA beyond a kernel's explicit ones): rows must not depend on the batch, and the int8
    linear must give fbgemm's bits."""
    return Pybind11Extension(
        f"thinkahead.models.engine.kernels.{name}",
        [f"{NATIVE_MODELS}/{source}"],
        depends=[f"{NATIVE_MODELS}/{h}" for h in ("parallel.hpp", *headers)],
        cxx_std=17,
        extra_compile_args=["-O3", "-ffp-contract=off"],
        libraries=["dl"],
        optional=True,
    )


setup(
    ext_modules=[
        Pybind11Extension(
            "thinkahead.token_spec._suffix_native",
            [f"token_spec/native/{name}.cpp" for name in NATIVE_SOURCES],
            depends=["token_spec/native/suffix_tree.hpp", "token_spec/native/flat_map.hpp",
                     "token_spec/native/ngram_index.hpp"],
            cxx_std=17,
            # Probabilities and budgets must round as CPython's: no fused multiply-add.
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
        models_extension("_int8_native", "int8_linear.cpp"),
        models_extension("_layer_native", "layer_ops.cpp", "attention.inc", "attention_tiles.inc", "layer_loop.inc"),
        models_extension("_kquant_native", "kquant_linear.cpp", "kquant_dots.inc", "kquant_layout.inc", "kquant_tiles.inc",
                         "kquant_rows.inc", "kquant_zmm_probe.inc", "kquant_quantize.inc", "kquant_spans.inc", "kquant_amx.inc"),
    ],
)
