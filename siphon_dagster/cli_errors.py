"""How `siphon-dagster` answers a service it cannot reach or a login it is refused: one line that
names the service, never a traceback. The errors caught here already name their table, URL or
address without credentials (siphon_core.redaction); the libraries' own noise is turned down."""

from __future__ import annotations

import logging
import warnings

import dagster as dg
import psycopg

from siphon_core.queue import QueueError
from siphon_dagster.source import SourceError
from siphon_dagster.targets.base import TargetError

# Failures of a service or of what it holds, each with a message fit for an operator.
SERVICE_ERRORS = (SourceError, TargetError, QueueError, psycopg.Error)


def one_line(error: BaseException) -> str:
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    # psycopg names the host and port it tried, not the service.
    return f"PostgreSQL: {text}" if isinstance(error, psycopg.Error) else text


def quiet_libraries() -> None:
    """Dagster's notices about its beta APIs, and the tracebacks nats-py and clickhouse-connect log
    for each failed attempt, say nothing the command's own line does not."""
    for category in (dg.BetaWarning, dg.PreviewWarning, dg.SupersessionWarning):
        warnings.filterwarnings("ignore", category=category)
    for name in ("nats", "clickhouse_connect"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
