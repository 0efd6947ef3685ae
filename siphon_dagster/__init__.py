"""The Dagster code location of Siphon: `SIPHON_CONFIG=siphon.yaml dagster dev`.

`defs` is built on first access (module `__getattr__`), so importing a part of this package, in
a test or a Spark worker, does not need an application configuration.
"""

from __future__ import annotations

from typing import Any

_loaded: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    if name != "defs":
        raise AttributeError(f"module 'siphon_dagster' has no attribute {name!r}")
    if "defs" not in _loaded:
        from siphon_dagster.definitions import load_definitions

        _loaded["defs"] = load_definitions()
    return _loaded["defs"]


def __dir__() -> list[str]:
    return sorted([*globals(), "defs"])
