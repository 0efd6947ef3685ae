-- A small code-hosting application: the tables a data-platform team would replicate.
CREATE TABLE IF NOT EXISTS namespaces (
    id bigserial PRIMARY KEY,
    name text NOT NULL,
    path text NOT NULL UNIQUE,
    visibility_level smallint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS projects (
    id bigserial PRIMARY KEY,
    namespace_id bigint NOT NULL REFERENCES namespaces(id),
    name text NOT NULL,
    description text,
    star_count integer NOT NULL DEFAULT 0,
    archived boolean NOT NULL DEFAULT false,
    topics text[] NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    last_activity_at timestamptz
);
CREATE TABLE IF NOT EXISTS milestones (
    id bigserial PRIMARY KEY,
    project_id bigint NOT NULL REFERENCES projects(id),
    title text NOT NULL,
    due_date date,
    state text NOT NULL DEFAULT 'active',
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS issues (
    id bigserial PRIMARY KEY,
    project_id bigint NOT NULL REFERENCES projects(id),
    milestone_id bigint REFERENCES milestones(id),
    iid integer NOT NULL,
    title text NOT NULL,
    description text,
    state_id smallint NOT NULL DEFAULT 1,
    weight integer,
    labels jsonb NOT NULL DEFAULT '[]',
    time_estimate interval,
    created_at timestamptz NOT NULL DEFAULT now(),
    closed_at timestamptz
);
CREATE TABLE IF NOT EXISTS merge_requests (
    id bigserial PRIMARY KEY,
    project_id bigint NOT NULL REFERENCES projects(id),
    iid integer NOT NULL,
    title text NOT NULL,
    source_branch text NOT NULL,
    target_branch text NOT NULL DEFAULT 'main',
    state_id smallint NOT NULL DEFAULT 1,
    merge_commit_sha bytea,
    additions integer NOT NULL DEFAULT 0,
    deletions integer NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    merged_at timestamptz
);
CREATE TABLE IF NOT EXISTS notes (
    id bigserial PRIMARY KEY,
    project_id bigint NOT NULL REFERENCES projects(id),
    noteable_type text NOT NULL,
    noteable_id bigint NOT NULL,
    author_id bigint NOT NULL,
    note text NOT NULL,
    note_html text,
    system boolean NOT NULL DEFAULT false,
    confidential boolean NOT NULL DEFAULT false,
    position numeric(12, 2),
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS events (
    id bigserial PRIMARY KEY,
    project_id bigint REFERENCES projects(id),
    author_id bigint NOT NULL,
    action smallint NOT NULL,
    target_type text,
    target_id bigint,
    fingerprint uuid,
    created_at timestamptz NOT NULL DEFAULT now()
);
