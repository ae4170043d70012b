"""The distribution's package list covers every package folder (a plain `pip install .` installs only
what pyproject lists; an editable install would hide a missing one)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping, listed = setuptools["package-dir"], set(setuptools["packages"])
    found = {
        ".".join([package, *init.parent.relative_to(ROOT / folder).parts])
        for package, folder in mapping.items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found == listed
