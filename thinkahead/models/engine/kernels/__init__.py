"""The engine's native kernels (native/: C++ built by setup.py as optional extensions) and their Python side."""
