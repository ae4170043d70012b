"""Run a model-written Python program, then its tests, in a sandbox (what `CodeChecker` uses).

`run_sandboxed(program, tests, timeout_s=..., limits=SandboxLimits())` runs `sandbox_child.py` as
a script (`python -I`, the *supervisor*), which forks an *init* process, which forks the *worker*
(that module's docstring has the details). The worker reads the program, the tests and a random
per-run token from its stdin (the parent writes them there: the token is in no argv, environment
or file), replaces stdin with /dev/null, compiles both, then runs the program and the tests in one
fresh `__main__` of one interpreter; only when the tests return does it write the token to fd 3
and `os._exit(0)`. A run passes when the token came back, the exit status is 0 and the timeout was
not hit. `SandboxResult.isolation` names the layers in force: "pid", "net", "ipc", "uts", "mount"
(or "mount-partial"), "uid" (a dedicated uid, as root) or "userns" (not root).

What it stops on Linux (measured on the project's machines, which run as root with every
namespace allowed, and as uid 1000 through a user namespace; `tests/test_sandbox.py` tries each):
- Ending early with status 0 (`sys.exit(0)`, `raise SystemExit`, `os._exit(0)`, `os.execv` of
  `true`, exit 0 from inside a tested function): no token, no pass. The tests are compiled apart
  from the program, so a program cannot swallow them into an unterminated string either.
- Replacing what runs the tests: the harness binds `exec`, `os.write`, `os._exit`, the exception
  classes and `sys.settrace`/`sys.setprofile` before the program runs, clears any trace or profile
  hook the program set before the tests start, and runs the tests with a copy of the builtins taken
  before the program ran. So `builtins.exec = lambda *a, **k: None` (the tests never run),
  replacing `compile`, `AssertionError`, `SystemExit`, `sys.exit` or `os._exit`, patching a
  builtin the tests call (`builtins.all = lambda *a: True`) or a trace hook that jumps over test
  lines do not pass; nor does printing a success marker (the token is not printed, it is written
  to a pipe).
- Network: the worker is in a new network namespace (a loopback that is down): every connect,
  127.0.0.1 included, fails. Unix sockets in /tmp, /var/tmp and /run (D-Bus, X11) are hidden.
- Stray processes: the worker is pid 2 of a new PID namespace whose pid 1 is init; when the worker
  exits or the timeout hits, init exits and the kernel kills every process left in the namespace
  (setsid and double fork included) before the run returns.
- Resources (setrlimit in the worker, inherited by its children, soft = hard): address space
  (`SandboxLimits.memory_bytes`: a 20 GB allocation raises MemoryError), CPU seconds, processes
  and threads (RLIMIT_NPROC: a fork bomb stops there), open files, file size. The supervisor
  enforces the wall-clock timeout; the parent kills the supervisor if it does not answer.
- Privileges and writes: as root, the worker runs under a uid of its own
  (`sandbox_child.UID_BASE` + the supervisor's pid: concurrent runs do not share an RLIMIT_NPROC
  count, and root's exemption from it does not apply), with no capabilities and `no_new_privs`.
  Not as root, it runs in a new user namespace with every capability dropped. In a private mount
  namespace every mount is remounted read-only; the working directory (a fresh temp dir, also HOME
  and TMPDIR) is a tmpfs of `disk_bytes`, /dev/shm a private tmpfs, /tmp, /var/tmp and /run are
  empty, /proc shows only the sandbox's processes. Nothing outside the working directory can be
  written and nothing written reaches the disk. Where a directory on the way to the Python
  installation is closed to other users (/root here), the sandbox sees a read-only tmpfs there
  that holds only the installation.

What it does not stop:
- A program that attacks this harness on purpose, knowing how it works: the program and the tests
  share an interpreter (they must: the tests call the program's functions), so whatever the harness
  holds the program can reach. It can read the token from the harness's frame (`sys._getframe`,
  `sys._current_frames`, `gc.get_objects`, ctypes) and write it to fd 3 itself; patch the modules
  the tests import (`math.isclose = ...`) or, from a function the tests call, the tests' own copy
  of the builtins (`globals()["__builtins__"]`) or a trace hook on the tests' frame; or return
  objects whose `__eq__` is always True. It stops accidental and naive exits and the cheap, generic
  replacements above, not an adversary that targets this grader (run code that is hostile by
  design in a VM, and compare its outputs with the expected ones outside it).
- Reading files its uid may read (world-readable ones; not as root, the user's own), though it
  cannot send them anywhere; a Unix socket other users may write to outside the hidden directories.
- Kernel exploits and side channels; memory in its tmpfs counts against the machine (bounded by
  `disk_bytes`), not against RLIMIT_AS.
Where the kernel refuses namespaces (a container without CAP_SYS_ADMIN, unprivileged user
namespaces off; `isolate=False` forces it), the parent logs a warning once per missing layer and
falls back to the limits alone: the supervisor is a child subreaper and kills init's process group
and every descendant (found through /proc) when the run ends, so setsid grandchildren still die;
but the network and every path the uid may write are open, RLIMIT_NPROC counts all the user's
processes, and root without a dedicated uid (its Python installation closed to other users, as
here) has no process bound at all. Off Linux only the limits and the process group kill apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import json
import logging
import math
import os
import signal
import sys

__all__ = ["DEFAULT_STDERR_CHARS", "DEFAULT_TIMEOUT_S", "SandboxLimits", "SandboxResult", "run_sandboxed"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
"""Wall-clock seconds a program and its tests may take."""
DEFAULT_STDERR_CHARS = 2000
"""How much of the end of the program's stderr a result keeps."""
SUPERVISOR_GRACE_S = 10.0
"""The parent kills the supervisor when it has not answered this long after the timeout."""
WORKDIR_PREFIX = "thinkahead-code-"
_LINUX = sys.platform.startswith("linux")
_WARNED: set[str] = set()


