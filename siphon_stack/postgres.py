"""A PostgreSQL cluster made with initdb, configured for logical replication, on a loopback port.

PostgreSQL refuses to run as root, so when we are root the cluster's files belong to an
unprivileged account (`nobody`, or SIPHON_PG_USER) and the server runs as that account.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from siphon_stack.certificates import StackCertificates
from siphon_stack.process import StackError, pid_alive, port_accepts, start_process, stop_pid, wait_until

SUPERUSER = "postgres"
DATABASE = "siphon"

SERVER_SETTINGS = {
    "wal_level": "logical",
    # Enough for the producer, parallel snapshot partitions (one temporary slot each) and tests.
    "max_replication_slots": "64",
    "max_wal_senders": "64",
    "max_connections": "300",
    "shared_buffers": "256MB",
    "max_wal_size": "4GB",
    "wal_sender_timeout": "60s",
    "logging_collector": "off",
    "log_min_messages": "warning",
    "log_line_prefix": "'%m [%p] '",
    "fsync": "on",
}


def find_bindir() -> Path:
    """The newest PostgreSQL server installation, or SIPHON_PG_BINDIR."""
    candidates = [os.environ.get("SIPHON_PG_BINDIR", "")]
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True)
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(str(Path(initdb).parent))
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").exists() and (Path(candidate) / "postgres").exists():
            return Path(candidate)
    raise StackError(
        "PostgreSQL server binaries (initdb, postgres) were not found; "
        "install them with `apt-get install postgresql` (version 14 or newer) or set SIPHON_PG_BINDIR"
    )


def _version_key(path: str) -> float:
    try:
        return float(Path(path).parent.name)
    except ValueError:
        return 0.0


@dataclass
class ServerAccount:
    uid: int
    gid: int
    name: str

    @classmethod
    def for_postgres(cls) -> ServerAccount | None:
        """None when we may run the server as ourselves."""
        if os.geteuid() != 0:
            return None
        name = os.environ.get("SIPHON_PG_USER", "nobody")
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise StackError(f"running as root needs an unprivileged account for PostgreSQL; '{name}' does not exist "
                             "(set SIPHON_PG_USER to an existing account)") from None
        return cls(entry.pw_uid, entry.pw_gid, name)

    def demote(self) -> None:
        os.setgroups([])
        os.setgid(self.gid)
        os.setuid(self.uid)


def _require_traversable(path: Path, account: ServerAccount) -> None:
    """The server account must be able to reach its data directory through every parent."""
    for parent in path.resolve().parents:
        mode = parent.stat().st_mode
        if not mode & 0o001 and parent.stat().st_uid != account.uid:
            raise StackError(
                f"PostgreSQL runs as '{account.name}' (not as root), which cannot enter {parent} "
                f"(mode {mode & 0o777:o}); use a directory whose parents others may enter, e.g. under /tmp "
                "or the repository's var/")


@dataclass
class PostgresServer:
    root: Path
    port: int
    bindir: Path
    # Secure mode (`siphon-stack up --secure`): TCP only over TLS with this certificate, and a
    # password (SCRAM) for every TCP login, replication included. The socket, in a directory only
    # the server's account may enter, stays trusted for the stack's own administration.
    tls: StackCertificates | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        return self.root / "socket"

    @property
    def log_path(self) -> Path:
        return self.root / "postgres.log"

    @property
    def dsn(self) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{DATABASE}"

    def dsn_for(self, database: str, user: str = SUPERUSER) -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def _admin_dsn(self, database: str) -> str:
        """How the stack itself connects: over TCP, or through the socket when TCP needs TLS and a password."""
        if self.tls is None:
            return self.dsn_for(database)
        return f"host={self.socket_dir} port={self.port} user={SUPERUSER} dbname={database}"

    def _run(self, argv: list[str], account: ServerAccount | None) -> None:
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            preexec_fn=account.demote if account else None,
            cwd="/",
            env={**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"},
        )
        if result.returncode != 0:
            raise StackError(f"{Path(argv[0]).name} failed: {result.stderr.strip() or result.stdout.strip()}")

    def initialize(self) -> None:
        account = ServerAccount.for_postgres()
        if account:
            _require_traversable(self.root, account)
        if self.data_dir.exists() and not (self.data_dir / "PG_VERSION").exists():
            raise StackError(f"{self.data_dir} exists but is not a PostgreSQL data directory; remove it or use another --dir")
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        if account:
            # The server account must reach its files through our directories.
            os.chmod(self.root, 0o755)
            for path in (self.socket_dir,):
                os.chown(path, account.uid, account.gid)
            self.log_path.touch()
            os.chown(self.log_path, account.uid, account.gid)
        if not (self.data_dir / "PG_VERSION").exists():
            self.data_dir.mkdir(exist_ok=True)
            if account:
                os.chown(self.data_dir, account.uid, account.gid)
            self._run(
                [str(self.bindir / "initdb"), "-D", str(self.data_dir), "-U", SUPERUSER, "--auth=trust",
                 "--encoding=UTF8", "--locale=C.UTF-8", "--no-sync"],
                account,
            )
        settings = {**SERVER_SETTINGS, "port": str(self.port), "listen_addresses": "'127.0.0.1'",
                    "unix_socket_directories": f"'{self.socket_dir}'"}
        if self.tls is not None:
            settings.update(self._tls_settings(account))
        conf = "\n".join(f"{key} = {value}" for key, value in settings.items())
        (self.data_dir / "postgresql.auto.conf").write_text(f"# written by siphon-stack\n{conf}\n")
        if self.tls is None:
            hba = ("local all all trust\nhost all all 127.0.0.1/32 trust\n"
                   "local replication all trust\nhost replication all 127.0.0.1/32 trust\n")
        else:
            # No `host` line: a TCP login without TLS matches nothing and is refused.
            hba = ("local all all trust\nlocal replication all trust\n"
                   "hostssl all all 127.0.0.1/32 scram-sha-256\nhostssl replication all 127.0.0.1/32 scram-sha-256\n")
        (self.data_dir / "pg_hba.conf").write_text(hba)
        if account:
            for name in ("postgresql.auto.conf", "pg_hba.conf"):
                os.chown(self.data_dir / name, account.uid, account.gid)
        stale_pid = self.data_dir / "postmaster.pid"
        if stale_pid.exists():
            # Left by a crashed run; PostgreSQL itself refuses when that server still runs.
            first = stale_pid.read_text().split("\n", 1)[0].strip()
            if first.isdigit() and pid_alive(int(first)):
                raise StackError(f"a PostgreSQL server (pid {first}) still runs on {self.data_dir}; "
                                 "stop it with `siphon-stack down` first")
            stale_pid.unlink()

    def _tls_settings(self, account: ServerAccount | None) -> dict[str, str]:
        assert self.tls is not None
        # PostgreSQL refuses a key that others may read, or that is not its account's.
        for source, name in ((self.tls.cert_file, "server.crt"), (self.tls.key_file, "server.key")):
            target = self.data_dir / name
            target.write_bytes(source.read_bytes())
            os.chmod(target, 0o600)
            if account:
                os.chown(target, account.uid, account.gid)
        os.chmod(self.socket_dir, 0o700)
        return {"ssl": "on", "ssl_cert_file": "'server.crt'", "ssl_key_file": "'server.key'",
                "ssl_min_protocol_version": "'TLSv1.2'", "password_encryption": "'scram-sha-256'"}

    def start(self, timeout: float = 60.0) -> int:
        account = ServerAccount.for_postgres()
        process = start_process(
            "postgres",
            [str(self.bindir / "postgres"), "-D", str(self.data_dir)],
            self.log_path,
            env={"LC_ALL": "C.UTF-8"},
            cwd=Path("/"),
            preexec=account.demote if account else None,
        )
        wait_until("PostgreSQL", self.is_ready, timeout, pid=process.pid, log_path=self.log_path)
        self.ensure_database()
        if self.password is not None:
            self.set_password(self.password)
        return process.pid

    def set_password(self, password: str) -> None:
        import psycopg
        from psycopg import sql

        # Hashed by the client (SCRAM): the statement that reaches the server holds no password.
        with psycopg.connect(self._admin_dsn("postgres"), autocommit=True) as conn:
            verifier = conn.pgconn.encrypt_password(password.encode(), SUPERUSER.encode(), b"scram-sha-256")
            conn.execute(sql.SQL("alter role {} password {}").format(sql.Identifier(SUPERUSER),
                                                                        sql.Literal(verifier.decode())))

    def is_ready(self) -> bool:
        if not port_accepts(self.port):
            return False
        import psycopg

        try:
            with psycopg.connect(self._admin_dsn("postgres"), connect_timeout=2) as conn:
                conn.execute("select 1")
            return True
        except psycopg.OperationalError:
            return False

    def ensure_database(self) -> None:
        import psycopg

        with psycopg.connect(self._admin_dsn("postgres"), autocommit=True) as conn:
            exists = conn.execute("select 1 from pg_database where datname = %s", (DATABASE,)).fetchone()
            if not exists:
                conn.execute(f'create database "{DATABASE}"')

    def stop(self, pid: int) -> None:
        # SIGINT is PostgreSQL's fast shutdown: clean, and quick.
        import signal

        stop_pid(pid, timeout=30.0, sig=signal.SIGINT)
