"""`make demo`: a live code-hosting database replicated end to end, shown in the Dagster UI.

Starts the local stack, creates and seeds the sample database, writes its siphon.yaml, starts
the producer, a workload that keeps changing the database, and `dagster dev`; stops all of it,
by the process ids it started, on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from demo import workload
from siphon_stack import stack
from siphon_stack.process import (
    StackError,
    free_port,
    port_accepts,
    start_process,
    stop_pid,
    wait_until,
    with_allocator_settings,
)

ROOT = Path(__file__).resolve().parent.parent
DEMO_SNAPSHOT_RUNS_PER_TARGET = 1
# The snapshot sensor's load runs at once over both targets (the tag `siphon_dagster.snapshot_sensor`
# puts on them, capped in the project's dagster.yaml).
SENSOR_LOAD_TAG = "siphon/sensor_load"
DEMO_SENSOR_LOAD_RUNS = 1
DEMO_TABLES = [
    {"name": "public.namespaces"},
    {"name": "public.projects"},
    {"name": "public.milestones"},
    {"name": "public.issues"},
    {"name": "public.merge_requests"},
    {"name": "public.notes", "exclude_columns": ["note_html"], "blocks_per_partition": 64},
    {"name": "public.events", "blocks_per_partition": 64},
]


def write_instance_config(path: Path) -> None:
    """The project's dagster.yaml with one snapshot run at a time per target, and one of the
    snapshot sensor's load runs at a time over both targets: the demo's partitions are small, and
    each run is a Python process of 250 - 300 MB. With a load run per target beside the two
    streaming runs, the demo's peak came within a few percent of 4 GB (summed RSS), once past it."""
    instance = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    instance["concurrency"]["pools"]["default_limit"] = DEMO_SNAPSHOT_RUNS_PER_TARGET
    limits = instance["concurrency"]["runs"]["tag_concurrency_limits"]
    (load_runs,) = [limit for limit in limits if limit["key"] == SENSOR_LOAD_TAG]
    load_runs["limit"] = DEMO_SENSOR_LOAD_RUNS
    path.write_text("# Written by the demo from the project's dagster.yaml; only the snapshot pools and the\n"
                    "# snapshot sensor's load runs at once differ.\n"
                    + yaml.safe_dump(instance, sort_keys=False))


