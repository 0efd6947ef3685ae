"""Runs' stdout and stderr, kept for the UI and still shown where the run was started, without a
mirror process per stream.

Dagster's `LocalComputeLogManager` writes a run's output to files the UI reads, and mirrors each
stream back to the terminal through a `tail -F` process and a watcher that ends it: four processes
per run beside the run itself, for a streaming run that lives for days. This manager points the
stream's file descriptor at a pipe and copies what arrives to both the file and the original
descriptor on a thread of the run's own process: the same files for the UI, the same lines in
`dagster dev`'s or `dagster asset materialize`'s terminal, no process.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import IO, Any

from dagster._config import Field, StringSource
from dagster._core.execution.compute_logs import redirect_to_file
from dagster._core.storage.compute_log_manager import CapturedLogContext, ComputeIOType
from dagster._core.storage.local_compute_log_manager import IO_TYPE_EXTENSION, LocalComputeLogManager
from dagster._serdes import ConfigurableClassData
from dagster._utils import ensure_file, touch_file

# How long the end of a capture waits for the copy to drain: a child process started during the
# capture (and still running) keeps the pipe open, and its later output is copied as it comes.
_DRAIN_SECONDS = 5.0
_CHUNK = 65536


class FileComputeLogManager(LocalComputeLogManager):
    """`LocalComputeLogManager` with an in-process mirror. `base_dir` defaults to the instance's
    storage directory (`$DAGSTER_HOME/storage`), where Dagster keeps them by default."""

    @classmethod
    def config_type(cls) -> dict[str, Any]:
        return {**super().config_type(), "base_dir": Field(StringSource, is_required=False)}

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData | None, config_value: Any) -> FileComputeLogManager:
        values = dict(config_value)
        if "base_dir" not in values:
            home = os.environ.get("DAGSTER_HOME")
            if not home:
                raise ValueError("compute_logs: set base_dir, or DAGSTER_HOME, for FileComputeLogManager's files")
            values["base_dir"] = os.path.join(home, "storage")
        return cls(inst_data=inst_data, **values)

    @contextmanager
    def capture_logs(self, log_key: Sequence[str]) -> Generator[CapturedLogContext, None, None]:
        outpath = self.get_captured_local_path(log_key, IO_TYPE_EXTENSION[ComputeIOType.STDOUT])
        errpath = self.get_captured_local_path(log_key, IO_TYPE_EXTENSION[ComputeIOType.STDERR])
        with mirrored_to_file(sys.stdout, outpath), mirrored_to_file(sys.stderr, errpath):
            yield CapturedLogContext(log_key)
        touch_file(self.complete_artifact_path(log_key))


def _fileno(stream: IO[Any]) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


@contextmanager
def mirrored_to_file(stream: IO[Any], path: str) -> Generator[None, None, None]:
    """Everything written to `stream`'s descriptor while inside, by Python or native code or child
    processes, goes to `path` and, as before, to where the descriptor pointed."""
    ensure_file(path)
    fd = _fileno(stream)
    if fd is None:  # a stream without a descriptor (a test runner's): only Python's writes are seen
        with redirect_to_file(stream, path):
            yield
        return
    stream.flush()
    restore = os.dup(fd)
    mirror = os.dup(fd)
    read_end, write_end = os.pipe()
    copier = threading.Thread(target=_copy, args=(read_end, path, mirror), daemon=True,
                              name=f"siphon-log-mirror-{fd}")
    copier.start()
    os.dup2(write_end, fd)
    os.close(write_end)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            stream.flush()
        os.dup2(restore, fd)  # the pipe's last writer in this process goes: the copier sees its end
        os.close(restore)
        copier.join(_DRAIN_SECONDS)


def _copy(read_end: int, path: str, mirror: int) -> None:
    """Copies the pipe to the file and to the original descriptor until every writer is gone. The
    file comes first: the UI's copy is kept even when the terminal has gone away."""
    mirroring = True
    try:
        with open(path, "ab", buffering=0) as file:
            while chunk := os.read(read_end, _CHUNK):
                file.write(chunk)
                if mirroring:
                    try:
                        _write_all(mirror, chunk)
                    except OSError:
                        mirroring = False
    finally:
        os.close(read_end)
        os.close(mirror)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
