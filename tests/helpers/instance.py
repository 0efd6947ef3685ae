"""A temporary Dagster instance that keeps runs' output as the project's `dagster.yaml` does.

Dagster's default compute log manager mirrors each captured stream through a `tail -F` process
and a watcher, and a capture's end waits up to 30 s for each to stop. A test process whose SIGTERM
is ignored when one starts (Dagster points SIGTERM at SIGINT's handler, and a test run started in
the background of a shell has SIGINT ignored) hands that on to the `tail`, which then outlives the
test and holds up its run for a minute.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
import yaml


def _compute_logs(root: str) -> dict[str, Any]:
    return {"module": "siphon_dagster.compute_logs", "class": "FileComputeLogManager",
            "config": {"base_dir": os.path.join(root, "storage")}}


def write_instance_yaml(home: Path) -> None:
    """A `dagster.yaml` in `home` (a test's DAGSTER_HOME, for the CLI or `DagsterInstance.get`)
    that keeps runs' output the same way, and sends no telemetry."""
    settings = {"telemetry": {"enabled": False}, "compute_logs": _compute_logs(str(home))}
    (home / "dagster.yaml").write_text(yaml.safe_dump(settings))


@contextmanager
def instance_for_test(overrides: dict[str, Any] | None = None, temp_dir: str | None = None) -> Iterator[dg.DagsterInstance]:
    """`dagster.instance_for_test`, with runs' output kept by `FileComputeLogManager` under the
    instance's storage directory unless `overrides` names a compute log manager."""
    with ExitStack() as stack:
        root = temp_dir or stack.enter_context(tempfile.TemporaryDirectory())
        settings = {"compute_logs": _compute_logs(root), **(overrides or {})}
        yield stack.enter_context(dg.instance_for_test(overrides=settings, temp_dir=root))
