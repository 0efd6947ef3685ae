"""The one typed configuration model of an application, loaded from `siphon.yaml`.

`${VAR}` anywhere in a string value reads the environment (secrets never live in
the file). Every error names the file, the table (when there is one) and the key.
"""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path
from typing import Any

import yaml
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from siphon_core.naming import target_object_names

APPLICATION_IDENTIFIER = re.compile(r"[A-Za-z0-9_.-]+")
SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ConfigError(ValueError):
    """A configuration that cannot be used, with the place and the fix in its message."""


def _readable_file(value: str | None) -> str | None:
    """A certificate, key or credentials file must exist when the configuration is read: a missing one
    would otherwise surface as a TLS failure far from its cause."""
    if value is None:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"file '{value}' does not exist or is not a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"file '{value}' is not readable by this process")
    return str(path)


# --- NATS login files: their content is checked when the configuration is read ----------------------
def _nkey_seed_file(value: str | None) -> str | None:
    """A file holding a user's nkey seed (`SU...`, as `nsc` or `nk -gen user` writes it). A file
    that holds none would fail every connection, and be retried as if NATS were away."""
    value = _readable_file(value)
    if value is not None and not any(_is_user_seed(line) for line in Path(value).read_bytes().split()):
        raise ValueError(f"file '{value}' holds no valid user nkey seed (a line starting with SU)")
    return value


def _creds_file(value: str | None) -> str | None:
    """A creds file as `nsc generate creds` writes it: the user's JWT, then its seed."""
    value = _readable_file(value)
    if value is not None:
        text = Path(value).read_bytes()
        if b"BEGIN NATS USER JWT" not in text or not any(_is_user_seed(line) for line in text.split()):
            raise ValueError(f"file '{value}' is not a NATS creds file (a user JWT block, then a user nkey seed)")
    return value


def _is_user_seed(word: bytes) -> bool:
    """Base32 of a prefix, 32 bytes and their CRC-16, which catches a typo (nkeys does not check it)."""
    import nkeys  # nats-py's nkeys extra, which both logins need

    if not word.startswith(b"SU"):
        return False
    try:
        decoded = base64.b32decode(word + b"=" * (-len(word) % 8))
    except ValueError:
        return False
    return len(decoded) == 36 and nkeys.crc16_checksum(decoded[:-2]) == decoded[-2:]
# --- end of the NATS login files ---------------------------------------------------------------------


