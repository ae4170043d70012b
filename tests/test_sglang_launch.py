"""`thinkahead launch` and `thinkahead.serving.sglang_launcher`: server plans and fake server processes.

Command lines per speculative algorithm, bad plans, the SUFFIX plugin's environment and its NGRAM
fallback, and the launcher starting, health-waiting and stopping `tests/fake_sglang.py` run as
`sglang.launch_server` in real subprocesses (crash while loading, never healthy, missing
launcher, SIGTERM to the CLI, `--dry-run`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.sglang_fixtures import FAKE_SCRIPT, ROOT

# -- thinkahead launch -----------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_command_lines_per_algorithm() -> None:
    from thinkahead.serving.sglang_launcher import SPECULATIVE_FLAGS, plan_servers, server_command

    small, large = plan_servers("Qwen/Qwen2.5-1.5B-Instruct", "Qwen/QwQ-32B", speculative=("NGRAM", "EAGLE3"),
                                draft_models=(None, "org/eagle3-qwq"), tp_sizes=(1, 2),
                                extra_args=((), ("--max-running-requests", "64")))
    launcher = ("py", "-m", "sglang.launch_server")
    assert server_command(small, launcher) == [
        "py", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen2.5-1.5B-Instruct", "--host", "127.0.0.1",
        "--port", "30000", "--tp-size", "1", "--mem-fraction-static", "0.25", "--speculative-algorithm", "NGRAM",
        "--speculative-num-draft-tokens", "12", "--speculative-ngram-max-trie-depth", "18",
        "--speculative-ngram-max-bfs-breadth", "10"]
    assert server_command(large, launcher) == [
        "py", "-m", "sglang.launch_server", "--model-path", "Qwen/QwQ-32B", "--host", "127.0.0.1", "--port", "30001",
        "--tp-size", "2", "--mem-fraction-static", "0.6", "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", "org/eagle3-qwq", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16", "--max-running-requests", "64"]
    assert large.spec == "sglang:large@http://127.0.0.1:30001"
    # separate GPUs: SGLang's own memory default; plain decoding: no speculative flags
    s, l = plan_servers("a", "b", gpus=("0", "1"), speculative=(None, "standalone"), draft_models=(None, "c"))
    assert "--mem-fraction-static" not in server_command(s) and "--speculative-algorithm" not in server_command(s)
    assert server_command(l)[-9:] == ["STANDALONE", "--speculative-draft-model-path", "c",
                                      *SPECULATIVE_FLAGS["STANDALONE"]]
    assert server_command(s)[:3] == [sys.executable, "-m", "sglang.launch_server"]
    shared = plan_servers("a", "b", gpus=("0,1", "1"))
    assert [c.mem_fraction_static for c in shared] == [0.25, 0.6]


@pytest.mark.parametrize("kwargs,match", [
    ({"speculative": (None, "EAGLE")}, "needs a draft model"),
    ({"speculative": ("NGRAM", None), "draft_models": ("d", None)}, "draft model is used only"),
    ({"speculative": ("MEDUSA", None)}, "must be one of"),
    ({"ports": (30000, 30000)}, "different ports"),
    ({"mem_fractions": (1.5, None)}, "mem_fraction_static"),
    ({"tp_sizes": (0, 1)}, "tp_size"),
])
def test_bad_server_plans(kwargs: dict[str, Any], match: str) -> None:
    from thinkahead.serving.sglang_launcher import plan_servers

    with pytest.raises(ValueError, match=match):
        plan_servers("a", "b", **kwargs)


def test_suffix_environment_and_fallback() -> None:
    from thinkahead.serving.sglang_launcher import SPECULATIVE_FLAGS, ServerConfig, resolve_speculative, server_command, server_env

    cfg = ServerConfig("large", "m", 30001, speculative="SUFFIX", gpus="1", env={"THINKAHEAD_SUFFIX_MAX_DEPTH": "32"})
    env = server_env(cfg, {"SGLANG_PLUGINS": "other", "PATH": "/bin"})
    assert env == {"SGLANG_PLUGINS": "other,thinkahead_suffix", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1",
                   "THINKAHEAD_SUFFIX_MAX_DEPTH": "32"}
    assert "SGLANG_PLUGINS" not in server_env(cfg, {})  # no whitelist: every plugin loads
    asked = []
    kept, note = resolve_speculative(cfg, lambda py, env: (asked.append(py) or True, "SGLang 0.5.23"), "py")
    assert kept is cfg and note is None and asked == ["py"]
    fallback, note = resolve_speculative(cfg, lambda py, env: (False, "sglang is not installed"), "py")
    assert fallback.algorithm == "NGRAM" and "SUFFIX plugin unavailable (sglang is not installed)" in note
    assert server_command(fallback)[-6:] == list(SPECULATIVE_FLAGS["NGRAM"])


def test_launcher_starts_waits_and_stops_fake_servers(tmp_path: Path) -> None:
    from thinkahead.serving.sglang_launcher import Launcher, plan_servers, server_command

    ports = free_ports(2)
    env = dict(os.environ, FAKE_SGLANG_RECORD_DIR=str(tmp_path), FAKE_SGLANG_STARTUP_S="0.5", FAKE_SGLANG_CHILD="1")
    configs = plan_servers("fake/small", "fake/large", ports=(ports[0], ports[1]), speculative=("NGRAM", "SUFFIX"))
    probe_calls = []
    runner = Launcher(configs, launcher=(sys.executable, FAKE_SCRIPT), log_dir=tmp_path / "logs", env=env,
                      probe=lambda py, e: (probe_calls.append(e.get("FAKE_SGLANG_CHILD")) or True, "ok"),
                      echo=lambda s: None)
    with runner:
        runner.start()
        runner.wait_healthy(timeout_s=20, interval_s=0.05)
        for config in configs:
            assert httpx.get(config.url + "/health").status_code == 200
            assert httpx.get(config.url + "/model_info").json()["model_path"] == config.model_path
        records = {p: json.loads((tmp_path / f"{p}.json").read_text()) for p in ports}
        for config in configs:
            rec = records[config.port]
            assert rec["argv"] == server_command(config, (sys.executable, FAKE_SCRIPT))[2:]
            assert rec["pgid"] == rec["pid"]  # its own process group
        children = [int((tmp_path / f"{p}.child").read_text()) for p in ports]
        assert "sglang:small@" in runner.summary() and "--large sglang:large@" in runner.summary()
        assert probe_calls == ["1"]  # asked once, for the SUFFIX server, in the servers' environment
    for p in ports:
        assert not alive(records[p]["pid"])
    for pid in children:
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)
    assert "fake sglang: stopped" in (tmp_path / "logs" / "small.log").read_text()  # a clean SIGTERM exit


def test_launcher_reports_a_server_that_dies_while_loading(tmp_path: Path) -> None:
    from thinkahead.serving.sglang_launcher import Launcher, LaunchError, ServerConfig

    port = free_ports(1)[0]
    runner = Launcher([ServerConfig("small", "fake/small", port)], launcher=(sys.executable, FAKE_SCRIPT),
                      log_dir=tmp_path, env=dict(os.environ, FAKE_SGLANG_EXIT_CODE="3"), echo=lambda s: None)
    with runner, pytest.raises(LaunchError, match=r"(?s)exited with code 3.*failing on purpose while loading"):
        runner.start()
        runner.wait_healthy(timeout_s=20, interval_s=0.05)


def test_launcher_times_out_on_a_server_that_never_gets_healthy(tmp_path: Path) -> None:
    from thinkahead.serving.sglang_launcher import Launcher, LaunchError, ServerConfig

    port = free_ports(1)[0]
    runner = Launcher([ServerConfig("large", "fake/large", port)], launcher=(sys.executable, FAKE_SCRIPT),
                      log_dir=tmp_path, env=dict(os.environ, FAKE_SGLANG_STARTUP_S="60"), echo=lambda s: None)
    with runner:
        runner.start()
        with pytest.raises(LaunchError, match="not healthy after 0.5 s"):
            runner.wait_healthy(timeout_s=0.5, interval_s=0.05)
        pid = runner.servers[0].process.pid
    assert not alive(pid)


def test_launcher_reports_a_missing_launcher(tmp_path: Path) -> None:
    from thinkahead.serving.sglang_launcher import Launcher, LaunchError, ServerConfig

    runner = Launcher([ServerConfig("small", "m", free_ports(1)[0])], launcher=(str(tmp_path / "no-such-python"),),
                      log_dir=tmp_path, echo=lambda s: None)
    with runner, pytest.raises(LaunchError, match="cannot start the small server"):
        runner.start()


def test_launch_command_prints_urls_and_stops_on_sigterm(tmp_path: Path) -> None:
    ports = free_ports(2)
    env = dict(os.environ, FAKE_SGLANG_RECORD_DIR=str(tmp_path), FAKE_SGLANG_STARTUP_S="0.3")
    cmd = [sys.executable, "-c", "from thinkahead.cli.launch import launch; launch()",
           "--small", "fake/small", "--large", "fake/large", "--small-port", str(ports[0]),
           "--large-port", str(ports[1]), "--large-spec", "suffix", "--launcher", f"{sys.executable} {FAKE_SCRIPT}",
           "--log-dir", str(tmp_path / "logs"),
           "--timeout", "30"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("use: "):
                break
        assert lines and lines[-1] == (f"use: --small sglang:small@http://127.0.0.1:{ports[0]} "
                                       f"--large sglang:large@http://127.0.0.1:{ports[1]}\n"), lines
        for port in ports:
            assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "SUFFIX plugin unavailable (sglang is not installed in this environment); falling back to NGRAM" in err
    assert "stopping the servers" in err and err.rstrip().endswith("stopped")
    records = [json.loads((tmp_path / f"{p}.json").read_text()) for p in ports]
    assert records[1]["argv"][records[1]["argv"].index("--speculative-algorithm") + 1] == "NGRAM"
    assert not any(alive(r["pid"]) for r in records)


def test_launch_dry_run_prints_command_lines() -> None:
    from click.testing import CliRunner

    from thinkahead.cli.launch import launch

    result = CliRunner().invoke(launch, ["--small", "s", "--large", "l", "--large-spec", "eagle", "--large-draft", "d",
                                         "--large-arg", "--max-running-requests 8", "--python", "/opt/py", "--dry-run"])
    assert result.exit_code == 0, result.output
    small_line, large_line = result.output.strip().splitlines()
    assert small_line.startswith("/opt/py -m sglang.launch_server --model-path s ")
    assert large_line.endswith("--speculative-num-draft-tokens 16 --max-running-requests 8")
    bad = CliRunner().invoke(launch, ["--small", "s", "--large", "l", "--large-spec", "eagle", "--dry-run"])
    assert bad.exit_code == 2 and "needs a draft model" in bad.output
