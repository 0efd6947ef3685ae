"""fakesnow's server, with the result of each query kept for a bounded number of queries.

fakesnow keeps every query's result, by query id, for as long as the server runs (the connector
may fetch a result again by its id, e.g. after an asynchronous query). A streaming pipeline sends
Snowflake a few statements a second for hours, so that cache grew the server by megabytes a
minute until it held most of a small machine's memory. Results older than the last
RESULTS_KEPT queries are forgotten here; a client fetches its result right after its query.

    python -m siphon_stack.fakesnow_server -s --host 127.0.0.1 -p PORT   (fakesnow's own arguments)
"""

from __future__ import annotations

import sys
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


def main(argv: Sequence[str] | None = None) -> int:
    import fakesnow.cli

    bound_results()
    return fakesnow.cli.main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
