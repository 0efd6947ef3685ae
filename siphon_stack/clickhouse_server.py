"""`siphon-clickhouse`: the embedded ClickHouse server.

A chdb data directory can be opened by one process only, while Dagster runs, Spark executors,
checks and users are many processes. This process owns the directory and answers the part of
ClickHouse's HTTP interface that clickhouse-connect uses, so every one of them connects with
`clickhouse_connect.get_client(host=..., port=...)`, exactly as to a ClickHouse server.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from siphon_stack.clickhouse.engine import Engine
from siphon_stack.clickhouse.handler import ClickHouseHTTPServer

SHUTDOWN_GRACE_SECONDS = 30.0
SESSION_SWEEP_SECONDS = 1.0


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    data_dir = Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        engine = Engine(str(data_dir))
    except Exception as error:
        _say(f"cannot open the chdb data directory {data_dir}: {_engine_message(error)}")
        return 1
    try:
        server = ClickHouseHTTPServer((args.host, args.port), engine)
    except OSError as error:
        _say(f"cannot listen on {args.host}:{args.port}: {error}")
        engine.close(grace_seconds=0)
        return 1
    _stop_on_signals(server)
    stopped = threading.Event()
    threading.Thread(target=_sweep_sessions, args=(engine, stopped), name="session-sweeper", daemon=True).start()
    _say(f"serving {data_dir} on http://{args.host}:{args.port} (ClickHouse {engine.version}, chdb)")
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
    return parser.parse_args(argv)


def _engine_message(error: Exception) -> str:
    text = " ".join(str(error).split())
    if "Cannot lock file" in text:
        return (f"another process has it open ({text}). A chdb data directory can be opened by one "
                "process only: stop that process, or point clients at the siphon-clickhouse already serving it")
    return text


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