class _Model(BaseModel):
    # An unknown key is refused: a misspelt setting would otherwise be ignored without a word.
    # Validation errors never quote the input: it may hold a password.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class SourceConfig(_Model):
    dsn: str
    snapshot_dsn: str | None = None
    # A snapshot's COPY text waits here for a slower target, so the source's lock and slot are
    # released when the COPY ends (siphon_dagster.snapshot.spool); None is the system's temp dir.
    snapshot_spool_directory: str | None = None
    snapshot_spool_max_bytes: int = Field(default=2 << 30, ge=0)
    # How long a range's snapshot may wait for transactions that were open when it began (its slot
    # cannot be created before they end) before the run fails naming them; 0 waits for ever.
    snapshot_wait_limit_seconds: float = Field(default=1800.0, ge=0)
    # How long a snapshot range retries a lost or refused source or target connection (a restart,
    # a failover) with backoff before its run fails; 0 fails at the first loss.
    snapshot_retry_seconds: float = Field(default=120.0, ge=0)

    # -- TLS to the source: libpq's own parameters, which the DSN may also carry; a value here wins --
    sslmode: str | None = None
    sslrootcert: str | None = None
    sslcert: str | None = None
    sslkey: str | None = None

    @field_validator("sslmode")
    @classmethod
    def _known_sslmode(cls, value: str | None) -> str | None:
        if value is not None and value not in SSL_MODES:
            raise ValueError(f"'{value}' is not one of {', '.join(SSL_MODES)}")
        return value

    @field_validator("sslrootcert", "sslcert", "sslkey")
    @classmethod
    def _tls_file(cls, value: str | None) -> str | None:
        # libpq's `sslrootcert=system` means the operating system's trusted roots.
        return value if value == "system" else _readable_file(value)

    @model_validator(mode="after")
    def _client_pair(self) -> SourceConfig:
        if (self.sslcert is None) != (self.sslkey is None):
            raise ValueError("sslcert and sslkey go together: give both or neither")
        return self

    def conninfo(self, snapshot: bool = False) -> str:
        """The connection string every connection to the source uses (control, replication,
        snapshot, re-read): the DSN (the snapshot DSN with `snapshot=True`) with the TLS settings of
        this section applied. A root certificate without a mode means `verify-full`: a server that
        cannot prove its name is refused rather than used without TLS."""
        dsn = self.snapshot_or_primary_dsn if snapshot else self.dsn
        tls = {key: getattr(self, key) for key in ("sslmode", "sslrootcert", "sslcert", "sslkey")
               if getattr(self, key) is not None}
        if self.sslrootcert is not None and self.sslmode is None and "sslmode" not in conninfo_to_dict(dsn):
            tls["sslmode"] = "verify-full"
        return make_conninfo(dsn, **tls) if tls else dsn

    @field_validator("dsn", "snapshot_dsn")
    @classmethod
    def _readable_dsn(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            conninfo_to_dict(value)
        except Exception:
            # libpq's own message quotes the offending part, which may be the password.
            raise ValueError("not a PostgreSQL connection string libpq can read; in a URL, a '%' (or '@', ':', "
                             "'/') in the password must be percent-encoded ('%' as %25), or the password given "
                             "in PGPASSWORD or a password= key") from None
        return value

    @property
    def snapshot_or_primary_dsn(self) -> str:
        return self.snapshot_dsn or self.dsn


class QueueConfig(_Model):
    url: str = "nats://127.0.0.1:4222"
    # JetStream keeps a message id for this long to drop a resent duplicate.
    duplicate_window_seconds: int = Field(default=600, ge=1)
    # Stream replicas in a cluster; 1 on a single server (which then syncs every write).
    replicas: int = Field(default=1, ge=1, le=5)
    max_message_bytes: int = Field(default=1_048_576, ge=65_536)
    # The stream's limit of consumers, set on it explicitly: Siphon keeps one per table and target,
    # and JetStream (2.15 on) limits a stream that sets none to 1000, which 500 tables to two
    # targets reach.
    max_consumers: int = Field(default=10_000, ge=1)
    # -- TLS and authentication (siphon_core.queue_security): a `tls://` URL or any tls_* setting means
    # TLS or no connection at all, never a plain-text fallback --
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    user: str | None = None
    password: str | None = None
    token: str | None = None
    nkey_seed_file: str | None = None
    creds_file: str | None = None

    _files = field_validator("tls_ca_file", "tls_cert_file", "tls_key_file")(_readable_file)
    _nkey_seed = field_validator("nkey_seed_file")(_nkey_seed_file)
    _creds = field_validator("creds_file")(_creds_file)

    @model_validator(mode="after")
    def _one_way_to_log_in(self) -> QueueConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
        if (self.user is None) != (self.password is None):
            raise ValueError("user and password go together: give both or neither")
        ways = [name for name, value in (("user/password", self.user), ("token", self.token),
                                         ("nkey_seed_file", self.nkey_seed_file), ("creds_file", self.creds_file))
                if value is not None]
        if len(ways) > 1:
            raise ValueError(f"give one way to log in, not {' and '.join(ways)}")
        return self

    @property
    def wants_tls(self) -> bool:
        return (self.url.lower().startswith("tls://")
                or any(value is not None for value in (self.tls_ca_file, self.tls_cert_file)))


class ProducerConfig(_Model):
    flush_interval_seconds: float = Field(default=3.0, gt=0)
    # A table's buffer leaves before flush_interval_seconds when the source has nothing more to
    # send, once it is this old: a workload of many small commits a second then makes about one
    # package per table and this interval, not one per commit (each costs the queue and every
    # consumer a message). The longest an event waits is still flush_interval_seconds. The wait
    # adds to a change's lag; a streaming run of many tables gathers each table's changes while
    # the table waits for its turn anyway, so a shorter wait here costs it few more messages: at
    # 200 tables 0.25 s took freshness p95 from 3.63 - 3.72 s to 3.41 - 3.44 s with 325 packages a
    # second instead of 227, and at 500 tables 12.9 s to 12.1 s.
    idle_flush_min_age_seconds: float = Field(default=0.25, ge=0)
    # With many tables changing at once, idle cuts of all tables together stay near this many
    # packages a second: each table's buffer then waits longer than idle_flush_min_age_seconds (at
    # most flush_interval_seconds). Every package costs the queue and each consumer a message, and
    # 500 busy tables cutting four a second each would outrun a streaming run on 2 cores.
    # null: no budget.
    idle_flush_packages_per_second: float | None = Field(default=800.0, gt=0)
    max_package_events: int = Field(default=10_000, ge=1)
    max_package_bytes: int = Field(default=800_000, ge=1024)
    metrics_port: int = Field(default=9187, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    heartbeat_interval_seconds: float = Field(default=10.0, gt=0)
    status_interval_seconds: float = Field(default=5.0, gt=0)
    max_unacked_packages: int = Field(default=64, ge=1)
    connect_retries: int = Field(default=8, ge=0)
    # How long the queue may fail every publish (or refuse a connection) before the producer drops
    # that connection; it then reconnects up to `connect_retries` times and exits 1.
    publish_retry_seconds: float = Field(default=120.0, gt=0)
    # How often the producer reads siphon.yaml again for tables added or removed (SIGHUP: at once);
    # 0: only at start and on SIGHUP.
    config_check_seconds: float = Field(default=5.0, ge=0)
    # "exit" (default) or "wait" when another producer holds this application's lock.
    on_lock_held: str = "exit"
    slot_name: str | None = None
    publication_name: str | None = None

    @field_validator("on_lock_held")
    @classmethod
    def _lock_mode(cls, value: str) -> str:
        if value not in ("exit", "wait"):
            raise ValueError("must be 'exit' or 'wait'")
        return value

    # -- a lost replication slot (producer_service.slot_loss) --
    # "resync" (default): record the gap on the queue, make a new slot and go on (the Dagster side
    # rebuilds every table); "stop": exit 3 and change nothing until started with --accept-slot-loss.
    on_slot_lost: str = "resync"

    @field_validator("on_slot_lost")
    @classmethod
    def _slot_lost_mode(cls, value: str) -> str:
        if value not in ("resync", "stop"):
            raise ValueError("must be 'resync' or 'stop'")
        return value


TARGET_NAMES = ("clickhouse", "snowflake")
DEFAULT_GROUP = "default"  # the streaming group of every table not named under streaming.groups
GROUP_NAME = re.compile(r"[A-Za-z0-9_]+")


class TableConfig(_Model):
    name: str
    exclude_columns: list[str] = Field(default_factory=list)
    blocks_per_partition: int = Field(default=8192, ge=1)
    # What a streaming run does with a package it cannot apply: stop (default),
    # retry with backoff, or move it to the dead-letter subject and go on.
    on_error: str = "stop"
    # The targets this table is replicated to; None: every configured target.
    targets: list[str] | None = None

    @field_validator("name")
    @classmethod
    def _qualified(cls, value: str) -> str:
        schema, _, table = value.partition(".")
        if not table:
            raise ValueError(f"'{value}' must be schema-qualified, e.g. public.{value}")
        return value

    @field_validator("on_error")
    @classmethod
    def _strategy(cls, value: str) -> str:
        if value not in ("stop", "retry", "dead_letter"):
            raise ValueError("must be one of stop, retry, dead_letter")
        return value

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("name at least one target, or leave the key out for every configured target")
        unknown = [name for name in value if name not in TARGET_NAMES]
        if unknown:
            raise ValueError(f"{unknown} are not targets; the targets are {list(TARGET_NAMES)}")
        if len(set(value)) != len(value):
            raise ValueError(f"{value} names a target twice")
        return value

    @property
    def schema_name(self) -> str:
        return self.name.partition(".")[0]

    @property
    def table_name(self) -> str:
        return self.name.partition(".")[2]


DEFAULT_CLICKHOUSE_TABLE_SETTINGS: dict[str, int | str] = {"min_bytes_for_full_part_storage": 16 << 20}


class ClickHouseTargetConfig(_Model):
    url: str = "http://127.0.0.1:8123"
    database: str = "siphon"
    username: str = "default"
    password: str = ""
    # https only: the CA that signed the server's certificate (None: the system's roots), and
    # whether the certificate is checked at all.
    ca_file: str | None = None
    verify: bool = True
    # MergeTree settings of the tables Siphon creates. Every stream batch is a part of its own: a
    # part this small is stored as one file instead of one per kind of data (about ten), which on
    # the local file system cost each insert as much CPU as the rest of it. A server that refuses a
    # default gets its tables without it (see ClickHouseTarget); given here, a refused setting is an
    # error. Small parts merged twenty at a time (`min_parts_to_merge_at_once`) saved the embedded
    # server about a tenth of its CPU per batch, but a table then keeps several times the parts,
    # and `FINAL` reads over 60 parts cost 1.5 times those over 5: not a default.
    table_settings: dict[str, int | str] = Field(default_factory=lambda: dict(DEFAULT_CLICKHOUSE_TABLE_SETTINGS))

    _ca = field_validator("ca_file")(_readable_file)

    @field_validator("table_settings")
    @classmethod
    def _setting_names(cls, value: dict[str, int | str]) -> dict[str, int | str]:
        for name in value:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"'{name}' is not a MergeTree setting name")
        return value

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.lower().startswith(("http://", "https://")):
            raise ValueError(f"'{value.split('@')[-1]}' must start with http:// or https://")
        return value

    @model_validator(mode="after")
    def _tls_needs_https(self) -> ClickHouseTargetConfig:
        if self.ca_file is not None and not self.url.lower().startswith("https://"):
            raise ValueError("ca_file is given but url is not https://: the certificate would never be checked")
        return self


class SnowflakeTargetConfig(_Model):
    account: str
    user: str
    password: str = ""
    # Key-pair authentication instead of a password: an unencrypted or encrypted PKCS#8 PEM file.
    private_key_file: str | None = None
    private_key_passphrase: str | None = None

    _key = field_validator("private_key_file")(_readable_file)

    @model_validator(mode="after")
    def _one_way_to_log_in(self) -> SnowflakeTargetConfig:
        if self.private_key_file is not None and self.password:
            raise ValueError("give password or private_key_file, not both")
        if self.private_key_passphrase is not None and self.private_key_file is None:
            raise ValueError("private_key_passphrase is given without private_key_file")
        return self
    database: str = "SIPHON"
    schema_: str = Field(default="PUBLIC", alias="schema")
    warehouse: str | None = None
    role: str | None = None
    # For a Snowflake-compatible endpoint other than the real service (tests).
    host: str | None = None
    port: int | None = None
    protocol: str | None = None
    # -- loading through a stage --
    # Batches of at least this many rows travel as Parquet files through a temporary stage and a
    # COPY INTO; smaller ones as the VALUES of their MERGE (one statement, where a PUT and a COPY
    # cost more than they save). A multi-row INSERT, the slowest way into a warehouse, is left for
    # a role that may not create a stage and for tables too wide for a VALUES of that many rows.
    stage_min_rows: int = Field(default=100, ge=0)
    # Where Parquet files wait for their PUT (None: the system's temporary directory).
    stage_directory: str | None = None


class TargetsConfig(_Model):
    clickhouse: ClickHouseTargetConfig | None = None
    snowflake: SnowflakeTargetConfig | None = None

    def configured(self) -> list[str]:
        return [name for name in TARGET_NAMES if getattr(self, name) is not None]


class SparkConfig(_Model):
    # "local[*]" runs Spark in the process; "sc://host:port" is a Spark Connect server.
    master: str = "local[2]"
    remote: str | None = None
    conf: dict[str, str] = Field(default_factory=dict)
    # Local mode: at most this many tasks, hence Python workers, at once (reused between tasks), for
    # all the tables of a run together; None: one per core of `master`.
    max_python_workers: int | None = Field(default=None, ge=1)
    # Local mode: a streaming run stops its session, and the JVM with its Python workers, once no
    # batch has used it for this long (0: never); the next large batch starts one again.
    idle_stop_seconds: float = Field(default=300.0, ge=0)


SINGLE_TABLE_DRIVER_DECODE_MAX_BYTES = 1_000_000
# Batches a group run writes at once by target, where streaming.apply_threads is not set.
DEFAULT_APPLY_THREADS = {"clickhouse": 8, "snowflake": 16}


class StreamingConfig(_Model):
    # A backlog is cut by bytes (compressed, as pulled): packages hold from a few to thousands of
    # events, so a count alone made batches of very different work. About 4 MB of packages is
    # 230,000 changes of a 30-column table: enough to spread each batch's fixed cost (a Spark job,
    # a few target statements), small enough that the next batch is decoded while one is written.
    # A backlog's first batch is decoded with no write beside it and its last written with no
    # decode: 8 MB made a backlog of 2,000,000 such changes 5 batches, and that fill and drain cost
    # the whole run about 5% of its rate (2 MB cost more in fixed costs than it saved). A batch
    # pulled with none in flight is cut at a quarter of this (siphon_dagster.streaming.consumer).
    batch_max_messages: int = Field(default=1000, ge=1)
    batch_max_bytes: int = Field(default=4_000_000, ge=1024)
    batch_max_wait_seconds: float = Field(default=1.0, gt=0)
    max_failures_before_backoff: int = Field(default=3, ge=1)
    # Prometheus /metrics of a streaming or snapshot run (siphon_dagster.streaming.metrics); 0: not
    # served. Each run is a pod in production (9188 there); runs sharing a machine log a taken port.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"

    # -- one streaming run serves many tables (siphon_dagster.stream_groups) ----------------------
    # Named groups of tables, each served by a run of its own per target (`stream_<target>__<group>`);
    # every table not named here is served by the default group's run (`stream_<target>`).
    groups: dict[str, list[str]] = Field(default_factory=dict)
    # When siphon.yaml's tables, groups or targets change, the streaming sensor has the code server
    # (`dagster code-server start`) load the code location again, so that new tables get their assets,
    # snapshot and streaming run without an operator's reload (siphon_dagster.location_reload).
    reload_location_on_change: bool = True
    # A table's asset gets at most one materialization per interval, aggregating the batches between
    # (one sooner when a batch changed the schema or warned): hundreds of tables would flood the log.
    materialization_interval_seconds: float = Field(default=60.0, ge=0)
    # And at most this many a second over a run's tables (schema changes and warnings aside): each
    # costs writes to Dagster's event log that its sensors and daemon read. Tables past their
    # interval take turns, the longest unreported first. null: no budget.
    max_materializations_per_second: float | None = Field(default=2.0, gt=0)
    # Batches up to this many bytes of packages are decoded and folded in the run's own process by
    # the code the Spark tasks run: a Spark job costs tens of milliseconds however small its batch.
    # Unset: 1 MB for a run of one table, whose backlog Spark's executors decode in parallel, and
    # for every run when Spark is a Spark Connect server; every batch (up to batch_max_bytes) for a
    # run of several tables in local mode, whose tables already keep the machine's cores busy,
    # where a JVM and its workers would take memory and CPU from them.
    driver_decode_max_bytes: int | None = Field(default=None, ge=0)
    # How long a quiet table's pull request waits on its subject before it is renewed.
    idle_pull_seconds: float = Field(default=20.0, gt=0)
    # A group run's budget of batches per second over all its tables: with more busy tables than
    # batch_max_wait_seconds allows within it, each batch collects longer (up to 5 s) and holds more
    # changes, since every batch costs the target a statement whatever its size.
    max_batches_per_second: float = Field(default=50.0, gt=0)
    # Batches a group run prepares and writes at once (threads waiting on the target and Spark).
    # None: the target's own (`apply_threads_for`).
    apply_threads: int | None = Field(default=None, ge=1, le=256)
    # How long a streaming run trusts its look-up of whether a table's resync is under way (0: it
    # looks before every batch); a resync waits this long, and 2 s more, before its first snapshot.
    shadow_lookup_seconds: float = Field(default=10.0, ge=0, le=300)

    def apply_threads_for(self, target: str) -> int:
        """`apply_threads`, or the target's default: a ClickHouse insert costs the server CPU more
        than it waits, and more of them at once only compete for it (with the server on the run's
        two cores, 8 at once instead of 16 took each write from 0.2 to 0.08 s and freshness p95 at
        200 tables from 6.7 - 8.9 s to 4.7 - 5.2 s); a Snowflake statement waits on the warehouse."""
        if self.apply_threads is not None:
            return self.apply_threads
        return DEFAULT_APPLY_THREADS[target]

    def driver_decode_limit(self, tables: int, remote_spark: bool = False) -> int:
        """`driver_decode_max_bytes` for a run serving `tables` tables. With a Spark Connect server
        (`spark.remote`) larger batches go there whatever the run: its executors cost the run's
        machine nothing, and a batch decoded in the run would hold its rows in the run's memory."""
        if self.driver_decode_max_bytes is not None:
            return self.driver_decode_max_bytes
        if tables <= 1 or remote_spark:
            return SINGLE_TABLE_DRIVER_DECODE_MAX_BYTES
        return 2 * self.batch_max_bytes

    @field_validator("groups")
    @classmethod
    def _group_names(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, tables in value.items():
            if not GROUP_NAME.fullmatch(name) or name == DEFAULT_GROUP:
                raise ValueError(f"group '{name}': a group name is letters, digits and '_' "
                                 f"(and not '{DEFAULT_GROUP}', which holds every table not in a group)")
            if not tables:
                raise ValueError(f"group '{name}': name at least one table")
        return value

    def group_of(self, table: str) -> str:
        """The streaming group serving `table` (schema.table)."""
        for name, tables in self.groups.items():
            if table in tables:
                return name
        return DEFAULT_GROUP


# --- snapshots: what the snapshot sensor does without an operator ---------------------------------
class SnapshotsConfig(_Model):
    # Snapshot every partition of a table new to the configuration, or missing at a target.
    auto_load: bool = True
    # Runs of one partition, the first included, before a failing partition is left to an operator.
    max_attempts: int = Field(default=3, ge=1)
    # The wait after a failure before the next attempt; it doubles with each attempt, up to 10 minutes.
    retry_delay_seconds: float = Field(default=30.0, ge=0)
    # New tables whose load is one partition (small ones), up to this many to a run: a run costs
    # seconds of start-up, such a table's load a tenth of one. Each table's partition is still
    # materialized on its own asset; one that fails there loads in a run of its own. 1: a run per
    # partition.
    tables_per_load_run: int = Field(default=20, ge=1, le=1000)
# --- end of snapshots ----------------------------------------------------------------------------


# -- checks ------------------------------------------------------------------------------------------


class ChecksConfig(_Model):
    """The asset checks on every target asset (siphon_dagster.checks) and their schedule."""

    enabled: bool = True  # the schedule starts RUNNING; the checks themselves are always declared
    schedule: str = "0 * * * *"
    # Freshness warns when the oldest change not yet applied at a target is older than this.
    freshness_warn_seconds: float = Field(default=300.0, gt=0)
    row_parity_max_reported_keys: int = Field(default=100, ge=1)
    # How long a check waits for a table's stream to apply what the source had committed.
    settle_timeout_seconds: float = Field(default=120.0, gt=0)
    # Reads of a table whose counts or rows are still moving with the stream, before a verdict.
    settle_attempts: int = Field(default=3, ge=1)
    settle_interval_seconds: float = Field(default=2.0, ge=0)
    # Row count compares a busy table exactly by reading, at the source's read, the keys changed since at
    # the target; past this many such keys it cannot tell and warns.
    row_count_max_changed_keys: int = Field(default=100_000, ge=0)

    @field_validator("schedule")
    @classmethod
    def _cron(cls, value: str) -> str:
        # Five fields here; Dagster checks each field when it builds the schedule.
        if len(value.split()) != 5:
            raise ValueError(f"'{value}' is not a cron expression of five fields such as '0 * * * *'")
        return value


class SiphonConfig(_Model):
    application_identifier: str
    source: SourceConfig
    queue: QueueConfig = Field(default_factory=QueueConfig)
    producer: ProducerConfig = Field(default_factory=ProducerConfig)
    tables: list[TableConfig]
    targets: TargetsConfig = Field(default_factory=TargetsConfig)
    spark: SparkConfig = Field(default_factory=SparkConfig)
    streaming: StreamingConfig = Field(default_factory=StreamingConfig)
    snapshots: SnapshotsConfig = Field(default_factory=SnapshotsConfig)
    checks: ChecksConfig = Field(default_factory=ChecksConfig)

    @field_validator("application_identifier")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not APPLICATION_IDENTIFIER.fullmatch(value):  # `$` would let a trailing newline through
            raise ValueError(f"'{value}' may contain only letters, digits, '_', '.' and '-'")
        return value

    @model_validator(mode="after")
    def _unique_tables(self) -> SiphonConfig:
        if not self.tables:
            raise ValueError("tables: at least one table is needed")
        seen: set[str] = set()
        for table in self.tables:
            if table.name in seen:
                raise ValueError(f"tables: '{table.name}' is listed twice")
            seen.add(table.name)
            missing = [name for name in table.targets or () if name not in self.targets.configured()]
            if missing:
                raise ValueError(f"tables: '{table.name}' names target(s) {missing}, which are not configured under "
                                 "targets:")
        self._check_groups(seen)
        self._check_target_names()
        consumers = sum(len(table.targets or self.targets.configured()) for table in self.tables)
        if consumers > self.queue.max_consumers:
            raise ValueError(f"queue.max_consumers: {self.queue.max_consumers} is below the {consumers} consumers the "
                             "tables need (one per table and target); raise it")
        return self

    _unexpanded: dict[str, Any] = PrivateAttr(default_factory=dict)

    def settings(self, section: str) -> dict[str, Any]:
        """One section (`source`, `queue`, `targets.snowflake`, ...) as settings to hand to a process
        that validates them again (a Dagster resource): every value as loaded, except that a string
        written with `${VAR}` keeps the reference, so the secret it names is read from the
        environment where it is used and never lands in Dagster's storage or UI."""
        model: Any = self
        raw: Any = self._unexpanded
        for part in section.split("."):
            model = getattr(model, part)
            raw = raw.get(part) if isinstance(raw, dict) else None
        if model is None:
            raise KeyError(f"{section} is not configured")
        values = model.model_dump(by_alias=True, exclude_none=True)
        if isinstance(raw, dict):
            for key, value in raw.items():
                if isinstance(value, str) and _ENV_REFERENCE.search(value) and key in values:
                    values[key] = value
        return values

    def _check_target_names(self) -> None:
        """No two tables replicated to one target may name the same object there."""
        owners: dict[tuple[str, str], tuple[str, str]] = {}
        for table in self.tables:
            for target in table.targets or self.targets.configured():
                for what, name in target_object_names(table.schema_name, table.table_name).items():
                    owner = owners.setdefault((target, name), (table.name, what))
                    if owner[0] != table.name:
                        raise ValueError(
                            f"tables: '{table.name}' and '{owner[0]}' would both use {name} at target {target} "
                            f"(the {what} of '{table.name}', the {owner[1]} of '{owner[0]}'); one target cannot hold "
                            "both tables: replicate one of them, or send them to different targets")

    def _check_groups(self, configured: set[str]) -> None:
        """Every table of a streaming group is configured, and in one group only."""
        owner: dict[str, str] = {}
        for group, tables in self.streaming.groups.items():
            for name in tables:
                if name not in configured:
                    raise ValueError(f"streaming.groups.{group}: table '{name}' is not configured under tables:")
                if owner.get(name) == group:
                    raise ValueError(f"streaming.groups.{group}: table '{name}' is listed twice")
                if name in owner:
                    raise ValueError(f"streaming.groups: table '{name}' is in both group '{owner[name]}' and group "
                                     f"'{group}'; a table is served by one group")
                owner[name] = group

    def table(self, name: str) -> TableConfig:
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(f"table '{name}' is not in the configuration of {self.application_identifier}")


def _expand_environment(value: Any, where: str) -> Any:
    if isinstance(value, str):

        def replace(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in os.environ:
                raise ConfigError(f"{where}: environment variable {name} is not set")
            return os.environ[name]

        return _ENV_REFERENCE.sub(replace, value)
    if isinstance(value, dict):
        return {k: _expand_environment(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_environment(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def _describe_location(raw: dict[str, Any], loc: tuple[Any, ...]) -> str:
    """Turns a pydantic error location into `tables[2] (public.notes).exclude_columns`."""
    parts: list[str] = []
    node: Any = raw
    for item in loc:
        if isinstance(item, int):
            label = f"[{item}]"
            try:
                node = node[item]
                if isinstance(node, dict) and "name" in node:
                    label += f" ({node['name']})"
            except (IndexError, KeyError, TypeError):
                node = None
            parts.append(label)
        else:
            parts.append(("." if parts else "") + str(item))
            node = node.get(item) if isinstance(node, dict) else None
    return "".join(parts) or "(top level)"


def parse_config(raw: Any, source_name: str = "siphon.yaml") -> SiphonConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source_name}: expected a mapping at the top level, got {type(raw).__name__}")
    expanded = _expand_environment(raw, source_name)
    try:
        config = SiphonConfig.model_validate(expanded)
    except ValidationError as error:
        lines = []
        for problem in error.errors():
            where = _describe_location(expanded, tuple(problem["loc"]))
            message = problem["msg"]
            if problem["type"] == "extra_forbidden":
                message = "unknown key (misspelt, or not a setting of this section)"
            lines.append(f"{source_name}: {where}: {message}")
        raise ConfigError("\n".join(lines)) from None
    config._unexpanded = raw
    return config


def expand_settings(settings: Any, where: str = "settings") -> Any:
    """`${VAR}` references in settings (`SiphonConfig.settings`) replaced from the environment."""
    return _expand_environment(settings, where)


def load_config(path: str | os.PathLike[str]) -> SiphonConfig:
    file = Path(path)
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{file}: configuration file not found") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{file}: not valid YAML: {error}") from None
    return parse_config(raw, str(file))


CONFIG_VARIABLE = "SIPHON_CONFIG"  # where the Dagster side and the CLIs find siphon.yaml


def load_config_from_environment(variable: str = CONFIG_VARIABLE) -> SiphonConfig:
    path = os.environ.get(variable)
    if not path:
        raise ConfigError(f"{variable} is not set; point it at the application's siphon.yaml")
    return load_config(path)
