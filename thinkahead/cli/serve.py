"""`thinkahead serve`: the OpenAI-compatible endpoint of `thinkahead.serving.openai_server`, run by uvicorn."""

from __future__ import annotations

import time

import click

from thinkahead.cli.options import POLICIES, build_settings, orchestrator_options, quiet_loading


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to listen on.")
@click.option("--policy", type=click.Choice(POLICIES), default=None,
              help="Step policy of model names without one, e.g. thinkahead/cot [specreason].")
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True,
              help="Runs in flight at once; more requests wait in line (overrides the config file).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True, help="uvicorn's log level.")
@orchestrator_options
def serve(host, port, policy, concurrency, log_level, **options) -> None:
    """Serve /v1/chat/completions (streaming too) and /v1/models, OpenAI-style.

    The model name picks the workflow and step policy: thinkahead/<workflow>[:<policy>], e.g.
    thinkahead/cot:specreason or thinkahead/react. The two models load once and serve every
    workflow and policy.
    """
    import uvicorn

    from thinkahead.serving.openai_server import create_app

    settings = build_settings(**options, policy=policy, concurrency=concurrency)
    if any(not settings[tier]["spec"].startswith("openai:") for tier in ("small", "large")):
        quiet_loading()  # local weights: no per-tensor progress bars
    click.echo(f"loading {settings['small']['spec']} and {settings['large']['spec']} "
               f"({settings['large']['dtype']}) ...", err=True)
    t0 = time.perf_counter()
    try:
        app = create_app(settings)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"models ready in {time.perf_counter() - t0:.0f}s; serving thinkahead/<workflow>[:<policy>] "
               f"at http://{host}:{port}/v1", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
