"""Packaging as users install it: the licence file matches pyproject's SPDX string, the declared
dependencies are the imported ones, transformers is bounded, the version is defined once, the sdist
carries examples/, and plain Hugging Face ids are model specs."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LIBRARY = ("thinkahead", "orchestrator", "step_spec", "token_spec", "verifiers", "workflows")
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"yaml": "pyyaml", "huggingface_hub": "huggingface-hub"}
# imported only behind an optional feature, each declared in an extra or pinned by it
OPTIONAL = {"matplotlib", "sglang", "llama_cpp", "llm", "tokenizers", "safetensors"}
# declared without an import of ours: transformers (>= 5.24) refuses to load a GGUF file without it
USED_BY_DEPENDENCIES = {"accelerate"}


def declared() -> set[str]:
    return {d.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip().lower()
            for d in PYPROJECT["project"]["dependencies"]}


def imported() -> set[str]:
    names = set()
    for folder in LIBRARY:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module.split(".")[0])
    stdlib = set(sys.stdlib_module_names) | {"thinkahead", "__future__"}
    return {DISTRIBUTIONS.get(n, n).lower() for n in names - stdlib - OPTIONAL}


def test_the_declared_dependencies_are_the_imported_ones():
    assert imported() == declared() - USED_BY_DEPENDENCIES


def test_transformers_has_an_upper_bound():
    [spec] = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("transformers")]
    assert "<6" in spec


def test_the_licence_is_an_spdx_string_matching_the_licence_file():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_the_version_is_defined_once():
    import thinkahead

    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "thinkahead.__version__"}
    assert isinstance(thinkahead.__version__, str) and thinkahead.__version__.count(".") >= 2


def test_the_sdist_carries_every_native_source():
    """setup.py compiles these from an sdist too: each source folder is in MANIFEST.in with its suffixes."""
    manifest = (ROOT / "MANIFEST.in").read_text().splitlines()
    sources = [p for suffix in ("*.cpp", "*.hpp", "*.inc") for p in ROOT.glob(f"**/native/{suffix}")
               if "build" not in p.parts and ".git" not in p.parts]
    assert sources
    for path in sources:
        folder = path.parent.relative_to(ROOT).as_posix()
        assert any(line.startswith(f"recursive-include {folder} ") and f"*{path.suffix}" in line.split()
                   for line in manifest), path


def test_the_sdist_carries_the_examples_and_the_package_is_typed():
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "recursive-include examples" in manifest and "include LICENSE" in manifest
    assert PYPROJECT["tool"]["setuptools"]["package-data"]["thinkahead"] == ["py.typed"]
    assert (ROOT / "thinkahead" / "py.typed").is_file()


def test_python_dash_m_thinkahead_runs_the_cli():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "thinkahead", "--version"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "thinkahead" in out.stdout


@pytest.mark.parametrize("spec", ["Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_plain_hub_ids_are_model_specs(spec):
    from thinkahead.config import OrchestratorConfig
    from thinkahead.models.specs import resolve_model_spec

    source = resolve_model_spec(spec)
    assert (source.kind, source.location) == ("hf", spec)
    config = OrchestratorConfig.model_validate({"small": spec, "large": {"spec": spec}})
    assert config.small.spec == spec


def test_the_packaged_draft_heads_install_with_the_package():
    """`drafter: auto` reads token_spec/heads/<model>.safetensors: a wheel and an sdist must carry them."""
    from thinkahead.token_spec.names import HEADS_DIR, packaged_heads

    assert packaged_heads() and HEADS_DIR == ROOT / "token_spec" / "heads"
    assert "heads/*.safetensors" in PYPROJECT["tool"]["setuptools"]["package-data"]["thinkahead.token_spec"]
    assert "recursive-include token_spec/heads *.safetensors" in (ROOT / "MANIFEST.in").read_text().splitlines()
