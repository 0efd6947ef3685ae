"""Messages captured from a real PostgreSQL by tests/fixtures/capture_pgoutput.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from siphon_core.naming import parse_lsn

CAPTURES_PATH = Path(__file__).parents[2] / "fixtures" / "pgoutput_captures.json"


@dataclass(frozen=True)
class Captured:
    payload: bytes
    in_stream: bool
    data_start: int  # the XLogData header's WAL position


class Captures:
    def __init__(self, path: Path) -> None:
        self._scenarios: dict[str, Any] = json.loads(path.read_text())["scenarios"]

    def scenarios(self) -> list[str]:
        return list(self._scenarios)

    def names(self, scenario: str) -> list[str]:
        return [message["name"] for message in self._scenarios[scenario]["messages"]]

    def message(self, scenario: str, name: str) -> Captured:
        for message in self._scenarios[scenario]["messages"]:
            if message["name"] == name:
                return Captured(bytes.fromhex(message["hex"]), message["in_stream"], parse_lsn(message["data_start"]))
        raise KeyError(f"no message {name!r} in scenario {scenario!r} of {CAPTURES_PATH}")

    def all(self, scenario: str) -> list[Captured]:
        return [self.message(scenario, name) for name in self.names(scenario)]

    def facts(self, scenario: str) -> dict[str, Any]:
        return self._scenarios[scenario]["facts"]


@pytest.fixture(scope="session")
def captures() -> Captures:
    return Captures(CAPTURES_PATH)
