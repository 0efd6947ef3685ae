"""A typed spec per replicated table: every name the Dagster side derives for it, in one place."""

from __future__ import annotations

import re
from dataclasses import dataclass

import dagster as dg

from siphon_core import naming
from siphon_core.config import SiphonConfig, StreamingConfig, TableConfig
from siphon_dagster.partitions import block_partitions, partitions_def_name


def group_name(application_identifier: str) -> str:
    return "siphon_" + re.sub(r"[^A-Za-z0-9_]", "_", application_identifier)


@dataclass(frozen=True)
class TableSpec:
    application_identifier: str
    table: TableConfig
    targets: tuple[str, ...]
    streaming: StreamingConfig = StreamingConfig()

    @property
    def schema(self) -> str:
        return self.table.schema_name

    @property
    def name(self) -> str:
        return self.table.table_name

    @property
    def qualified_name(self) -> str:
        return self.table.name

    @property
    def source_key(self) -> dg.AssetKey:
        return dg.AssetKey(naming.asset_key_path("postgres", self.schema, self.name))

    def target_key(self, target: str) -> dg.AssetKey:
        return dg.AssetKey(naming.asset_key_path(target, self.schema, self.name))

    @property
    def group(self) -> str:
        return group_name(self.application_identifier)

    @property
    def partitions_def(self) -> dg.DynamicPartitionsDefinition:
        return block_partitions(self.application_identifier, self.schema, self.name)

    @property
    def partitions_def_name(self) -> str:
        return partitions_def_name(self.application_identifier, self.schema, self.name)

    @property
    def job_suffix(self) -> str:
        return naming.job_suffix(self.schema, self.name)

    def stream_job_name(self, target: str) -> str:
        return naming.stream_job_name(target, self.schema, self.name)

    @property
    def resync_job_name(self) -> str:
        return naming.resync_job_name(self.schema, self.name)

    @property
    def tags(self) -> dict[str, str]:
        return {"siphon/application": re.sub(r"[^A-Za-z0-9_.-]", "_", self.application_identifier)}


def table_specs(config: SiphonConfig) -> list[TableSpec]:
    targets = tuple(config.targets.configured())
    if not targets:
        raise ValueError("targets: configure at least one target (clickhouse or snowflake) in siphon.yaml")
    specs = [TableSpec(config.application_identifier, table,
                       tuple(t for t in targets if table.targets is None or t in table.targets), config.streaming)
             for table in config.tables]
    job_names: dict[str, str] = {}
    for spec in specs:
        # Different tables can collapse to one job name (`a.b` and `a_b`); refuse clearly.
        other = job_names.setdefault(spec.job_suffix, spec.qualified_name)
        if other != spec.qualified_name:
            raise ValueError(f"tables {other} and {spec.qualified_name} would share the job names "
                             f"stream_<target>_{spec.job_suffix}; rename one or replicate them in separate "
                             "applications")
    return specs