def write_config(path: Path, env: dict[str, str], with_snowflake: bool) -> None:
    config: dict[str, object] = {
        "application_identifier": "demo.main.1",
        "source": {"dsn": env["SIPHON_PG_DSN"]},
        "queue": {"url": env["SIPHON_NATS_URL"]},
        "producer": {"flush_interval_seconds": 1, "metrics_port": free_port()},
        "tables": DEMO_TABLES,
        "targets": {"clickhouse": {"url": env["SIPHON_CLICKHOUSE_URL"], "database": "siphon"}},
        # Every streaming run is a thin client of the stack's one Spark Connect server.
        "spark": {"remote": env["SIPHON_SPARK_REMOTE"]},
        "streaming": {"batch_max_wait_seconds": 1.0},
    }
    if with_snowflake:
        config["targets"]["snowflake"] = {  # type: ignore[index]
            "account": "${SIPHON_SNOWFLAKE_ACCOUNT}", "user": "${SIPHON_SNOWFLAKE_USER}",
            "password": "${SIPHON_SNOWFLAKE_PASSWORD}", "database": "SIPHON", "schema": "PUBLIC",
            "host": env["SIPHON_SNOWFLAKE_HOST"], "port": int(env["SIPHON_SNOWFLAKE_PORT"]), "protocol": "http",
        }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def write_shell_env(directory: Path, stack_dir: Path, config_path: Path, dagster_home: Path) -> Path:
    """A file to source in a shell: the stack's addresses and the variables `siphon-dagster` needs."""
    path = directory / "demo.env"
    path.write_text(f"set -a\n. {shlex.quote(str(stack_dir / 'stack.env'))}\n"
                    f"SIPHON_CONFIG={shlex.quote(str(config_path))}\n"
                    f"DAGSTER_HOME={shlex.quote(str(dagster_home))}\nset +a\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="siphon-demo", description=__doc__)
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "demo", help="where the demo keeps its state")
    parser.add_argument("--no-snowflake", action="store_true")
    parser.add_argument("--rate", type=float, default=20.0, help="workload transactions per second")
    args = parser.parse_args(argv)
    directory: Path = args.dir.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    stack_dir = directory / "stack"
    processes: list[tuple[str, int]] = []
    stop = threading.Event()
    snapshotting = _Commands()
    try:
        print("starting the local stack (PostgreSQL, NATS JetStream, embedded ClickHouse, fakesnow, "
              "Spark Connect)...", flush=True)
        state = stack.up(stack_dir, with_snowflake=not args.no_snowflake, with_spark_connect=True)
        env = {**os.environ, **state.environment}
        os.environ.update(state.environment)
        workload.create_schema(env["SIPHON_PG_DSN"])
        workload.seed(env["SIPHON_PG_DSN"])
        config_path = directory / "siphon.yaml"
        write_config(config_path, env, with_snowflake=not args.no_snowflake)
        env["SIPHON_CONFIG"] = str(config_path)
        # The Dagster records (runs, materialized partitions, check results) belong to this demo's
        # stack and are kept beside it: records of another stack would tell the snapshot sensor that
        # partitions this one never loaded are loaded.
        dagster_home = directory / "dagster_home"
        dagster_home.mkdir(exist_ok=True)
        write_instance_config(dagster_home / "dagster.yaml")
        env["DAGSTER_HOME"] = str(dagster_home)
        shell_env = write_shell_env(directory, stack_dir, config_path, dagster_home)
        bin_dir = Path(sys.executable).parent

        producer = start_process("siphon-producer", [str(bin_dir / "siphon-producer"), "run", "--config",
                                                     str(config_path)], directory / "producer.log", env=env)
        processes.append(("producer", producer.pid))
        subprocess.run([str(bin_dir / "siphon-dagster"), "partitions", "refresh"], env=env, check=True,
                       stdout=subprocess.DEVNULL)

        port = free_port()
        # `dagster dev` passes its own code-location arguments to the webserver it starts, which then
        # stops if it also finds DAGSTER_MODULE_NAME in its environment: the variable is removed.
        dagster = start_process("dagster dev", [str(bin_dir / "dagster"), "dev", "-m", "siphon_dagster",
                                                "-h", "127.0.0.1", "-p", str(port)],
                                directory / "dagster.log", env=with_allocator_settings(env),
                                cwd=Path(env["DAGSTER_HOME"]), unset=("DAGSTER_MODULE_NAME",))
        processes.append(("dagster", dagster.pid))
        wait_until("Dagster UI", lambda: port_accepts(port), 180.0, pid=dagster.pid,
                   log_path=directory / "dagster.log")

        writer = threading.Thread(target=_write_forever, args=(env["SIPHON_PG_DSN"], args.rate, stop), daemon=True)
        writer.start()
        loader = threading.Thread(target=_check_when_loaded,
                                  args=(config_path, env, directory, stop, snapshotting, port), daemon=True)
        loader.start()
        print(f"""
Siphon demo is running.
  Dagster UI:        http://127.0.0.1:{port}  (Assets -> group siphon_demo_main_1)
  configuration:     {config_path}
  producer log:      {directory / 'producer.log'}
  stack services:    source {stack_dir / 'stack.env'} for SIPHON_PG_DSN, SIPHON_CLICKHOUSE_URL, ...
  its commands:      first `. {shell_env}` (the stack's addresses, SIPHON_CONFIG, DAGSTER_HOME), then
  snapshot a table:  .venv/bin/siphon-dagster snapshot --table public.notes
  run the checks:    .venv/bin/siphon-dagster check
  repair a table:    .venv/bin/siphon-dagster repair --table public.notes
  rebuild a table:   .venv/bin/siphon-dagster resync --table public.notes
  tables' states:    .venv/bin/siphon-dagster status
A workload commits about {args.rate:.0f} transactions per second. The snapshot sensor is loading every
partition of every table (runs in the UI); the checks run once all are loaded. The streaming sensor keeps one
streaming run per target alive, serving every table. Press Ctrl-C to stop everything.
""", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        while not stop.is_set():
            stop.wait(1.0)
    except KeyboardInterrupt:
        pass
    except StackError as error:
        print(f"siphon-demo: {error}", file=sys.stderr)
        return 2
    finally:
        stop.set()
        print("stopping...", flush=True)
        snapshotting.stop()
        for name, pid in reversed(processes):
            stop_pid(pid, timeout=30.0 if name == "producer" else 20.0)
        stack.down(stack_dir)
        print("stopped.", flush=True)
    return 0


class _Commands:
    """The command running now, so that stopping the demo stops it too (by its pid)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._stopped = False

    def run(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        with self._lock:
            if self._stopped:
                return
            log_path.unlink(missing_ok=True)  # this demo's lines, not those of the demos before it
            process = start_process(Path(argv[0]).name, argv, log_path, env=env)
            self._pid = process.pid
        process.wait()
        with self._lock:
            self._pid = None

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            pid = self._pid
        if pid is not None:
            stop_pid(pid, timeout=20.0)


def _check_when_loaded(config_path: Path, env: dict[str, str], directory: Path, stop: threading.Event,
                       commands: _Commands, port: int) -> None:
    """The snapshot sensor loads every table by itself (each partition a run, in the UI); once every
    target asset is loaded (at once on the demo's kept records), the checks run once, so that every
    asset shows them (the `<group>_checks` schedule runs them every hour after that). Progress is
    read from the webserver's GraphQL API, the figures the UI shows: this process does not load
    Dagster itself, which it would hold for the whole demo."""
    from siphon_core import naming
    from siphon_core.config import load_config

    config = load_config(config_path)
    targets = tuple(config.targets.configured())
    wanted = [naming.asset_key_path(target, table.schema_name, table.table_name)
              for table in config.tables for target in targets if table.targets is None or target in table.targets]

    while not stop.wait(15.0):
        if _all_loaded(port, wanted):
            break
    if stop.is_set():
        return
    bin_dir = Path(sys.executable).parent
    commands.run([str(bin_dir / "siphon-dagster"), "check"], env, directory / "checks.log")
    print(f"every table is loaded; the checks ran (results on each asset's Checks tab, lines in "
          f"{directory / 'checks.log'})", flush=True)
    status_log = directory / "status.log"
    commands.run([str(bin_dir / "siphon-dagster"), "status"], env, status_log)
    lines = status_log.read_text().splitlines() if status_log.exists() else []
    if lines and not stop.is_set():
        print(f"siphon-dagster status: {lines[-1]} (every table's line in {status_log})", flush=True)


def _write_forever(dsn: str, rate: float, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            workload.run(dsn, changes_per_second=rate, duration_seconds=5.0)
        except Exception as error:  # keep the demo alive through a transient database error
            if stop.is_set():
                return  # the database is stopping with the demo: not an error to show
            print(f"workload: {error}", file=sys.stderr)
            time.sleep(1.0)


def _all_loaded(port: int, asset_paths: list[list[str]]) -> bool:
    """Whether each asset is loaded, as the webserver counts its partitions: some materialized and
    none in progress or failed. A load's runs count as in progress from the moment the sensor
    queues them; a range that a growing table filled since its load is left to the stream, and
    never materialized. False while the webserver does not answer (asked again at the next look)."""
    query = ("query Loaded($keys: [AssetKeyInput!]) { assetNodes(assetKeys: $keys) { assetKey { path } "
             "partitionStats { numMaterialized numMaterializing numFailed } } }")
    body = json.dumps({"query": query, "variables": {"keys": [{"path": path} for path in asset_paths]}}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            nodes = json.load(response)["data"]["assetNodes"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    stats = {tuple(node["assetKey"]["path"]): node.get("partitionStats") for node in nodes}
    return all((found := stats.get(tuple(path))) and found["numMaterialized"] > 0
               and found["numMaterializing"] == 0 and found["numFailed"] == 0 for path in asset_paths)


if __name__ == "__main__":
    sys.exit(main())

