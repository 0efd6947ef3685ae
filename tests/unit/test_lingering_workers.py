"""A streaming run that Dagster records as ended while its worker still runs on this host (the
cancellation never reached it) is found, interrupted, then killed, and counts as live meanwhile."""

import subprocess
import sys
import time

import dagster as dg
from dagster._core.test_utils import create_run_for_test

from siphon_core.config import parse_config
from siphon_dagster.run_liveness import WORKER_TAG, worker_identity
from siphon_dagster.sensors import (
    LINGERING_AFTER_END_SECONDS,
    LINGERING_KILL_AFTER_SECONDS,
    _stop_lingering_workers,
)
from siphon_dagster.specs import table_specs
from siphon_dagster.stream_groups import APPLICATION_TAG, lingering_streaming_runs, stream_groups
from tests.helpers.instance import instance_for_test

CONFIG = parse_config({
    "application_identifier": "shop",
    "source": {"dsn": "postgresql://siphon@127.0.0.1:5432/app"},
    "tables": [{"name": "public.notes"}],
    "targets": {"clickhouse": {"url": "http://127.0.0.1:8123"}},
})
# A worker that ignores SIGINT, as a run busy with a batch may for a while: only the kill ends it.
STUBBORN = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


def test_an_ended_run_whose_worker_runs_on_is_interrupted_then_killed() -> None:
    group = stream_groups(CONFIG, table_specs(CONFIG))[0]
    worker = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        with instance_for_test() as instance:
            lingering = create_run_for_test(instance, job_name=group.job_name, status=dg.DagsterRunStatus.CANCELED,
                                            tags={**group.tags, WORKER_TAG: worker_identity(worker.pid)})
            # Ended runs whose workers are gone, or not tagged, are not lingering.
            gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            gone_identity = worker_identity(gone.pid)
            gone.kill()
            gone.wait()
            create_run_for_test(instance, job_name=group.job_name, status=dg.DagsterRunStatus.FAILURE,
                                tags={**group.tags, WORKER_TAG: gone_identity})
            create_run_for_test(instance, job_name=group.job_name, status=dg.DagsterRunStatus.CANCELED, tags=group.tags)
            application = group.tags[APPLICATION_TAG]
            found = lingering_streaming_runs(instance, application, time.time())
            assert [(run.run_id, pid) for run, pid, _ in found] == [(lingering.run_id, worker.pid)]

            context = dg.build_sensor_context(instance=instance)
            state: dict = {}
            # Just after its run ended a worker is on its way out: its tables wait, nothing is sent.
            assert [run.run_id for run in _stop_lingering_workers(context, application, time.time(), state)] \
                == [lingering.run_id]
            assert "lingering" not in state
            now = time.time() + LINGERING_AFTER_END_SECONDS
            live = _stop_lingering_workers(context, application, now, state)
            assert [run.run_id for run in live] == [lingering.run_id]
            assert state["lingering"] == {lingering.run_id: now}
            time.sleep(0.5)
            assert worker.poll() is None  # interrupted, and it ignores that
            live = _stop_lingering_workers(context, application, now + LINGERING_KILL_AFTER_SECONDS, state)
            assert [run.run_id for run in live] == [lingering.run_id]
            assert worker.wait(10) == -9
            assert _stop_lingering_workers(context, application, now + LINGERING_KILL_AFTER_SECONDS + 1, state) == []
            assert "lingering" not in state
    finally:
        worker.kill()
        worker.wait()
