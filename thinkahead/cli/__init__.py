"""The ``thinkahead`` command line: a click group; each command lives in its own module here.

Only the wiring lives in this file; the work is done by library modules, imported inside the
commands so that ``thinkahead --help`` stays fast. To add a command, write a module in this package
and register it below with ``main.add_command(...)``.
"""

from __future__ import annotations

import click

from thinkahead import __version__
from thinkahead.cli.bench import bench
from thinkahead.cli.compare import compare
from thinkahead.cli.generate import generate
from thinkahead.cli.launch import launch
from thinkahead.cli.models import models
from thinkahead.cli.reason import reason
from thinkahead.cli.router import router
from thinkahead.cli.run import run
from thinkahead.cli.serve import serve
from thinkahead.cli.simulate import simulate
from thinkahead.cli.trace import trace


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="thinkahead")
def main() -> None:
    """thinkahead: speculation at the step, token and workflow levels for reasoning models."""


for command in (run, trace, bench, compare, reason, router, generate, serve, launch, simulate, models):
    main.add_command(command)
