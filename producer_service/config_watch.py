"""Changes to the table list of siphon.yaml, picked up while the producer streams.

Adding or removing a table is the one change the producer applies without a restart: the
publication is altered on the control connection and pgoutput follows it from that commit on
(a table's changes before it joined are what its snapshot loads). Every other section is read at
start only; a change to one of them is reported once, with the keys that changed.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from siphon_core.config import ConfigError, SiphonConfig, load_config
from siphon_core.logs import get_logger

log = get_logger("producer")


@dataclass
class TableListChange:
    """The configuration now in force and how its table list differs from the one before."""

    config: SiphonConfig
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


class ConfigWatcher:
    """Reads the file again when its modification time or size changed (and on `request_check`),
    and reports a changed table list once the new file loads and validates."""

    def __init__(self, path: str | os.PathLike[str], current: SiphonConfig) -> None:
        self.path = Path(path)
        self.current = current
        # Nothing read yet: the first poll compares the file with the configuration in force, which
        # may have been loaded from an earlier version of it.
        self._stamp: tuple[int, int] | None = None
        self._digest: str | None = None
        self._forced = False

    def request_check(self) -> None:
        """Read the file at the next `poll`, whatever its time stamp (SIGHUP)."""
        self._forced = True

    def poll(self) -> TableListChange | None:
        stamp = self._file_stamp()
        if stamp == self._stamp and not self._forced:
            return None
        self._stamp, self._forced = stamp, False
        digest = self._read_digest()
        if digest is None or digest == self._digest:
            return None
        self._digest = digest
        try:
            new = load_config(self.path)
        except ConfigError as error:
            log.error("siphon.yaml changed but does not load; streaming goes on with the tables before the change",
                      path=str(self.path), error=str(error))
            return None
        ignored = [key for key in _SECTIONS_READ_AT_START if _section(new, key) != _section(self.current, key)]
        if ignored:
            log.warning("siphon.yaml changed sections the producer reads at start only: restart it to apply them",
                        path=str(self.path), sections=",".join(ignored))
        before = {t.name: t for t in self.current.tables}
        after = {t.name: t for t in new.tables}
        changed_exclusions = sorted(name for name in before.keys() & after.keys()
                                    if before[name].exclude_columns != after[name].exclude_columns)
        if changed_exclusions:
            log.warning("exclude_columns changed for tables already streaming: restart the producer to apply it",
                        tables=",".join(changed_exclusions))
        added = sorted(after.keys() - before.keys())
        removed = sorted(before.keys() - after.keys())
        if not added and not removed:
            return None
        # The tables already streaming keep the entries they started with until a restart.
        tables = [before.get(t.name, t) for t in new.tables]
        return TableListChange(self.current.model_copy(update={"tables": tables}), added, removed)

    def accept(self, change: TableListChange) -> None:
        self.current = change.config

    def retry_later(self) -> None:
        """The change could not be applied (e.g. a new table not created yet): read the file again
        at the next poll."""
        self._stamp = self._digest = None

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            status = self.path.stat()
        except OSError:
            return None
        return status.st_mtime_ns, status.st_size

    def _read_digest(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError as error:
            log.warning("cannot read siphon.yaml to look for table changes", path=str(self.path), error=str(error))
            return None


# Everything but `tables` (and the Dagster side's own sections, which the producer does not use).
_SECTIONS_READ_AT_START = ("application_identifier", "source", "queue", "producer")


def _section(config: SiphonConfig, key: str) -> object:
    value = getattr(config, key)
    return value.model_dump() if hasattr(value, "model_dump") else value

