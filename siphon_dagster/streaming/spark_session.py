"""One Spark session per run, reused by every micro-batch.

Local mode (the default) runs a small in-process Spark tuned to start fast and to suit batches of
thousands of rows, not terabytes: one shuffle partition per core instead of 200, no UI, loopback
only. With `SparkConfig.remote` (or SIPHON_SPARK_REMOTE) set to an `sc://host:port` URL the run is a
thin Spark Connect client instead, so many runs share one JVM (see DESIGN.md, section 4). The
Python workers of a remote server need the `siphon` package installed: the decode step
(siphon_dagster.streaming.decode) runs there.

Both kinds are built by dagster-pyspark's `LazyPySparkResource` from Spark properties
(`spark_properties`): `spark.master` for a driver in this process, `spark.remote` for a Spark
Connect client (pyspark 3.4 and later make a Connect session of a builder given `spark.remote`).
What it does not do stays here: the cap on local task slots (hence Python workers), the
environment of a local driver, bounded Connect retries, the warm-up, and one session per process
made again when it was stopped.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dagster_pyspark import LazyPySparkResource
from pyspark.sql import SparkSession

from siphon_core.config import SparkConfig
from siphon_core.logs import get_logger
from siphon_dagster.streaming.spark_plan import warm_up

REMOTE_ENVIRONMENT_VARIABLE = "SIPHON_SPARK_REMOTE"
# Waits of 0.05, 0.2, 0.8, 3.2 and 12.8 s, then 15 s: about two minutes in all.
CONNECT_RETRIES = 12
CONNECT_MAX_BACKOFF_MS = 15_000
_log = get_logger("streaming.spark")
# pyspark checks the pandas version on every Arrow call (mapInArrow, toArrow) and warns about
# pandas 3 each time; Siphon's Spark work never converts to or from pandas, only Arrow.
warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
_lock = threading.Lock()
_session: SparkSession | None = None
_remote = False  # whether the session is a Spark Connect client
_users = 0  # blocks of `in_use` running now
_last_used = 0.0  # monotonic time a block of `in_use` last ended

# Settings a session may change at run time; they apply to local and remote sessions alike.
_RUNTIME_DEFAULTS = {"spark.sql.execution.arrow.pyspark.enabled": "true"}
# Settings fixed when a driver starts in this process.
_DRIVER_DEFAULTS = {
    "spark.app.name": "siphon-streaming",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.ui.retainedExecutions": "1",
    "spark.python.worker.reuse": "true",
}
_LOCAL_DEFAULTS = {
    "spark.driver.memory": "1g",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    # C1-only JIT and the serial collector: the first batch comes about 40% sooner (6 s instead of
    # 8-12 s on 2 cores), and a local run is short-lived or small; a long-lived production run goes
    # through Spark Connect, whose server chooses its own JVM options. The heap is sized at start
    # with a young generation large enough for a batch's buffers: growing it, the first batches
    # paid for full collections (about a third more JVM time for a backlog).
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xms1g -Xmn384m",
}


def remote_url(config: SparkConfig) -> str | None:
    return config.remote or os.environ.get(REMOTE_ENVIRONMENT_VARIABLE) or None


def local_cores(master: str) -> int:
    match = re.fullmatch(r"local\[(\d+|\*)(?:,\d+)?\]", master.strip())
    if match is None:
        return 1 if master.strip() == "local" else 2
    return (os.cpu_count() or 2) if match.group(1) == "*" else int(match.group(1))


def get_spark_session(config: SparkConfig | None = None) -> SparkSession:
    """The process's session, created on first use with `config` (later calls reuse it while it lives)."""
    global _session, _remote, _last_used
    config = config or SparkConfig()
    with _lock:
        if _session is not None and _is_alive(_session):
            return _session
        started = time.perf_counter()
        remote = remote_url(config)
        _remote, _last_used = bool(remote), time.monotonic()
        if not remote:
            _prepare_driver_environment(config)
        _session = LazyPySparkResource(spark_config=spark_properties(config)).spark_session
        if remote:
            _bound_connect_retries(_session)
        else:
            _session.sparkContext.setLogLevel("WARN")
        warm_up(_session)
        _log.info("spark session ready", mode="connect" if remote else config.master,
                  seconds=round(time.perf_counter() - started, 2))
        return _session


