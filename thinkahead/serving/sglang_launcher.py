"""Start SGLang servers for the two model tiers, wait until they are healthy, stop them cleanly.

`thinkahead launch` (thinkahead/cli/launch.py) is the command; this module builds the command
lines and owns the processes, so both can be tested without SGLang (a fake server script stands
in for `python -m sglang.launch_server`).

Each server is `python -m sglang.launch_server --model-path M --host H --port P --tp-size N
[--mem-fraction-static F] [--served-model-name S] [speculative flags] [extra args]`, started in its
own process group (SGLang runs its scheduler and detokenizer as child processes) with its output
in a log file. Speculative settings (SGLang 0.5.23 flag names; `SPECULATIVE_FLAGS`):

| algorithm  | flags                                                                                    |
|------------|------------------------------------------------------------------------------------------|
| NGRAM      | `--speculative-num-draft-tokens 12 --speculative-ngram-max-trie-depth 18`                |
|            | `--speculative-ngram-max-bfs-breadth 10` (0.5.23's defaults, made explicit)              |
| EAGLE      | draft model + `--speculative-num-steps 3 --speculative-eagle-topk 4`                     |
| EAGLE3     | `--speculative-num-draft-tokens 16` (SGLang's documented EAGLE-2/EAGLE-3 example)        |
| STANDALONE | draft model + `--speculative-num-steps 4 --speculative-eagle-topk 1`                     |
|            | `--speculative-num-draft-tokens 5` (the documented V2-worker example; 0.5.23 runs        |
|            | STANDALONE on the V2 worker)                                                             |
| SUFFIX     | our plugin (thinkahead/token_spec/backends/sglang_suffix.py) with NGRAM's verify budget: |
|            | `--speculative-num-draft-tokens 12 --speculative-ngram-max-trie-depth 18`, and the       |
|            | `THINKAHEAD_SUFFIX_*` variables in the server's environment                              |

SUFFIX needs thinkahead and a plugin-capable SGLang in the server's Python; `launch` asks that
Python (`plugin_status`) and falls back to NGRAM with the settings above when it cannot, saying why.

Two servers on one GPU must share its memory: without `gpus`, the small server gets
`--mem-fraction-static 0.25` and the large one 0.6 unless given; with separate GPUs
(`CUDA_VISIBLE_DEVICES` per server) SGLang's own default applies.

Beyond one machine: start servers on each machine (this command, or `python -m
sglang.launch_server` directly), put SGLang's router in front of them (`pip install
sglang-router`; `python -m sglang_router.launch_router --worker-urls http://h1:30000
http://h2:30000 --policy cache_aware --port 30100`; its cache-aware policy keeps a judge call on
the server that holds its prefix) and point thinkahead at the router: `--large
sglang:http://router:30100`. Pass the model's tokenizer to `SGLangModel` there: the router
forwards `/generate` and `/health`, not necessarily `/tokenize`.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from thinkahead.errors import ThinkaheadError
from thinkahead.step_spec.state import TIERS

ALGORITHMS = ("NONE", "NGRAM", "EAGLE", "EAGLE3", "STANDALONE", "SUFFIX")
NEEDS_DRAFT_MODEL = ("EAGLE", "EAGLE3", "STANDALONE")
SPECULATIVE_FLAGS: dict[str, tuple[str, ...]] = {
    "NONE": (),
    "NGRAM": ("--speculative-num-draft-tokens", "12", "--speculative-ngram-max-trie-depth", "18",
              "--speculative-ngram-max-bfs-breadth", "10"),
    "EAGLE": ("--speculative-num-steps", "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"),
    "EAGLE3": ("--speculative-num-steps", "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"),
    "STANDALONE": ("--speculative-num-steps", "4", "--speculative-eagle-topk", "1",
                   "--speculative-num-draft-tokens", "5"),
    "SUFFIX": ("--speculative-num-draft-tokens", "12", "--speculative-ngram-max-trie-depth", "18"),
}
SHARED_GPU_MEM_FRACTION = {"small": 0.25, "large": 0.6}
DEFAULT_PORTS = {"small": 30000, "large": 30001}


class LaunchError(ThinkaheadError, RuntimeError):
    """A server could not be started or did not become healthy; the message quotes its log."""


def default_launcher(python: str | None = None) -> tuple[str, ...]:
    """The command that starts one server: `python -m sglang.launch_server`."""
    return (python or sys.executable, "-m", "sglang.launch_server")


@dataclass(frozen=True)
class ServerConfig:
    """One SGLang server to start.

    Args:
        role: "small" or "large" (names the log file and the summary line).
        model_path: what SGLang loads (a local directory or a hub id).
        port, host: where it listens.
        tp_size: tensor-parallel GPUs (`--tp-size`).
        mem_fraction_static: GPU memory share for weights + KV cache; None: SGLang's default.
        speculative: one of `ALGORITHMS` (None or "NONE": plain decoding).
        draft_model_path: the draft model of EAGLE, EAGLE3 and STANDALONE.
        served_model_name: the name SGLang reports (`--served-model-name`).
        gpus: `CUDA_VISIBLE_DEVICES` for this server, e.g. "0" or "2,3"; None inherits.
        extra_args: more `launch_server` flags, appended as given.
        env: more environment variables for the server (e.g. `THINKAHEAD_SUFFIX_MAX_DEPTH`).
    """

    role: str
    model_path: str
    port: int
    host: str = "127.0.0.1"
    tp_size: int = 1
    mem_fraction_static: float | None = None
    speculative: str | None = None
    draft_model_path: str | None = None
    served_model_name: str | None = None
    gpus: str | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in TIERS:
            raise ValueError(f"role must be one of {TIERS}, got {self.role!r}")
        if not isinstance(self.model_path, str) or not self.model_path.strip():
            raise ValueError(f"{self.role}: model_path must be a non-empty string")
        if not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ValueError(f"{self.role}: port must be in 1..65535, got {self.port!r}")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"{self.role}: tp_size must be an int >= 1, got {self.tp_size!r}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"{self.role}: mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        algo = self.algorithm
        if algo not in ALGORITHMS:
            raise ValueError(f"{self.role}: speculative algorithm must be one of {', '.join(ALGORITHMS)}, "
                             f"got {self.speculative!r}")
        if algo in NEEDS_DRAFT_MODEL and not self.draft_model_path:
            raise ValueError(f"{self.role}: --speculative-algorithm {algo} needs a draft model path")
        if algo not in NEEDS_DRAFT_MODEL and self.draft_model_path:
            raise ValueError(f"{self.role}: a draft model is used only by {', '.join(NEEDS_DRAFT_MODEL)}, not {algo}")
        if isinstance(self.extra_args, str):
            raise ValueError(f"{self.role}: extra_args must be a sequence of arguments, not one string")

    @property
    def algorithm(self) -> str:
        return (self.speculative or "NONE").upper()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def spec(self) -> str:
        """The `load_model` spec of this server (`sglang:NAME@URL`)."""
        return f"sglang:{self.role}@{self.url}"


def server_command(config: ServerConfig, launcher: Sequence[str] | None = None) -> list[str]:
    """The argv that starts `config`'s server."""
    cmd = list(launcher or default_launcher())
    cmd += ["--model-path", config.model_path, "--host", config.host, "--port", str(config.port),
            "--tp-size", str(config.tp_size)]
    if config.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", f"{config.mem_fraction_static:g}"]
    if config.served_model_name:
        cmd += ["--served-model-name", config.served_model_name]
    algo = config.algorithm
    if algo != "NONE":
        cmd += ["--speculative-algorithm", algo]
        if config.draft_model_path:
            cmd += ["--speculative-draft-model-path", config.draft_model_path]
        cmd += list(SPECULATIVE_FLAGS[algo])
    cmd += list(config.extra_args)
    return cmd


