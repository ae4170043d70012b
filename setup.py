"""The native suffix tree (token_spec/native/suffix_tree.cpp), an optional extension.

Everything else is in pyproject.toml. The extension is `optional`: where it cannot be
built the package installs without it and the pure-Python tree is used (with one
warning, see token_spec/suffix_impl.py).
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "thinkahead.token_spec._suffix_native",
            ["token_spec/native/suffix_tree.cpp"],
            cxx_std=17,
            # Probabilities and budgets must round as CPython's: no fused multiply-add.
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ],
)
