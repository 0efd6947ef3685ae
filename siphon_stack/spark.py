"""An optional Spark Connect server from the pyspark package, so many runs share one JVM."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from siphon_stack.process import StackError, port_accepts, start_process, stop_pid, wait_until

CORES = 2


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def require_java() -> str:
    java = shutil.which("java", path=os.path.join(os.environ.get("JAVA_HOME", ""), "bin") + os.pathsep + os.environ.get("PATH", ""))
    if not java:
        raise StackError("Java 17 is needed by Spark and was not found; install it with "
                         "`apt-get install openjdk-17-jre-headless` or set JAVA_HOME")
    return java


@dataclass
class SparkConnectServer:
    root: Path
    port: int

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.root / "spark-connect.log"

    def start(self, timeout: float = 180.0) -> int:
        require_java()
        home = spark_home()
        self.root.mkdir(parents=True, exist_ok=True)
        jar = next(iter((home / "jars").glob("spark-connect_*.jar")), None)
        if jar is None:
            raise StackError(f"the pyspark package at {home} ships no Spark Connect jar; install pyspark 4 or newer")
        argv = [
            str(home / "bin" / "spark-submit"),
            "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
            "--master", f"local[{CORES}]",
            "--driver-memory", "2g",
            # Micro-batches are small: one shuffle partition per core, as a local driver has, not
            # Spark's default 200 (each a task of Python workers, seconds per batch on two cores).
            "--conf", f"spark.sql.shuffle.partitions={CORES}",
            "--conf", f"spark.default.parallelism={CORES}",
            "--conf", f"spark.connect.grpc.binding.port={self.port}",
            "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
            "--conf", "spark.driver.host=127.0.0.1",
            "--conf", "spark.driver.bindAddress=127.0.0.1",
            "--conf", "spark.ui.enabled=false",
            "--conf", f"spark.sql.warehouse.dir={self.root / 'warehouse'}",
            "--conf", f"spark.local.dir={self.root / 'tmp'}",
            str(jar),
        ]
        # Python workers decode packages with Siphon's own modules: they run in this environment.
        env = {"SPARK_HOME": str(home), "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(self.root),
               "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
        process = start_process("spark-connect", argv, self.log_path, env=env, cwd=self.root)
        wait_until("Spark Connect", lambda: port_accepts(self.port), timeout, pid=process.pid, log_path=self.log_path)
        return process.pid

    @staticmethod
    def stop(pid: int) -> None:
        stop_pid(pid, timeout=30.0)