@dataclass(slots=True, frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run (each a positive int)."""

    memory_bytes: int = 2 << 30
    """RLIMIT_AS of every process: address space, so an over-large allocation raises MemoryError."""
    processes: int = 64
    """RLIMIT_NPROC: processes and threads of the sandbox's uid (bounds fork bombs)."""
    open_files: int = 256
    """RLIMIT_NOFILE."""
    file_bytes: int = 16 << 20
    """RLIMIT_FSIZE: the largest file a process may write."""
    disk_bytes: int = 64 << 20
    """Size of the tmpfs working directory (and of the private /dev/shm) when mount namespaces work."""
    cpu_s: int | None = None
    """RLIMIT_CPU in seconds; None: the timeout rounded up, plus one."""

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "processes", "open_files", "file_bytes", "disk_bytes", "cpu_s"):
            value = getattr(self, name)
            if value is None and name == "cpu_s":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive int, got {value!r}")

    def cpu_limit(self, timeout_s: float) -> int:
        """RLIMIT_CPU for a run with this timeout."""
        return self.cpu_s if self.cpu_s is not None else math.ceil(timeout_s) + 1

    def rlimits(self, timeout_s: float) -> dict[str, int]:
        """The `resource.RLIMIT_*` names and values the worker sets (no core dumps)."""
        return {"RLIMIT_AS": self.memory_bytes, "RLIMIT_CPU": self.cpu_limit(timeout_s),
                "RLIMIT_NPROC": self.processes, "RLIMIT_NOFILE": self.open_files, "RLIMIT_FSIZE": self.file_bytes,
                "RLIMIT_CORE": 0}


@dataclass(slots=True, frozen=True)
class SandboxResult:
    """How a sandboxed run ended. `isolation` names the layers that were in force: as the sandbox's init
    reported them before the program started, so a run killed at its timeout reports them too (only
    a run killed before its setup finished reports no more than the supervisor's own "pid"/"userns")."""

    passed: bool
    returncode: int | None
    timed_out: bool
    stderr: str
    isolation: tuple[str, ...]


