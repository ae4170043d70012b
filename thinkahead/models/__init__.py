"""The model layer: one async `LanguageModel` API over local, SGLang, OpenAI-compatible and scripted backends."""

from thinkahead.models.base import Completion, GenerationRequest, LanguageModel, render_chat, render_plain
from thinkahead.models.scripted import ScriptedModel

__all__ = [
    "Completion", "GenerationRequest", "LanguageModel", "LocalModel", "OpenAIModel", "SGLangModel", "ScriptedModel",
    "load_model", "render_chat", "render_plain",
]


def __getattr__(name: str):
    # heavy backends import torch / httpx: load them on first use
    if name == "LocalModel":
        from thinkahead.models.local import LocalModel

        return LocalModel
    if name == "OpenAIModel":
        from thinkahead.models.openai import OpenAIModel

        return OpenAIModel
    if name == "SGLangModel":
        from thinkahead.models.sglang import SGLangModel

        return SGLangModel
    if name == "load_model":
        from thinkahead.models.loader import load_model

        return load_model
    raise AttributeError(name)
