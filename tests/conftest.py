"""Shared fixtures: the real local stack, started once per test session, and per-test isolation."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def stack_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Every service of `siphon-stack` on free loopback ports; stopped by the pids we started.

    SIPHON_TEST_STACK_DIR reuses a stack a developer already started (it is then left running).
    """
    from siphon_stack import stack

    existing = os.environ.get("SIPHON_TEST_STACK_DIR")
    if existing:
        yield stack.status(Path(existing)).environment
        return
    directory = tmp_path_factory.mktemp("stack")
    state = stack.up(directory, with_snowflake=True)
    try:
        yield state.environment
    finally:
        stack.down(directory)


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A short identifier unique to this test, usable as a schema, slot, stream or database name."""
    base = "".join(ch if ch.isalnum() else "_" for ch in request.node.name.lower())[:24].strip("_")
    return f"t_{base}_{uuid.uuid4().hex[:8]}"