def run_sandboxed(program: str, tests: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, limits: SandboxLimits | None = None,
                  stderr_chars: int = DEFAULT_STDERR_CHARS, isolate: bool = True) -> SandboxResult:
    """Run `program`, then `tests`, in a sandbox; passed when the tests ran to their end in time.

    `isolate=False` skips the namespaces (the fallback where the kernel refuses them).
    """
    import secrets
    import subprocess
    import tempfile

    for value, what in ((program, "program"), (tests, "tests")):
        if not isinstance(value, str):
            raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
    if isinstance(stderr_chars, bool) or not isinstance(stderr_chars, int) or stderr_chars < 0:
        raise ValueError(f"stderr_chars must be a non-negative int, got {stderr_chars!r}")
    if os.name != "posix":
        raise NotImplementedError("the code sandbox needs a POSIX system (fork, setrlimit)")
    limits = SandboxLimits() if limits is None else limits
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix=WORKDIR_PREFIX) as tmp:
        workdir = os.path.realpath(tmp)
        config = {"workdir": workdir, "timeout_s": float(timeout_s), "rlimits": limits.rlimits(timeout_s),
                  "disk_bytes": limits.disk_bytes, "stderr_bytes": 4 * stderr_chars, "isolate": bool(isolate)}
        proc = subprocess.Popen(
            [sys.executable, "-I", str(Path(__file__).with_name("sandbox_child.py")), json.dumps(config)],
            cwd=workdir, env={"PATH": os.environ.get("PATH", os.defpath), "HOME": workdir, "TMPDIR": workdir},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )
        request = json.dumps({"token": token, "program": program, "tests": tests}).encode()
        backstop = False
        try:
            out, err = proc.communicate(request, timeout=timeout_s + SUPERVISOR_GRACE_S)
        except subprocess.TimeoutExpired:  # the supervisor hangs (a bug): kill it, and init dies with it
            backstop = True
            _killpg(proc.pid)  # not reaped yet, so the group id is still the supervisor's
            try:
                out, err = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                out, err = b"", b""
    try:
        report = json.loads(out)
    except ValueError:  # the supervisor died or was killed: its own stderr says why
        report = {"returncode": None if backstop else proc.returncode, "timed_out": backstop, "result": "",
                  "stderr": "", "isolation": [], "isolation_known": False, "notes": []}
    tail = (report["stderr"] + err.decode("utf-8", errors="replace"))[-stderr_chars:] if stderr_chars else ""
    isolation = tuple(report["isolation"])
    if isolate:  # a layer is called missing only when the sandbox's setup reported what it made
        _warn_once(isolation if report["isolation_known"] else None, report.get("notes", []))
    passed = not report["timed_out"] and report["returncode"] == 0 and report["result"] == token
    return SandboxResult(passed, report["returncode"], bool(report["timed_out"]), tail, isolation)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_MISSING = {
    "pid": "no PID namespace: stray processes are found through /proc and killed",
    "net": "no network namespace: programs have network access",
    "mount": "no mount namespace: programs can write wherever their uid may",
    "bound": "no uid or user namespace of its own: RLIMIT_NPROC counts all this user's processes (as root: none)",
}
"""What each isolation layer's absence means, as the warning says it."""


def _warn_once(isolation: tuple[str, ...] | None, notes: list[str]) -> None:
    """Log once per process each layer the kernel refused here (None: not known, none), and each note of the child."""
    missing = []
    if isolation is not None:
        have = set(isolation) | ({"bound"} if {"uid", "userns"} & set(isolation) or not _LINUX else set())
        missing = [text for layer, text in _MISSING.items() if layer not in have]
    for what in missing + notes:
        if what not in _WARNED:
            _WARNED.add(what)
            log.warning("code sandbox: %s; falling back to resource limits (see thinkahead.verifiers.sandbox)", what)
