"""The import rule of docs/architecture.md: a layer imports only the layers below it, never one above.

Every `import` in every module counts, those inside functions too (a lazy import is still a
dependency). Layers, top to bottom: the user-facing top (cli, serving, evals, sdk, config),
workflows, orchestrator, step_spec, verifiers, models, the local engine (thinkahead/models/engine), the
model catalog (thinkahead/models' registry, specs, templates and errors: which models exist and where
their files are), token_spec.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The model catalog's modules (a layer of single files inside thinkahead/models, below the engine).
CATALOG = ("registry", "specs", "templates", "errors")
# (layer name, folder or module file, import prefix), top first; a module may import its own layer and any below.
LAYERS = [
    ("top", "thinkahead", "thinkahead"),
    ("workflows", "workflows", "thinkahead.workflows"),
    ("orchestrator", "orchestrator", "thinkahead.orchestrator"),
    ("step_spec", "step_spec", "thinkahead.step_spec"),
    ("verifiers", "verifiers", "thinkahead.verifiers"),
    ("models", "thinkahead/models", "thinkahead.models"),
    ("engine", "thinkahead/models/engine", "thinkahead.models.engine"),
    *(("catalog", f"thinkahead/models/{name}.py", f"thinkahead.models.{name}") for name in CATALOG),
    ("token_spec", "token_spec", "thinkahead.token_spec"),
]
RANK = {name: i for i, (name, _, _) in enumerate(LAYERS)}


def layer_of_module(name: str) -> str | None:
    """The layer an import target belongs to (longest prefix wins; `thinkahead.x` alone is the top)."""
    best = None
    for layer, _, prefix in LAYERS:
        if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
            best = (layer, prefix)
    return best[0] if best else None


def layer_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT).as_posix()
    best = None
    for layer, folder, _ in LAYERS:
        if (rel == folder or rel.startswith(folder + "/")) and (best is None or len(folder) > len(best[1])):
            best = (layer, folder)
    assert best is not None, rel
    return best[0]


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names if node.module == "thinkahead"]
    return out


def violations() -> list[str]:
    found = []
    paths = {path for _, folder, _ in LAYERS if not folder.endswith(".py") for path in (ROOT / folder).rglob("*.py")}
    for path in sorted(paths):  # each once (a folder's walk also reads the layers inside it)
        own = layer_of_file(path)
        for lineno, target in imports(path):
            if not target.startswith("thinkahead"):
                continue
            layer = layer_of_module(target)
            if layer is None:
                continue
            if target in ("thinkahead", "thinkahead.__version__") and own != "top":
                found.append(f"{path.relative_to(ROOT)}:{lineno}: {own} imports the package root ({target})")
            elif RANK[layer] < RANK[own]:
                found.append(f"{path.relative_to(ROOT)}:{lineno}: {own} imports {target} ({layer}, a higher layer)")
    return found


def test_no_layer_imports_a_higher_one():
    assert violations() == []


def test_the_rule_catches_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "token_spec"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from thinkahead.step_spec.loop import StepLoop\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    for _, folder, _ in LAYERS:
        if not folder.endswith(".py"):
            (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    (tmp_path / "thinkahead/models/engine/bad.py").write_text("from thinkahead.models.local import LocalModel\n")
    (tmp_path / "thinkahead/models/registry.py").write_text("import thinkahead.models.engine.config\n")
    assert violations() == [
        "thinkahead/models/engine/bad.py:1: engine imports thinkahead.models.local (models, a higher layer)",
        "thinkahead/models/registry.py:1: catalog imports thinkahead.models.engine.config (engine, a higher layer)",
        "token_spec/bad.py:2: token_spec imports thinkahead.step_spec.loop (step_spec, a higher layer)"]


def test_the_light_modules_do_not_import_torch():
    """Configs, the CLI's --help and the HTTP model clients load without torch."""
    import subprocess

    code = ("import sys\nimport thinkahead.config, thinkahead.cli, thinkahead.models.sglang, thinkahead.models.openai, "
            "thinkahead.token_spec.names\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
