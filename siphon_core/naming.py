"""Every name Siphon derives from the configuration, in one place (they are the product's interface)."""

from __future__ import annotations

import hashlib
import re
import shlex

_NON_ALNUM = re.compile(r"[^A-Za-z0-9]")
_NON_WORD = re.compile(r"[^A-Za-z0-9_]")
# NATS subject tokens may not contain '.', '*', '>' or whitespace; escape them
# (and '%' itself) so any PostgreSQL identifier maps to one token, reversibly.
_SUBJECT_UNSAFE = re.compile(r"[%.*>\s\x00-\x1f\x7f]")


def escape_subject_token(identifier: str) -> str:
    escaped = _SUBJECT_UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group(0).encode()), identifier)
    return escaped or "%"


def unescape_subject_token(token: str) -> str:
    """The identifier `escape_subject_token` made `token` from."""
    return re.sub(r"(%[0-9A-F]{2})+", lambda m: bytes.fromhex(m.group(0).replace("%", "")).decode(errors="replace"),
                  token)


def application_of_subject(subject: str) -> str:
    """The application identifier a `siphon.<application>.>` subject was made from."""
    return unescape_subject_token(subject.split(".")[1] if subject.count(".") >= 1 else subject)


def table_of_subject(application_identifier: str, subject: str) -> tuple[str, str] | None:
    """(schema, table) of one of the application's table subjects; None for any other subject."""
    prefix = subject_prefix(application_identifier) + "."
    tokens = subject.removeprefix(prefix).split(".")
    if not subject.startswith(prefix) or len(tokens) != 2:
        return None
    schema, table = (unescape_subject_token(token) for token in tokens)
    return (schema, table) if table_subject(application_identifier, schema, table) == subject else None


def stream_name(application_identifier: str) -> str:
    return "SIPHON_" + _NON_ALNUM.sub("_", application_identifier).upper()


def subject_prefix(application_identifier: str) -> str:
    return f"siphon.{escape_subject_token(application_identifier)}"


def table_subject(application_identifier: str, schema: str, table: str) -> str:
    return f"{subject_prefix(application_identifier)}.{escape_subject_token(schema)}.{escape_subject_token(table)}"


def gap_subject(application_identifier: str) -> str:
    """Where the producer records a lost replication slot: three tokens, so no table subject
    (`siphon.<application>.<schema>.<table>`, four) can ever be this one."""
    return f"{subject_prefix(application_identifier)}.gaps"


def dead_letter_subject(application_identifier: str, schema: str, table: str) -> str:
    return f"siphon_dead_letter.{escape_subject_token(application_identifier)}.{escape_subject_token(schema)}.{escape_subject_token(table)}"


def job_suffix(schema: str, table: str) -> str:
    """`notes` for public.notes, `audit__events` for audit.events; non-word characters become `_`."""
    base = table if schema == "public" else f"{schema}__{table}"
    return _NON_WORD.sub("_", base)


def asset_path_text(target: str, schema: str, table: str) -> str:
    """How the Dagster UI and CLI (`--select`) spell a table's target asset: `clickhouse/public/notes`."""
    return "/".join(asset_key_path(target, schema, table))


def resnapshot_advice(target: str, schema: str, table: str) -> str:
    """What brings a target's rows back to the source's values when the stream cannot."""
    return (f"snapshot the table again: materialize every partition of asset {asset_path_text(target, schema, table)} "
            f"(`siphon-dagster snapshot --table {shlex.quote(schema + '.' + table)} --target {target}`; the stream goes on meanwhile)")


def rebuild_advice(target: str, schema: str, table: str) -> str:
    """What rebuilds a target table that cannot follow the source's schema."""
    return (f"rebuild it: `siphon-dagster target drop --target {target} --table {schema}.{table}`, then "
            f"materialize every partition of asset {asset_path_text(target, schema, table)} (`siphon-dagster "
            f"snapshot --table {shlex.quote(schema + '.' + table)} --target {target}`); the stream then resumes where it stopped")


def stream_job_name(target: str, schema: str, table: str) -> str:
    return f"stream_{target}_{job_suffix(schema, table)}"


def gap_sensor_name(application_identifier: str) -> str:
    """The Dagster sensor that rebuilds every table after a lost slot: `<group>_slot_gaps`."""
    return f"siphon_{_NON_WORD.sub('_', application_identifier)}_slot_gaps"


def resync_job_name(schema: str, table: str) -> str:
    """`resync_notes` for public.notes, `resync_audit__events` for audit.events."""
    return f"resync_{job_suffix(schema, table)}"


def asset_key_path(system: str, schema: str, table: str) -> list[str]:
    return [system, schema, table]


def target_table_name(schema: str, table: str) -> str:
    """`<schema>__<table>` in the target database; the source's own spelling is kept (quoted)."""
    return f"{schema}__{table}"


def current_view_name(schema: str, table: str) -> str:
    return f"{target_table_name(schema, table)}_current"


SHADOW_SUFFIX = "__resync"  # the table a resync fills before it replaces the live one
TRUNCATIONS_SUFFIX = "__truncations"  # the versions of the source's TRUNCATEs


def target_object_names(schema: str, table: str) -> dict[str, str]:
    """Every object a replicated table has in a target, by what it is: two tables must never share
    one (`public.orders__resync` would otherwise be the resync table of `public.orders`)."""
    live = target_table_name(schema, table)
    return {"table": live, "resync table": f"{live}{SHADOW_SUFFIX}",
            "truncations table": f"{live}{TRUNCATIONS_SUFFIX}", "current view": current_view_name(schema, table)}


def consumer_name(target: str, schema: str, table: str) -> str:
    """Durable consumer names allow only [A-Za-z0-9_-]; a digest keeps distinct tables distinct."""
    readable = _NON_WORD.sub("_", f"{target}_{schema}__{table}")[:48]
    digest = hashlib.sha1(f"{target}\0{schema}\0{table}".encode()).hexdigest()[:10]
    return f"{readable}_{digest}"


def slot_name(application_identifier: str) -> str:
    """Replication slot names allow [a-z0-9_] up to 63 characters."""
    readable = _NON_WORD.sub("_", application_identifier.lower())[:40]
    digest = hashlib.sha1(application_identifier.encode()).hexdigest()[:8]
    return f"siphon_{readable}_{digest}"


def publication_name(application_identifier: str) -> str:
    return slot_name(application_identifier)


def advisory_lock_key(application_identifier: str) -> int:
    """A stable signed 64-bit key for pg_advisory_lock."""
    value = int.from_bytes(hashlib.sha256(f"siphon:{application_identifier}".encode()).digest()[:8], "big")
    return value - (1 << 64) if value >= (1 << 63) else value


def row_version(commit_lsn: int, position: int) -> int:
    """The total order of changes: (commit LSN, position in transaction) packed into one integer.

    Fits an unsigned 128-bit integer and Snowflake's NUMBER(38, 0).
    """
    return (commit_lsn << 32) | position


def split_version(version: int) -> tuple[int, int]:
    return version >> 32, version & 0xFFFFFFFF


def format_lsn(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)
