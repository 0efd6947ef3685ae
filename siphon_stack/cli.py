"""`siphon-stack up|status|down --dir DIR`: the local stack of real services on loopback."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from siphon_stack import stack
from siphon_stack.process import StackError

SECURE_HELP = (
    "TLS and passwords everywhere: a CA made in DIR/tls signs a certificate for 127.0.0.1/localhost; PostgreSQL "
    "takes TCP logins (replication too) only over TLS with a SCRAM password; NATS requires TLS and the users "
    "'producer' and 'dagster', each with only the permissions its side needs; the embedded ClickHouse serves "
    "https with basic authentication as 'siphon'. DIR/stack.env (mode 600) then carries SIPHON_STACK_CA_FILE, "
    "SIPHON_PG_DSN (sslmode=verify-full), SIPHON_PG_PASSWORD (also PGPASSWORD), SIPHON_NATS_URL (tls://), "
    "SIPHON_NATS_{PRODUCER,DAGSTER}_{USER,PASSWORD}, SIPHON_CLICKHOUSE_URL (https://), SIPHON_CLICKHOUSE_USER and "
    "SIPHON_CLICKHOUSE_PASSWORD. fakesnow stays plain HTTP (it has no TLS)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="siphon-stack", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("up", "start every service and write DIR/stack.env"),
                       ("status", "show each service, its port and whether it runs"),
                       ("down", "stop the services started from DIR")):
        command = sub.add_parser(name, help=text)
        command.add_argument("--dir", required=True, type=Path, help="directory the stack owns")
        if name == "up":
            command.add_argument("--no-snowflake", action="store_true", help="do not start fakesnow")
            command.add_argument("--spark-connect", action="store_true", help="also start a Spark Connect server")
            command.add_argument("--secure", action="store_true", help=SECURE_HELP)
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            state = stack.up(args.dir, with_snowflake=not args.no_snowflake, with_spark_connect=args.spark_connect,
                             secure=args.secure)
            for name, service in state.services.items():
                print(f"{name:14} pid {service.pid:<8} port {service.port}")
            print(f"environment: source {Path(state.directory) / 'stack.env'}")
        elif args.command == "status":
            state = stack.status(args.dir)
            alive = state.alive()
            for name, service in state.services.items():
                print(f"{name:14} pid {service.pid:<8} port {service.port:<6} {'running' if alive[name] else 'STOPPED'}")
            return 0 if all(alive.values()) else 3
        else:
            stopped = stack.down(args.dir)
            print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    except StackError as error:
        print(f"siphon-stack: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
