"""Addresses as they may be printed: credentials never leave in an error, a log line or the UI."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from psycopg.conninfo import conninfo_to_dict

_PRINTABLE_DSN_KEYS = ("host", "hostaddr", "port", "dbname", "user", "sslmode")


def redact_url(url: str) -> str:
    """`nats://user:secret@host:4222` -> `nats://host:4222`; a URL without credentials is unchanged,
    and text that is no URL is replaced rather than risked."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<an unreadable URL>"
    if "@" not in parts.netloc:
        return url
    netloc = (f"[{host}]" if ":" in host else host) + (f":{port}" if port else "")
    # A token may also ride in the query (?token=...): drop the query with the credentials.
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def redact_dsn(dsn: str) -> str:
    """A PostgreSQL connection string as `host=... port=... dbname=... user=...`, never its password
    (nor any other key, such as sslpassword)."""
    try:
        params = conninfo_to_dict(dsn)
    except Exception:
        return "<an unreadable connection string>"
    return " ".join(f"{key}={params[key]}" for key in _PRINTABLE_DSN_KEYS if params.get(key)) or "<defaults>"
