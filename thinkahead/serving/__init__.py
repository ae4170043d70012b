"""Serving: the OpenAI-compatible HTTP server over an `Orchestrator`, and the SGLang server launcher."""
