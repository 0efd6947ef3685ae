"""Structured log lines (logfmt: `ts=... level=... msg="..." key=value`), one event per line."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any


def _format_value(value: Any) -> str:
    text = str(value)
    if not text or any(ch in text for ch in ' ="\n\t'):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


class StructuredLogger:
    def __init__(self, name: str) -> None:
        self._logger = logging.getLogger(name)

    def _log(self, level: int, message: str, fields: dict[str, Any]) -> None:
        if self._logger.isEnabledFor(level):
            parts = [f"ts={time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime())}Z",
                     f"level={logging.getLevelName(level).lower()}", f"logger={self._logger.name}",
                     f"msg={_format_value(message)}"]
            parts += [f"{key}={_format_value(value)}" for key, value in fields.items()]
            self._logger.log(level, " ".join(parts))

    def debug(self, message: str, **fields: Any) -> None:
        self._log(logging.DEBUG, message, fields)

    def info(self, message: str, **fields: Any) -> None:
        self._log(logging.INFO, message, fields)

    def warning(self, message: str, **fields: Any) -> None:
        self._log(logging.WARNING, message, fields)

    def error(self, message: str, **fields: Any) -> None:
        self._log(logging.ERROR, message, fields)


def configure(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("siphon")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def get_logger(name: str) -> StructuredLogger:
    return StructuredLogger(f"siphon.{name}")
