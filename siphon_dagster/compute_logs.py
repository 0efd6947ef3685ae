"""Runs' stdout and stderr, kept for the UI without a mirror process per stream.

Dagster's `LocalComputeLogManager` writes a run's output to files the UI reads, and mirrors each
stream back to the terminal through a `tail -F` process and a watcher that ends it: four processes
per run beside the run itself. A streaming run lives for days behind a daemon whose terminal no
one reads, so this manager keeps the files (the UI shows them as before) and starts nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

from dagster._config import Field, StringSource
from dagster._core.execution.compute_logs import redirect_to_file
from dagster._core.storage.compute_log_manager import CapturedLogContext, ComputeIOType
from dagster._core.storage.local_compute_log_manager import IO_TYPE_EXTENSION, LocalComputeLogManager
from dagster._serdes import ConfigurableClassData
from dagster._utils import ensure_file, touch_file


class FileComputeLogManager(LocalComputeLogManager):
    """`LocalComputeLogManager` without the terminal mirror. `base_dir` defaults to the instance's
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
        ensure_file(outpath)
        ensure_file(errpath)
        with redirect_to_file(sys.stdout, outpath), redirect_to_file(sys.stderr, errpath):
            yield CapturedLogContext(log_key)
        touch_file(self.complete_artifact_path(log_key))
