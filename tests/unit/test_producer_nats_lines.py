"""The producer's lines for nats-py's reconnect errors: one per new error, the same one again at
most every 30 s, counting what it left out."""

from __future__ import annotations

import logging

import pytest

from producer_service import cli


class Recorder:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, message: str, **fields: object) -> None:
        self.lines.append((message, fields))


def record(error: BaseException) -> logging.LogRecord:
    return logging.LogRecord("nats.aio.client", logging.ERROR, __file__, 1, "nats: encountered error", None,
                             (type(error), error, None))


def test_repeated_reconnect_errors_become_one_line_per_error_and_window(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder, now = Recorder(), [100.0]
    monkeypatch.setattr(cli, "log", recorder)
    monkeypatch.setattr(cli.time, "monotonic", lambda: now[0])
    handler = cli._NatsClientLines()
    refused = ConnectionRefusedError(111, "Connect call failed")
    for _ in range(60):  # 30 s of attempts, two a second
        handler.emit(record(refused))
        now[0] += 0.5
    handler.emit(record(refused))  # 30 s after the first line
    handler.emit(record(TimeoutError("nats: timeout")))  # a new error is logged at once
    assert [(message, fields.get("error"), fields.get("repeated_since_last_line"))
            for message, fields in recorder.lines] == [
        ("nats: encountered error", repr(refused), None),
        ("nats: encountered error", repr(refused), 59),
        ("nats: encountered error", repr(TimeoutError("nats: timeout")), None),
    ]
