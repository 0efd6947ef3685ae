"""`siphon-clickhouse`: the embedded ClickHouse server.

A chdb data directory can be opened by one process only, while Dagster runs, Spark executors,
checks and users are many processes. This process owns the directory and answers the part of
ClickHouse's HTTP interface that clickhouse-connect uses, so every one of them connects with
`clickhouse_connect.get_client(host=..., port=...)`, exactly as to a ClickHouse server.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import ssl
import sys
import threading
from pathlib import Path
from types import FrameType

from siphon_stack.clickhouse import PASSWORD_VARIABLE
from siphon_stack.clickhouse.engine import Engine
from siphon_stack.clickhouse.handler import ClickHouseHTTPServer, Credentials

SHUTDOWN_GRACE_SECONDS = 10.0  # within the 20 s stop_pid() allows before SIGKILL
SESSION_SWEEP_SECONDS = 1.0


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    data_dir = Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    holder = _lock_holder(data_dir)
    if holder is not None:
        _say(f"the chdb data directory {data_dir} is in use by another process ({holder}). A chdb data "
             "directory can be opened by one process only: stop that process, or point clients at the "
             "siphon-clickhouse that already serves it")
        return 1
    try:
        engine = Engine(str(data_dir))
    except Exception as error:
        _say(f"cannot open the chdb data directory {data_dir}: {' '.join(str(error).split())}")
        return 1
    credentials = None
    if args.user:
        password = os.environ.pop(PASSWORD_VARIABLE, None)
        if password is None:
            _say(f"--user needs the password in the environment variable {PASSWORD_VARIABLE}")
            engine.close(grace_seconds=0)
            return 1
        credentials = Credentials(args.user, password)
    try:
        server = ClickHouseHTTPServer((args.host, args.port), engine, credentials=credentials,
                                      tls=_tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None)
    except (OSError, ssl.SSLError) as error:
        _say(f"cannot listen on {args.host}:{args.port}: {error}")
        engine.close(grace_seconds=0)
        return 1
    _stop_on_signals(server)
    stopped = threading.Event()
    threading.Thread(target=_sweep_sessions, args=(engine, stopped), name="session-sweeper", daemon=True).start()
    scheme = "https" if args.tls_cert else "http"
    _say(f"serving {data_dir} on {scheme}://{args.host}:{args.port} (ClickHouse {engine.version}, chdb"
         f"{', user ' + args.user if args.user else ''})")
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        stopped.set()
        server.server_close()
        if not engine.close(grace_seconds=SHUTDOWN_GRACE_SECONDS):
            _say(f"requests still running after {SHUTDOWN_GRACE_SECONDS:.0f}s were cut off")
    _say("stopped")
    return 0


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="siphon-clickhouse",
        description="Serve a chdb data directory over ClickHouse's HTTP interface (for clickhouse-connect).",
    )
    parser.add_argument("--data-dir", required=True, help="the chdb data directory (created if missing)")
    parser.add_argument("--port", type=int, required=True, help="HTTP port")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--tls-cert", help="serve https with this certificate (PEM)")
    parser.add_argument("--tls-key", help="the certificate's private key (PEM)")
    parser.add_argument("--user", help=f"require HTTP basic authentication as this user; the password is read "
                                       f"from {PASSWORD_VARIABLE}")
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    return args


def _tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


def _lock_holder(data_dir: Path) -> str | None:
    """Who holds the directory, if anyone. The engine's own refusal ("Cannot lock file .../status")
    reaches only its stderr, so the lock it takes, an flock on `status`, is tested here first."""
    status = data_dir / "status"
    try:
        with open(status, "rb") as file:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                details = file.read(200).decode(errors="replace").split("\n")
                return "; ".join(line for line in details if line.strip()) or f"{status} is locked"
            fcntl.flock(file, fcntl.LOCK_UN)
    except FileNotFoundError:
        return None
    return None


def _stop_on_signals(server: ClickHouseHTTPServer) -> None:
    def stop(signum: int, frame: FrameType | None) -> None:
        # shutdown() waits for serve_forever() to return, which runs in this (the main) thread.
        threading.Thread(target=server.shutdown, name="shutdown", daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def _sweep_sessions(engine: Engine, stopped: threading.Event) -> None:
    while not stopped.wait(SESSION_SWEEP_SECONDS):
        engine.expire_sessions()


def _say(message: str) -> None:
    print(f"siphon-clickhouse: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
