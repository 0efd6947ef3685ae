"""`siphon-dagster status` as an operator runs it: its own process against a DAGSTER_HOME, exit 0
when no table needs attention, 1 when one does, 2 on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import yaml

from siphon_core.config import parse_config
from siphon_dagster.run_liveness import worker_identity
from siphon_dagster.stream_groups import stream_groups
from tests.unit.test_status import CONFIG, add_run, batch, specs_by_name, state


def run_cli(home: Path, config_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DAGSTER_HOME": str(home), "SIPHON_CONFIG": str(config_path)}
    return subprocess.run([sys.executable, "-m", "siphon_dagster.cli", "status", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_command_exits_1_when_a_table_needs_attention_and_2_on_bad_input(tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    config_path = tmp_path / "siphon.yaml"
    config_path.write_text(yaml.safe_dump({**CONFIG, "streaming": {}}))
    config = parse_config({**CONFIG, "streaming": {}})
    specs = specs_by_name(config)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        groups = {g.job_name: g for g in stream_groups(config, list(specs.values()))}
        # A live run: this test's process stands for its worker.
        add_run(instance, groups["stream_clickhouse"].tags, worker_identity())
        instance.report_runless_asset_event(batch(specs["public.notes"], "clickhouse", 0.4, 0))
        instance.report_runless_asset_event(state(specs["public.notes"], "clickhouse", "loaded"))
    fine = run_cli(home, config_path, "--table", "public.notes", "--target", "clickhouse")
    assert fine.returncode == 0, fine.stdout + fine.stderr
    assert fine.stdout.splitlines()[1].split()[:2] == ["OK", "clickhouse/public/notes"]
    assert fine.stdout.splitlines()[-1] == "0 of 1 table(s) at their targets need attention"
    everything = run_cli(home, config_path, "--problems", "--json")
    assert everything.returncode == 1
    shown = [json.loads(line) for line in everything.stdout.splitlines()]
    assert shown and all(not r["ok"] for r in shown)
    assert "clickhouse/public/notes" not in {r["asset"] for r in shown}
    unknown = run_cli(home, config_path, "--table", "public.nope")
    assert unknown.returncode == 2 and "table public.nope is not in the configuration" in unknown.stderr
    elsewhere = run_cli(home, config_path, "--table", "audit.log", "--target", "snowflake")
    assert elsewhere.returncode == 2 and "audit.log is not replicated to target snowflake" in elsewhere.stderr
    lag = run_cli(home, config_path, "--max-lag-seconds", "0")
    assert lag.returncode == 2 and "--max-lag-seconds must be above 0" in lag.stderr
