"""Schema parity: the source's replicated columns, typed by the mapping, against the target's columns."""

from __future__ import annotations

from siphon_dagster import source
from siphon_dagster.checks.outcome import ERROR, CheckContext, Outcome
from siphon_dagster.targets.base import META_COLUMNS, TableSchema, TargetColumn

NAME = "schema_parity"
SEVERITY = ERROR
DESCRIPTION = ("The target table has every replicated source column (excluded and generated ones left out) "
               "with the type the type mapping gives it, and no other column besides Siphon's _siphon_* ones.")
META_PREFIX = "_siphon_"


def compare(table: TableSchema, stored: list[TargetColumn], expected: dict[str, str],
            matches: dict[str, bool]) -> tuple[list[str], list[str], list[str]]:
    """(missing, extra, of another type): `expected` maps a source column to its target type and
    `matches` says whether the stored type is that one."""
    names = {c.name for c in stored}
    missing = [c.name for c in table.columns if c.name not in names]
    missing += [m for m in META_COLUMNS if m not in names]
    source_names = set(table.column_names)
    extra = [c.name for c in stored if c.name not in source_names and not c.name.startswith(META_PREFIX)]
    stored_types = {c.name: c.type for c in stored}
    retyped = [f"{name}: expected {expected[name]}, found {stored_types[name]}"
               for name in table.column_names if name in stored_types and not matches[name]]
    return missing, extra, retyped


def check(context: CheckContext) -> Outcome:
    with source.connect(context.source_dsn, autocommit=True) as connection:
        table = source.table_schema(connection, context.spec.table)
    stored = context.target.describe_columns(table)
    if not stored:
        return Outcome(False, f"{context.spec.qualified_name} does not exist at {context.target.location} yet "
                              "(snapshot its partitions)", {"source_columns": len(table.columns)})
    stored_types = {c.name: c.type for c in stored}
    expected = {c.name: context.target.expected_column_type(c) for c in table.columns}
    matches = {c.name: c.name in stored_types and context.target.column_type_matches(c, stored_types[c.name])
               for c in table.columns}
    missing, extra, retyped = compare(table, stored, expected, matches)
    problems = ([f"missing at target: {', '.join(missing)}"] if missing else []) + \
               ([f"extra at target: {', '.join(extra)}"] if extra else []) + \
               ([f"of another type: {'; '.join(retyped)}"] if retyped else [])
    metadata = {"source_columns": len(table.columns), "target_columns": len(stored), "missing": missing,
                "extra": extra, "of_another_type": retyped}
    if problems:
        return Outcome(False, "; ".join(problems), metadata)
    return Outcome(True, f"{len(table.columns)} columns match", metadata)