def server_env(config: ServerConfig, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: `base` (default: ours), its GPUs, its extra variables, and for
    SUFFIX the plugin kept in an `SGLANG_PLUGINS` whitelist when one is set."""
    env = dict(os.environ if base is None else base)
    if config.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = config.gpus
    env.update(config.env)
    if config.algorithm == "SUFFIX" and env.get("SGLANG_PLUGINS"):
        from thinkahead.token_spec.backends.sglang_suffix import ENTRY_POINT_NAME

        names = [x.strip() for x in env["SGLANG_PLUGINS"].split(",") if x.strip()]
        if ENTRY_POINT_NAME not in names:
            env["SGLANG_PLUGINS"] = ",".join(names + [ENTRY_POINT_NAME])
    return env


Probe = Callable[[str, Mapping[str, str]], tuple[bool, str]]

PROBE_CODE = (
    "from thinkahead.token_spec.backends.sglang_suffix import plugin_status\n"
    "ok, why = plugin_status()\nprint(why)\nraise SystemExit(0 if ok else 1)\n"
)


def probe_suffix_plugin(python: str, env: Mapping[str, str]) -> tuple[bool, str]:
    """Ask `python` (the servers' interpreter) whether its SGLang can run SUFFIX."""
    try:
        done = subprocess.run([python, "-c", PROBE_CODE], env=dict(env), capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"could not ask {python}: {exc}"
    lines = (done.stdout.strip() or done.stderr.strip() or "no answer").splitlines()
    return done.returncode == 0, lines[-1]


def resolve_speculative(config: ServerConfig, probe: Probe, python: str,
                        base_env: Mapping[str, str] | None = None) -> tuple[ServerConfig, str | None]:
    """`config`, or for SUFFIX where the plugin cannot run, the NGRAM fallback and the reason."""
    if config.algorithm != "SUFFIX":
        return config, None
    ok, why = probe(python, server_env(config, base_env))
    if ok:
        return config, None
    note = (f"{config.role}: SUFFIX plugin unavailable ({why}); falling back to NGRAM with "
            f"{' '.join(SPECULATIVE_FLAGS['NGRAM'])}")
    return replace(config, speculative="NGRAM"), note


def plan_servers(
    small: str,
    large: str,
    *,
    host: str = "127.0.0.1",
    ports: tuple[int, int] = (DEFAULT_PORTS["small"], DEFAULT_PORTS["large"]),
    speculative: tuple[str | None, str | None] = (None, None),
    draft_models: tuple[str | None, str | None] = (None, None),
    tp_sizes: tuple[int, int] = (1, 1),
    mem_fractions: tuple[float | None, float | None] = (None, None),
    gpus: tuple[str | None, str | None] = (None, None),
    extra_args: tuple[Sequence[str], Sequence[str]] = ((), ()),
    env: Mapping[str, str] | None = None,
) -> list[ServerConfig]:
    """The small and the large server; on a shared GPU the memory split of `SHARED_GPU_MEM_FRACTION`."""
    if ports[0] == ports[1]:
        raise ValueError(f"the small and the large server need different ports, got {ports[0]} twice")
    shared_gpu = gpus[0] is None or gpus[1] is None or bool(set(gpus[0].split(",")) & set(gpus[1].split(",")))
    configs = []
    for i, (role, model) in enumerate((("small", small), ("large", large))):
        mem = mem_fractions[i]
        if mem is None and shared_gpu:
            mem = SHARED_GPU_MEM_FRACTION[role]
        configs.append(ServerConfig(
            role=role, model_path=model, port=ports[i], host=host, tp_size=tp_sizes[i], mem_fraction_static=mem,
            speculative=speculative[i], draft_model_path=draft_models[i], gpus=gpus[i],
            extra_args=tuple(extra_args[i]), env=dict(env or {}),
        ))
    return configs


class ServerProcess:
    """One running server: its process group, its log, its health."""

    def __init__(self, config: ServerConfig, command: Sequence[str], env: Mapping[str, str], log_path: Path) -> None:
        self.config = config
        self.command = list(command)
        self.env = dict(env)
        self.log_path = Path(log_path)
        self.process: subprocess.Popen[bytes] | None = None
        self._stopped = False

    @property
    def url(self) -> str:
        return self.config.url

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {shlex.join(self.command)}\n".encode())
            log.flush()
            # own session = own process group: stop() signals SGLang's children with it
            try:
                self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as exc:
                raise LaunchError(f"cannot start the {self.config.role} server "
                                  f"({shlex.join(self.command)}): {exc}") from exc

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    async def wait_healthy(self, timeout_s: float, interval_s: float = 1.0) -> None:
        """Poll `/health` until 200; fail at once if the process exits, or after `timeout_s`."""
        from thinkahead.models.http import HttpClient, ModelServerError

        client = HttpClient(self.url, timeout_s=5.0, max_retries=0)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                code = self.exit_code()
                if code is not None:
                    raise LaunchError(f"{self.config.role} server exited with code {code} before it was healthy; "
                                      f"last lines of {self.log_path}:\n{self.log_tail()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LaunchError(f"{self.config.role} server at {self.url} not healthy after {timeout_s:g} s; "
                                      f"last lines of {self.log_path}:\n{self.log_tail()}")
                try:
                    await client.wait_healthy("/health", timeout_s=min(remaining, max(interval_s, 0.05) * 4),
                                              interval_s=interval_s)
                    return
                except ModelServerError:
                    continue  # still loading: check the process again, then keep polling
        finally:
            await client.aclose()

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s`; returns the exit code."""
        proc = self.process
        if proc is None or self._stopped:
            return None if proc is None else proc.returncode
        self._stopped = True
        pgid = proc.pid  # the server leads its own session and process group (start_new_session)
        if proc.poll() is None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                proc.wait(10)
        # children that outlived the server (a group id is not reused while the group has members)
        _signal_group(pgid, signal.SIGKILL)
        return proc.returncode


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Launcher:
    """Starts every server of `configs` at once, waits until all are healthy, stops them all.

    Use as a context manager (servers stop on exit, whatever happened) or call `start`,
    `wait_healthy` and `stop`. `launcher` replaces `python -m sglang.launch_server` (tests use a
    fake); `python` is the servers' interpreter, which `probe` asks whether SUFFIX can run
    (default: `probe_suffix_plugin`).
    """

    def __init__(
        self,
        configs: Sequence[ServerConfig],
        *,
        launcher: Sequence[str] | None = None,
        log_dir: str | os.PathLike[str] = "sglang-logs",
        env: Mapping[str, str] | None = None,
        python: str | None = None,
        probe: Probe | None = None,
        echo: Callable[[str], None] = print,
    ) -> None:
        if not configs:
            raise ValueError("no servers to launch")
        ports = [c.port for c in configs]
        if len(set(ports)) != len(ports):
            raise ValueError(f"servers need distinct ports, got {ports}")
        self.configs = list(configs)
        self.python = python or sys.executable
        self.launcher = tuple(launcher) if launcher else default_launcher(self.python)
        self.log_dir = Path(log_dir)
        self.env = env
        self.probe = probe or probe_suffix_plugin
        self.echo = echo
        self.servers: list[ServerProcess] = []
        self.notes: list[str] = []

    def start(self) -> list[ServerProcess]:
        for config in self.configs:
            config, note = resolve_speculative(config, self.probe, self.python, self.env)
            if note:
                self.notes.append(note)
                self.echo(note)
            server = ServerProcess(config, server_command(config, self.launcher), server_env(config, self.env),
                                   self.log_dir / f"{config.role}.log")
            server.start()
            self.servers.append(server)
        return self.servers

    def wait_healthy(self, timeout_s: float = 1800.0, interval_s: float = 1.0) -> None:
        async def all_healthy() -> None:
            await asyncio.gather(*(s.wait_healthy(timeout_s, interval_s) for s in self.servers))

        asyncio.run(all_healthy())

    def dead(self) -> list[ServerProcess]:
        """Servers whose process has exited."""
        return [s for s in self.servers if s.exit_code() is not None]

    def stop(self, grace_s: float = 30.0) -> None:
        for server in self.servers:
            server.stop(grace_s)

    def summary(self) -> str:
        lines = []
        for s in self.servers:
            c = s.config
            lines.append(f"{c.role:<5}  {c.url}  {c.model_path}  speculative={c.algorithm}  log={s.log_path}")
        specs = {s.config.role: s.config.spec for s in self.servers}
        if set(specs) == set(TIERS):
            lines.append(f"use: --small {specs['small']} --large {specs['large']}")
        return "\n".join(lines)

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = [
    "ALGORITHMS", "LaunchError", "Launcher", "SPECULATIVE_FLAGS", "ServerConfig", "ServerProcess", "default_launcher",
    "plan_servers", "probe_suffix_plugin", "resolve_speculative", "server_command", "server_env",
]
