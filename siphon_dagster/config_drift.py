"""Whether siphon.yaml still describes the tables this code location was loaded with.

Dagster builds a code location's assets, jobs and sensors once, when it loads the code. A table
added to siphon.yaml afterwards has no asset, no snapshot and no streaming run until the location
is reloaded (the producer follows the file by itself), so the streaming sensor says so at every
tick, naming the tables, instead of leaving the new table silently unserved, and asks for the
reload itself where the code server can do it (siphon_dagster.location_reload).
"""

from __future__ import annotations

import os
from pathlib import Path

from siphon_core.config import ConfigError, SiphonConfig, load_config

RELOAD_HINT = ("reload the code location (the UI's Deployment page, Reload; or redeploy it) to serve the file "
               "as it is now")


def _shape(config: SiphonConfig) -> dict[str, object]:
    """What the definitions are built from that an operator changes while it runs."""
    return {"tables": [table.model_dump() for table in config.tables],
            "groups": config.streaming.groups,
            "targets": config.targets.configured()}


class ConfigDrift:
    def __init__(self, path: str | os.PathLike[str], loaded: SiphonConfig) -> None:
        self.path = Path(path)
        self._loaded_tables = {t.name for t in loaded.tables}
        self._loaded_shape = _shape(loaded)
        self._stamp: tuple[int, int] | None = None
        self._message: str | None = None
        # Whether the file as it is now loads, and a reload would therefore serve it.
        self.reloadable = False
        self._changes: str | None = None

    def message(self) -> str | None:
        """None while the file describes what was loaded; otherwise what differs and what to do.
        The file is read again only when its time stamp or size changed."""
        try:
            status = self.path.stat()
        except OSError as error:
            self._stamp, self.reloadable = None, False
            return f"siphon.yaml ({self.path}) cannot be read: {error.strerror}"
        stamp = (status.st_mtime_ns, status.st_size)
        if stamp != self._stamp:
            self._stamp = stamp
            self._message = self._compare()
        return self._message

    def what_changed(self) -> str | None:
        """The tables (or settings) that differ, for a file that loads; None otherwise."""
        message = self.message()
        return self._changes if message is not None and self.reloadable else None

    def _compare(self) -> str | None:
        self.reloadable, self._changes = False, None
        try:
            now = load_config(self.path)
        except ConfigError as error:
            return f"siphon.yaml changed and does not load, so a reload would fail: {error}"
        if _shape(now) == self._loaded_shape:
            return None
        tables = {t.name for t in now.tables}
        added, removed = sorted(tables - self._loaded_tables), sorted(self._loaded_tables - tables)
        what = "; ".join(part for part in (
            f"tables added: {', '.join(added)}" if added else "",
            f"tables removed: {', '.join(removed)}" if removed else "",
        ) if part) or "table, group or target settings changed"
        self.reloadable, self._changes = True, what
        return f"siphon.yaml no longer matches this code location ({what}): {RELOAD_HINT}"
