"""The command line imports a command's module only when that command runs (or `--help` lists them all)."""

from __future__ import annotations

import subprocess
import sys

from thinkahead.cli import COMMANDS, main


def _loaded(code: str, *modules: str) -> dict[str, bool]:
    """Which of `modules` are in sys.modules after running `code` in a fresh interpreter."""
    probe = f"{code}\nimport sys\nprint(' '.join(str(m in sys.modules) for m in {modules!r}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    return dict(zip(modules, (w == "True" for w in out.stdout.split())))


HEAVY = ("torch", "transformers", "pydantic", "thinkahead.config", "thinkahead.orchestrator")


def test_simulate_loads_none_of_the_other_commands_machinery():
    code = ("from click.testing import CliRunner\nfrom thinkahead.cli import main\n"
            "r = CliRunner().invoke(main, ['simulate', '--help'])\nassert r.exit_code == 0, r.output")
    loaded = _loaded(code, *HEAVY, "thinkahead.cli.run", "thinkahead.cli.simulate", "thinkahead.token_spec.decoder")
    assert loaded.pop("thinkahead.cli.simulate")
    assert not any(loaded.values()), loaded


def test_the_drafters_for_a_replay_do_not_load_the_decoder():
    loaded = _loaded("import thinkahead.token_spec.presets, thinkahead.token_spec.simulator, "
                     "thinkahead.token_spec.recording", "thinkahead.token_spec.decoder", "thinkahead.config")
    assert not any(loaded.values()), loaded


def test_every_command_is_listed_and_loads_under_its_name():
    assert sorted(main.commands) == sorted(COMMANDS)
    assert all(main.commands[name].name == name for name in COMMANDS)
    listed = subprocess.run([sys.executable, "-m", "thinkahead", "--help"], capture_output=True, text=True,
                            check=True, timeout=120).stdout
    assert all(f"  {name} " in listed for name in COMMANDS), listed
