"""Starting, watching and stopping the processes of the local stack, by the ids we started."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# glibc gives each thread that allocates at once an arena of its own, up to 8 per core, and keeps
# what each one held at its peak. A Dagster process runs many threads (a Snowflake streaming run 16
# that apply, the daemon a pool for sensors). With two arenas the Dagster side of 500 tables to
# both targets held 2,912 - 2,943 MB against 3,153 - 3,209, at the same freshness. The image sets
# the same (deploy/Dockerfile); a value already in the environment is kept.
ALLOCATOR_ENVIRONMENT = {"MALLOC_ARENA_MAX": "2"}


def with_allocator_settings(env: dict[str, str]) -> dict[str, str]:
    """`env` for a tree of Dagster processes, with `ALLOCATOR_ENVIRONMENT` where it says nothing."""
    return {**ALLOCATOR_ENVIRONMENT, **env}


class StackError(RuntimeError):
    """A service of the local stack could not be started or reached; the message says what to do."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_accepts(port: int, host: str = "127.0.0.1") -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as gone.
    with contextlib.suppress(ChildProcessError):
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][:1] != "Z"
    except (FileNotFoundError, IndexError):
        return False


# A child meets these at their defaults whatever its starter had. An ignored disposition and a
# blocked mask outlive exec: under a shell that runs its jobs in the background SIGINT is ignored,
# Dagster then maps SIGTERM to that same "ignore" in the process it runs in, and every service
# started from there shrugged off stop_pid's SIGTERM until the SIGKILL at its timeout.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _signal_defaults(then: Callable[[], None] | None) -> Callable[[], None] | None:
    """A function for the child, run before `then`, that puts `STOP_SIGNALS` this process ignores
    back to their defaults and unblocks what it blocks; `then` when nothing needs it (a function
    run in the child keeps subprocess from its faster way to start a process)."""
    ignored = [sig for sig in STOP_SIGNALS if signal.getsignal(sig) == signal.SIG_IGN]
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    if not ignored and not blocked:
        return then

    def defaults() -> None:
        for sig in ignored:
            signal.signal(sig, signal.SIG_DFL)
        if blocked:
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
        if then is not None:
            then()

    return defaults


def start_process(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    preexec: Callable[[], None] | None = None,
    unset: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset},
            cwd=cwd,
            # Own process group: a Ctrl-C in the caller's terminal does not hit it,
            # and stopping it stops its children too.
            start_new_session=True,
            preexec_fn=_signal_defaults(preexec),
        )
    except FileNotFoundError as error:
        raise StackError(f"{name}: cannot start {argv[0]}: {error}") from None
    finally:
        log.close()


def wait_until(
    name: str,
    ready: Callable[[], bool],
    timeout: float,
    pid: int | None = None,
    log_path: Path | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if pid is not None and not pid_alive(pid):
            raise StackError(f"{name} exited during start-up{_log_tail(log_path)}")
        time.sleep(0.1)
    raise StackError(f"{name} was not ready after {timeout:.0f}s{_log_tail(log_path)}")


def _log_tail(log_path: Path | None, lines: int = 15) -> str:
    if log_path is None or not log_path.exists():
        return ""
    tail = log_path.read_text(errors="replace").splitlines()[-lines:]
    return f"; last lines of {log_path}:\n  " + "\n  ".join(tail)


# How long what is left of a group after its leader exited gets to stop before SIGKILL.
REMNANT_GRACE_SECONDS = 10.0


def stop_pid(pid: int, timeout: float = 20.0, sig: int = signal.SIGTERM) -> None:
    """Stops the process group we started (its leader is `pid`), escalating to SIGKILL. A process
    that a member started while the group shut down (a supervisor starting a child again) missed
    the signal and would outlive the leader: the group is stopped again until none is left."""
    if not pid_alive(pid):
        return
    for target in (lambda s: os.killpg(pid, s), lambda s: os.kill(pid, s)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            target(sig)
            break
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            _stop_group_members(pid, REMNANT_GRACE_SECONDS)
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`. Without /proc, whether the group
    has any process at all: [pgid] or []."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(") ", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _stop_group_members(pgid: int, grace: float) -> None:
    """SIGTERM to what is left of the group whose leader exited, SIGKILL after `grace` seconds.
    The group id stays taken while a member lives, so no other group is reached."""
    if not group_members(pgid):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not group_members(pgid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
