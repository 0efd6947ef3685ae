"""fakesnow's server, with the result of each query kept for a bounded number of queries, and the
statements that change one table's rows run one at a time.

fakesnow keeps every query's result, by query id, for as long as the server runs (the connector
may fetch a result again by its id, e.g. after an asynchronous query). A streaming pipeline sends
Snowflake a few statements a second for hours, so that cache grew the server by megabytes a
minute until it held most of a small machine's memory. Results older than the last
RESULTS_KEPT queries are forgotten here; a client fetches its result right after its query.

Snowflake runs the UPDATE, DELETE and MERGE statements of one table one at a time. fakesnow runs a
MERGE as several statements: it chooses the rows to change, then updates them, with no second look
at the version guard. A MERGE of the same table by another session in between was overwritten:
in the demo, a snapshot's MERGE wrote a range's rows over a row the stream had just made newer.
Here each such statement holds its table's lock (`TableWriteLocks`).

    python -m siphon_stack.fakesnow_server -s --host 127.0.0.1 -p PORT   (fakesnow's own arguments)
"""

from __future__ import annotations

import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

RESULTS_KEPT = 1000


class RecentResults(OrderedDict[str, Any]):
    """A dict that keeps its `limit` most recently written entries."""

    def __init__(self, limit: int = RESULTS_KEPT) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


def bound_results() -> Callable[[], None]:
    """Makes every fakesnow instance made from now on keep its results in `RecentResults`; returns
    the function that undoes it."""
    from fakesnow.instance import FakeSnow

    # The server module makes its shared instance when fakesnow's server starts (and importing that
    # module here would hide fakesnow's `server` function behind it), so the instance is given the
    # bounded dict as it is made; every session's connection shares that instance's dict.
    made = FakeSnow.__init__

    def bounded(self: FakeSnow, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        self.results_cache = RecentResults()

    FakeSnow.__init__ = bounded  # type: ignore[method-assign]

    def undo() -> None:
        FakeSnow.__init__ = made  # type: ignore[method-assign]

    return undo


# The table a statement chooses rows of and then changes: `MERGE INTO t`, `UPDATE t`, `DELETE FROM t`,
# t a name of dotted parts, each quoted ("a ""b""") or not.
_PART = r'(?:"(?:[^"]|"")*"|[^\s".()]+)'
_CHANGED_TABLE = re.compile(rf"\s*(?:MERGE\s+INTO|UPDATE|DELETE\s+FROM)\s+({_PART}(?:\s*\.\s*{_PART})*)", re.IGNORECASE)


class TableWriteLocks:
    """A lock per table that statements choose rows of and then change."""

    def __init__(self) -> None:
        self._locks: dict[tuple[str, ...], threading.Lock] = {}
        self._guard = threading.Lock()

    def lock_for(self, command: str) -> threading.Lock | None:
        """The lock of the table `command` changes, or None for any other statement."""
        match = _CHANGED_TABLE.match(command)
        if match is None:
            return None
        # Unquoted parts fold to upper case, as Snowflake folds them; quoted ones keep their spelling.
        name = tuple(part[1:-1].replace('""', '"') if part.startswith('"') else part.upper()
                     for part in re.findall(_PART, match.group(1)))
        with self._guard:
            return self._locks.setdefault(name, threading.Lock())


def serialize_table_writes() -> Callable[[], None]:
    """Makes every fakesnow cursor run a statement that changes a table's rows while holding that
    table's lock; returns the function that undoes it."""
    from fakesnow.cursor import FakeSnowflakeCursor

    run = FakeSnowflakeCursor.execute
    locks = TableWriteLocks()

    def execute(self: FakeSnowflakeCursor, command: str, *args: Any, **kwargs: Any) -> Any:
        lock = locks.lock_for(command) if isinstance(command, str) else None
        if lock is None:
            return run(self, command, *args, **kwargs)
        with lock:
            return run(self, command, *args, **kwargs)

    FakeSnowflakeCursor.execute = execute  # type: ignore[method-assign]

    def undo() -> None:
        FakeSnowflakeCursor.execute = run  # type: ignore[method-assign]

    return undo


def main(argv: Sequence[str] | None = None) -> int:
    import fakesnow.cli

    bound_results()
    serialize_table_writes()
    return fakesnow.cli.main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
