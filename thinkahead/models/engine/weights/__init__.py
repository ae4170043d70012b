"""Loading a model's weights for the engine: GGUF files read natively and checked, caches, layouts."""
