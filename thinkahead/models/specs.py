"""Model spec strings (`qwen2.5-coder-0.5b`, `gguf:PATH`, `hf:ORG/NAME`, a directory, a .gguf file)
resolved to a `ModelSource`, without loading anything."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from thinkahead.models.registry import REGISTRY

SourceKind = Literal["registry", "gguf", "hf", "dir"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SPEC_FORMS = (
    "a registry name ({names})",
    "gguf:PATH (a .gguf file)",
    "hf:ORG/NAME or ORG/NAME (a Hugging Face hub id, e.g. Qwen/Qwen2.5-0.5B-Instruct)",
    "a local model directory containing config.json",
    "a path to a .gguf file",
)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model comes from, as resolved from a user's spec string.

    `location` is the directory holding the weights (kinds "gguf" and "dir"), the hub id
    (kind "hf"), or None for kind "registry" (the path is known only after `prepare`).
    """

    kind: SourceKind
    location: str | None
    gguf_file: str | None = None
    registry_name: str | None = None

    @property
    def gguf_path(self) -> Path | None:
        """Full path of the GGUF file for kind "gguf"; None otherwise."""
        if self.kind == "gguf" and self.location is not None and self.gguf_file is not None:
            return Path(self.location) / self.gguf_file
        return None


def _bad_spec(spec: str, why: str) -> ValueError:
    names = ", ".join(sorted(REGISTRY))
    forms = "\n  - ".join(form.format(names=names) for form in SPEC_FORMS)
    return ValueError(f"cannot resolve model spec {spec!r}: {why}. Accepted forms:\n  - {forms}")


def _gguf_source(spec: str, raw_path: str) -> ModelSource:
    path = Path(raw_path).expanduser()
    if path.suffix.lower() != ".gguf":
        raise _bad_spec(spec, f"{path} does not end in .gguf")
    if not path.is_file():
        raise _bad_spec(spec, f"GGUF file {path} does not exist")
    path = path.resolve()
    return ModelSource(kind="gguf", location=str(path.parent), gguf_file=path.name)


def resolve_model_spec(spec: str) -> ModelSource:
    """Turn a model spec string into a ModelSource; ValueError listing accepted forms if none fits."""
    if not isinstance(spec, str) or not spec.strip():
        raise _bad_spec(str(spec), "empty spec")
    spec = spec.strip()
    if spec in REGISTRY:
        return ModelSource(
            kind="registry", location=None, gguf_file=REGISTRY[spec].gguf_file, registry_name=spec
        )
    if spec.startswith("gguf:"):
        return _gguf_source(spec, spec[len("gguf:"):])
    if spec.startswith("hf:"):
        hub_id = spec[len("hf:"):]
        if not _HUB_ID.match(hub_id):
            raise _bad_spec(spec, f"{hub_id!r} is not a hub id of the form ORG/NAME")
        return ModelSource(kind="hf", location=hub_id)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise _bad_spec(spec, f"directory {path} has no config.json")
        return ModelSource(kind="dir", location=str(path.resolve()))
    if path.suffix.lower() == ".gguf":
        return _gguf_source(spec, spec)
    if _HUB_ID.match(spec) and not path.exists():  # a plain hub id, as `launch` takes it
        return ModelSource(kind="hf", location=spec)
    raise _bad_spec(spec, "not a registry name, prefixed spec, model directory, hub id or .gguf file")
