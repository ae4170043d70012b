"""Model backends that run the target (and draft) models."""
