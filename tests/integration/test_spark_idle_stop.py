"""A local Spark session idle for `spark.idle_stop_seconds` is stopped with its JVM, never while a
batch holds it, and the next batch starts another. Run in a process of its own: other tests of
this process keep their sessions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]

SCRIPT = '''
import time
from pyspark import SparkContext
from siphon_core.config import SparkConfig
from siphon_dagster.streaming import spark_session

config = SparkConfig(master="local[1]")
def get():
    return spark_session.get_spark_session(config)

with spark_session.in_use(get) as spark:
    assert spark.range(5).count() == 5
    jvm = SparkContext._gateway.proc
    time.sleep(0.2)
    assert not spark_session.stop_if_idle(0.05), "stopped while a batch held it"
assert not spark_session.stop_if_idle(3600), "stopped before it was idle for long"
assert not spark_session.stop_if_idle(0), "0 means never"
time.sleep(0.2)
assert spark_session.stop_if_idle(0.05)
assert jvm.wait(timeout=30) is not None, "the JVM outlived its session"
assert not spark_session.stop_if_idle(0.05), "nothing left to stop"
with spark_session.in_use(get) as spark:
    assert spark.range(7).count() == 7
    assert SparkContext._gateway.proc.pid != jvm.pid
spark_session.stop_spark_session()
print("idle stop ok")
'''


def test_an_idle_local_session_is_stopped_with_its_jvm_and_started_again_on_demand() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          cwd=REPOSITORY, env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
    assert done.returncode == 0 and "idle stop ok" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]

