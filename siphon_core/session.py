"""The session settings that decide how PostgreSQL renders values as text.

The producer's walsender and every snapshot or re-read session pin the same values, so the
stream and the snapshots carry identical text whatever the database or role defaults say.
"""

PINNED_SETTINGS = {
    "DateStyle": "ISO,MDY",
    "IntervalStyle": "postgres",
    "TimeZone": "UTC",
    "extra_float_digits": "3",
    "bytea_output": "hex",
    "lc_monetary": "C",  # money
    "search_path": "pg_catalog",  # reg* types print schema-qualified names
}


def connection_options() -> str:
    """The settings as a libpq `options` value."""
    return " ".join(f"-c {name}={value}" for name, value in PINNED_SETTINGS.items())
