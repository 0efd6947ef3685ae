"""A live, changing code-hosting database: seeds the demo schema and keeps writing to it."""

from __future__ import annotations

import random
import time
import uuid
from importlib import resources
from typing import Any

import psycopg

TABLES = ("namespaces", "projects", "milestones", "issues", "merge_requests", "notes", "events")


def create_schema(dsn: str) -> None:
    ddl = resources.files("demo").joinpath("schema.sql").read_text()
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute(ddl)


def seed(dsn: str, namespaces: int = 20, projects: int = 80, issues: int = 3000, notes: int = 20000) -> None:
    """Fills an empty database with a plausible history (no-op when already seeded)."""
    with psycopg.connect(dsn) as connection:
        if connection.execute("select count(*) from namespaces").fetchone()[0]:
            return
        rnd = random.Random(7)
        connection.execute("""insert into namespaces (name, path)
                              select 'group ' || g, 'group-' || g from generate_series(1, %s) g""", (namespaces,))
        connection.execute("""insert into projects (namespace_id, name, description, star_count, topics)
                              select 1 + g %% %s, 'project ' || g, repeat('about project ' || g || '. ', 5),
                                     (g * 37) %% 500, array['ruby', 'go', 'ci']
                              from generate_series(1, %s) g""", (namespaces, projects))
        connection.execute("""insert into milestones (project_id, title, due_date)
                              select 1 + g %% %s, 'v' || g || '.0', date '2026-01-01' + g
                              from generate_series(1, %s) g""", (projects, projects * 2))
        connection.execute("""insert into issues (project_id, iid, title, description, weight, labels, time_estimate)
                              select 1 + g %% %s, g, 'issue ' || g, repeat('steps to reproduce ' || g || E'\n', 8),
                                     g %% 8, jsonb_build_array('bug', 'p' || (g %% 4)), make_interval(hours => g %% 40)
                              from generate_series(1, %s) g""", (projects, issues))
        connection.execute("""insert into merge_requests (project_id, iid, title, source_branch, merge_commit_sha,
                                                          additions, deletions)
                              select 1 + g %% %s, g, 'mr ' || g, 'feature-' || g, sha256(g::text::bytea),
                                     g %% 300, g %% 120
                              from generate_series(1, %s) g""", (projects, issues // 2))
        connection.execute("""insert into notes (project_id, noteable_type, noteable_id, author_id, note, note_html,
                                                 position)
                              select 1 + g %% %s, 'Issue', 1 + g %% %s, g %% 97, 'note ' || g || ' ' || md5(g::text),
                                     '<p>note ' || g || '</p>', (g %% 1000) / 7.0
                              from generate_series(1, %s) g""", (projects, issues, notes))
        connection.execute("""insert into events (project_id, author_id, action, target_type, target_id, fingerprint)
                              select 1 + g %% %s, g %% 97, g %% 12, 'Note', g, gen_random_uuid()
                              from generate_series(1, %s) g""", (projects, notes))
        _ = rnd


def _one_change(cursor: Any, rnd: random.Random) -> None:
    kind = rnd.random()
    project = rnd.randint(1, 80)
    if kind < 0.45:
        cursor.execute("""insert into notes (project_id, noteable_type, noteable_id, author_id, note, note_html)
                          values (%s, 'Issue', %s, %s, %s, %s)""",
                       (project, rnd.randint(1, 3000), rnd.randint(1, 97), f"comment {uuid.uuid4()}", "<p>hi</p>"))
        cursor.execute("""insert into events (project_id, author_id, action, target_type, fingerprint)
                          values (%s, %s, 6, 'Note', %s)""", (project, rnd.randint(1, 97), uuid.uuid4()))
    elif kind < 0.75:
        cursor.execute("update issues set weight = %s, state_id = %s where id = %s",
                       (rnd.randint(0, 9), rnd.choice((1, 2)), rnd.randint(1, 3000)))
    elif kind < 0.85:
        cursor.execute("update projects set star_count = star_count + 1, last_activity_at = now() where id = %s",
                       (project,))
    elif kind < 0.95:
        cursor.execute("update merge_requests set state_id = 3, merged_at = now() where id = %s",
                       (rnd.randint(1, 1500),))
    else:
        cursor.execute("delete from notes where id = (select min(id) from notes where project_id = %s)", (project,))


def run(dsn: str, changes_per_second: float = 20.0, duration_seconds: float | None = None) -> int:
    """Commits small transactions at about the given rate; returns the number committed."""
    rnd = random.Random()
    deadline = None if duration_seconds is None else time.monotonic() + duration_seconds
    committed = 0
    with psycopg.connect(dsn) as connection:
        while deadline is None or time.monotonic() < deadline:
            with connection.transaction(), connection.cursor() as cursor:
                for _ in range(rnd.randint(1, 3)):
                    _one_change(cursor, rnd)
            committed += 1
            time.sleep(1.0 / changes_per_second)
    return committed