def stop_spark_session() -> None:
    global _session
    with _lock:
        if _session is not None:
            _session.stop()
            _session = None


@contextmanager
def in_use(get: Callable[[], SparkSession]) -> Iterator[SparkSession]:
    """The session `get` returns, which `stop_if_idle` leaves alone until the block ends."""
    global _users, _last_used
    with _lock:
        _users += 1
    try:
        yield get()
    finally:
        with _lock:
            _users -= 1
            _last_used = time.monotonic()


def stop_if_idle(idle_seconds: float) -> bool:
    """Stops a local session that no batch has used for `idle_seconds` (0: never), and its JVM, whose
    Python workers end with it: a run whose large batches were a backlog does not keep a few hundred
    MB for small ones. The next large batch starts a session again. A Spark Connect client, which
    holds no JVM here, is left alone. Whether it stopped one."""
    global _session
    with _lock:
        if _session is None or _remote or _users or idle_seconds <= 0:
            return False
        idle = time.monotonic() - _last_used
        if idle < idle_seconds:
            return False
        try:
            _session.stop()
        finally:
            _session = None
            _shut_down_jvm()
    _log.info("spark session stopped", idle_seconds=round(idle))
    return True


def _shut_down_jvm() -> None:
    """Ends the JVM pyspark started for this process; pyspark keeps it for the process's life
    otherwise, and starts another for the next session once its gateway is cleared."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway  # noqa: SLF001 - pyspark offers no other way to let the JVM go
    if gateway is None:
        return
    with contextlib.suppress(Exception):
        gateway.shutdown()
    process = getattr(gateway, "proc", None)
    if process is not None:
        # The JVM's gateway server exits when its standard input closes.
        with contextlib.suppress(Exception):
            process.stdin.close()
            process.wait(timeout=30)
    SparkContext._gateway = None  # noqa: SLF001
    SparkContext._jvm = None  # noqa: SLF001


def spark_properties(config: SparkConfig) -> dict[str, str]:
    """The Spark properties a session is built with: `spark.remote` and the runtime settings for a
    Spark Connect client; otherwise `spark.master` (`local[N]` by default, or any master Spark
    accepts) and the driver's settings. `config.conf` comes last and wins."""
    remote = remote_url(config)
    if remote:
        if not remote.startswith("sc://"):
            raise ValueError(f"spark.remote must be a Spark Connect URL like sc://host:15002, got {remote!r}")
        return {"spark.remote": remote, **_RUNTIME_DEFAULTS, **config.conf}
    settings = {**_DRIVER_DEFAULTS, **_RUNTIME_DEFAULTS}
    master = config.master
    if master.startswith("local"):
        # One task per core, not Spark's default 200 partitions; every table of a group run shares
        # these task slots, so their Python workers are capped together.
        slots = local_cores(master)
        if config.max_python_workers is not None and slots > config.max_python_workers:
            slots = config.max_python_workers
            master = f"local[{slots}]"
        cores = str(slots)
        settings |= {**_LOCAL_DEFAULTS, "spark.sql.shuffle.partitions": cores, "spark.default.parallelism": cores}
    return {"spark.master": master, **settings, **config.conf}


def _prepare_driver_environment(config: SparkConfig) -> None:
    # Python workers must run this interpreter (its venv has pyarrow, zstandard and siphon_core);
    # Spark reads the variable, not a configuration key, when it forks them.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if config.master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def _bound_connect_retries(session: SparkSession) -> None:
    from pyspark.sql.connect.client.retries import DefaultPolicy  # the Spark Connect client's modules

    # The client's own retries wait up to about 10 minutes for an unreachable server on every call;
    # a streaming run then looks alive to the sensor for that long. About 2 minutes, then the run
    # fails, the sensor says so and starts another (which finds a restarted server).
    session.client.set_retry_policies([DefaultPolicy(max_retries=CONNECT_RETRIES, max_backoff=CONNECT_MAX_BACKOFF_MS)])


def _is_alive(session: SparkSession) -> bool:
    if getattr(session, "is_stopped", False):  # Spark Connect
        return False
    context = getattr(session, "_sc", None)
    return context is None or context._jsc is not None  # a stopped local context has no JVM side
