"""The Qwen2 decoder on the engine's kernels: fused layers, exact attention and rotary embeddings."""
