"""The native suffix tree (token_spec/native/: suffix_tree.hpp and its .cpp files), an optional extension.

Everything else is in pyproject.toml. The extension is `optional`: where it cannot be
built the package installs without it and the pure-Python tree is used (with one
warning, see token_spec/suffix_impl.py).
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

# One job each: appending and matching, removal, drafting, CombinedDrafter's merge, the Python module.
NATIVE_SOURCES = ("tree", "eviction", "drafting", "combined", "bindings")

setup(
    ext_modules=[
        Pybind11Extension(
            "thinkahead.token_spec._suffix_native",
            [f"token_spec/native/{name}.cpp" for name in NATIVE_SOURCES],
            depends=["token_spec/native/suffix_tree.hpp", "token_spec/native/flat_map.hpp"],
            cxx_std=17,
            # Probabilities and budgets must round as CPython's: no fused multiply-add.
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ],
)
