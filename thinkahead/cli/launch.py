"""`thinkahead launch`: one SGLang server per model tier, healthy, until Ctrl-C or SIGTERM.

The work is in `thinkahead.serving.sglang_launcher`; this module is the click wiring (registered in thinkahead/cli/__init__.py).
"""

from __future__ import annotations

import shlex
import signal
import sys
import time
from pathlib import Path

import click

from thinkahead.serving.sglang_launcher import ALGORITHMS, DEFAULT_PORTS

_ALGO = click.Choice(ALGORITHMS, case_sensitive=False)


def _args(values: tuple[str, ...]) -> list[str]:
    return [part for value in values for part in shlex.split(value)]


def _raise_interrupt(signum, frame) -> None:  # noqa: ANN001 - a signal handler's signature
    raise KeyboardInterrupt


@click.command()
@click.option("--small", "small_model", required=True, help="Small (drafting) model: a local path or hub id.")
@click.option("--large", "large_model", required=True, help="Large (judging) model: a local path or hub id.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface both servers listen on.")
@click.option("--small-port", type=int, default=DEFAULT_PORTS["small"], show_default=True)
@click.option("--large-port", type=int, default=DEFAULT_PORTS["large"], show_default=True)
@click.option("--small-spec", type=_ALGO, default="NGRAM", show_default=True,
              help="Speculative algorithm of the small server (SUFFIX: our plugin, NGRAM if unavailable).")
@click.option("--large-spec", type=_ALGO, default="NGRAM", show_default=True,
              help="Speculative algorithm of the large server.")
@click.option("--small-draft", default=None, help="Draft model of the small server (EAGLE, EAGLE3, STANDALONE).")
@click.option("--large-draft", default=None, help="Draft model of the large server (EAGLE, EAGLE3, STANDALONE).")
@click.option("--small-tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor parallelism.")
@click.option("--large-tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor parallelism.")
@click.option("--small-mem", type=float, default=None,
              help="--mem-fraction-static of the small server [0.25 on a shared GPU, else SGLang's].")
@click.option("--large-mem", type=float, default=None,
              help="--mem-fraction-static of the large server [0.6 on a shared GPU, else SGLang's].")
@click.option("--small-gpus", default=None, help="CUDA_VISIBLE_DEVICES of the small server, e.g. 0.")
@click.option("--large-gpus", default=None, help="CUDA_VISIBLE_DEVICES of the large server, e.g. 1,2.")
@click.option("--small-arg", multiple=True, help="More launch_server flags for the small server (repeatable).")
@click.option("--large-arg", multiple=True, help="More launch_server flags for the large server (repeatable).")
@click.option("--python", "python", default=sys.executable, show_default=True,
              help="Interpreter with sglang installed (thinkahead too, for SUFFIX).")
@click.option("--launcher", default=None,
              help="Command that starts one server [PYTHON -m sglang.launch_server], e.g. 'sglang serve'.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("sglang-logs"),
              show_default=True, help="Each server's output goes to ROLE.log here.")
@click.option("--timeout", type=float, default=1800.0, show_default=True,
              help="Seconds to wait for both servers to answer /health.")
@click.option("--dry-run", is_flag=True, help="Print the two command lines and exit.")
def launch(small_model, large_model, host, small_port, large_port, small_spec, large_spec, small_draft, large_draft,
           small_tp, large_tp, small_mem, large_mem, small_gpus, large_gpus, small_arg, large_arg, python, launcher,
           log_dir, timeout, dry_run) -> None:
    """Start SGLang servers for the small and the large model, print their URLs, stop them on Ctrl-C.

    Both load at once; when both answer /health the URLs are printed with the model specs to
    give `thinkahead run` (--small sglang:... --large sglang:...). Ctrl-C or SIGTERM stops both
    servers (their whole process groups). Settings per algorithm: see thinkahead/serving/sglang_launcher.py.
    Beyond one machine, put SGLang's router (sglang-router) in front of many servers and point
    --large at it (sglang:http://ROUTER:PORT).
    """
    from thinkahead.serving.sglang_launcher import LaunchError, Launcher, default_launcher, plan_servers, server_command

    try:
        configs = plan_servers(
            small_model, large_model, host=host, ports=(small_port, large_port),
            speculative=(small_spec.upper(), large_spec.upper()), draft_models=(small_draft, large_draft),
            tp_sizes=(small_tp, large_tp), mem_fractions=(small_mem, large_mem), gpus=(small_gpus, large_gpus),
            extra_args=(_args(small_arg), _args(large_arg)),
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    command = tuple(shlex.split(launcher)) if launcher else default_launcher(python)
    if dry_run:
        for config in configs:
            click.echo(shlex.join(server_command(config, command)))
        return

    runner = Launcher(configs, launcher=command, log_dir=log_dir, python=python,
                      echo=lambda line: click.echo(line, err=True))
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        runner.start()
        click.echo(f"starting {len(runner.servers)} servers (logs in {log_dir}/) ...", err=True)
        t0 = time.perf_counter()
        runner.wait_healthy(timeout)
        click.echo(f"healthy after {time.perf_counter() - t0:.0f}s; Ctrl-C stops them", err=True)
        click.echo(runner.summary())
        while True:
            time.sleep(0.5)
            dead = runner.dead()
            if dead:
                s = dead[0]
                raise LaunchError(f"{s.config.role} server exited with code {s.exit_code()}; last lines of "
                                  f"{s.log_path}:\n{s.log_tail()}")
    except KeyboardInterrupt:
        click.echo("stopping the servers ...", err=True)
    except LaunchError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        runner.stop()
        signal.signal(signal.SIGTERM, previous)
    click.echo("stopped", err=True)
