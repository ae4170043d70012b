"""The ``thinkahead`` command line: a click group; each command lives in its own module here.

Only the wiring lives in this file; the work is done by library modules, imported inside the
commands. A command's own module is imported only when that command runs (or when `--help`
lists them all), so `thinkahead simulate` never loads the config models, the orchestrator or
torch that other commands' options need. To add a command, write a module in this package
(its click command named as the module) and add that name to `COMMANDS`.
"""

from __future__ import annotations

import importlib

import click

from thinkahead import __version__

COMMANDS = ("run", "trace", "bench", "compare", "reason", "router", "generate", "serve", "launch", "simulate", "models")


class _LazyGroup(click.Group):
    """A group whose commands are imported from `thinkahead.cli.<name>` when first looked up.

    Reading `.commands` (tests, tools that walk the whole group) imports them all; running one
    command goes through `get_command` and imports only that one.
    """

    @property
    def commands(self) -> dict[str, click.Command]:
        for name in COMMANDS:
            self._load(name)
        return self._commands

    @commands.setter
    def commands(self, value: dict[str, click.Command]) -> None:
        self._commands = value

    def _load(self, name: str) -> click.Command | None:
        command = self._commands.get(name)
        if command is None and name in COMMANDS:
            command = getattr(importlib.import_module(f"{__name__}.{name}"), name)
            self._commands[name] = command
        return command

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self._load(cmd_name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *self._commands})


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="thinkahead")
def main() -> None:
    """thinkahead: speculation at the step, token and workflow levels for reasoning models."""
