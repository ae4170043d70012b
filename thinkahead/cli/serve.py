"""`thinkahead serve`: the OpenAI-compatible endpoint of `thinkahead.serving.app`, run by uvicorn."""

from __future__ import annotations

import time

import click

from thinkahead.cli.options import (
    POLICIES, build_settings, check_scores, model_file_errors, orchestrator_options, quiet_loading,
)
from thinkahead.config import default
from thinkahead.serving.limits import ServerSettings
from thinkahead.step_spec.state import TIERS


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to listen on.")
@click.option("--policy", type=click.Choice(POLICIES), default=None,
              help=f"Step policy of model names without one, e.g. thinkahead/cot [{default('policy.name')}].")
@click.option("--concurrency", type=click.IntRange(min=1), default=None,
              help="Runs in flight at once; more requests wait in line (overrides the config file) "
                   f"[{default('concurrency')}].")
@click.option("--api-key", default=None, envvar="THINKAHEAD_API_KEY", show_envvar=True,
              help="Bearer key every request must carry (401 without it); /health stays open.")
@click.option("--allow-origin", "allow_origins", multiple=True,
              help="A browser origin allowed by CORS, e.g. http://localhost:3000 ('*': any); none by default.")
@click.option("--allowed-host", "allowed_hosts", multiple=True,
              help="A Host header name accepted (against DNS rebinding); default: the loopback names when "
                   "listening on loopback, any otherwise.")
@click.option("--max-queue", type=click.IntRange(min=0), default=None,
              help="Requests that may wait for a slot; more are answered 429 with Retry-After "
                   f"[{ServerSettings.model_fields['max_queue'].default}].")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True, help="uvicorn's log level.")
@orchestrator_options
def serve(host, port, policy, concurrency, api_key, allow_origins, allowed_hosts, max_queue, log_level,
          **options) -> None:
    """Serve the OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.

    Model names: the small and the large model by their names (plain chat: one generation, tools,
    JSON outputs, logprobs; /v1/completions too), or thinkahead/<workflow>[:<policy>], e.g.
    thinkahead/cot:specreason or thinkahead/react (a whole workflow). The two models load once and
    serve every name.
    """
    import uvicorn

    from thinkahead.serving.app import create_app
    from thinkahead.serving.limits import LOOPBACK_HOSTS

    # a request names its policy (thinkahead/cot:specreason): every policy's options may be read
    settings = build_settings(**options, policy=policy, concurrency=concurrency, reads=POLICIES)
    hosts = list(allowed_hosts) or (list(LOOPBACK_HOSTS) if host in LOOPBACK_HOSTS else None)
    server = {"api_key": api_key, "allow_origins": list(allow_origins), "allowed_hosts": hosts}
    if max_queue is not None:
        server["max_queue"] = max_queue
    server_settings = ServerSettings.with_env(**server)
    if any(not settings[tier]["spec"].startswith("openai:") for tier in TIERS):
        quiet_loading()  # local weights: no per-tensor progress bars
    click.echo(f"loading {settings['small']['spec']} and {settings['large']['spec']} "
               f"({settings['large']['dtype']}) ...", err=True)
    t0 = time.perf_counter()
    try:
        with model_file_errors():  # a damaged model file: exit 2, as for run and generate
            app = create_app(settings, settings=server_settings)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    check_scores(app.config.policy, app.small, app.large)
    names = ", ".join(app.chat_models())
    click.echo(f"models ready in {time.perf_counter() - t0:.0f}s; serving {names} and thinkahead/<workflow>[:<policy>] "
               f"at http://{host}:{port}/v1{' (API key required)' if server_settings.api_key else ''}", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
