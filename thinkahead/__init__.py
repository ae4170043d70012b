"""thinkahead: an inference orchestrator for reasoning models and agents."""

__version__ = "0.1.0"
