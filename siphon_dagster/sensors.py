"""Sensors: block-range partitions kept current as tables grow, and streaming runs kept alive."""


import json

import dagster as dg

from siphon_dagster import source
from siphon_dagster.assets import observe_source
from siphon_dagster.partitions import missing_keys
from siphon_dagster.resources import PostgresResource
from siphon_dagster.specs import TableSpec


def partition_requests(instance: dg.DagsterInstance, connection, specs: list[TableSpec]
                       ) -> tuple[list[dg.AddDynamicPartitionsRequest], dict[str, int]]:
    """The ranges missing from the instance for each table, and each table's block count."""
    requests = []
    blocks: dict[str, int] = {}
    for spec in specs:
        size = source.table_size(connection, spec.table)
        blocks[spec.qualified_name] = size.blocks
        existing = instance.get_dynamic_partitions(spec.partitions_def_name)
        keys = missing_keys(existing, size.blocks, spec.table.blocks_per_partition)
        if keys:
            requests.append(dg.AddDynamicPartitionsRequest(partitions_def_name=spec.partitions_def_name,
                                                           partition_keys=keys))
    return requests, blocks


def build_partitions_sensor(specs: list[TableSpec], group: str) -> dg.SensorDefinition:
    @dg.sensor(
        name=f"{group}_partitions",
        minimum_interval_seconds=60,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Adds the block-range partitions of tables that grew and observes each source table "
                    "(size, row estimate, LSN). The cursor holds each table's block count at the last tick.",
        required_resource_keys={"source"},
    )
    def _partitions(context: dg.SensorEvaluationContext) -> dg.SensorResult | dg.SkipReason:
        resource: PostgresResource = context.resources.source
        with resource.connect() as connection:
            requests, blocks = partition_requests(context.instance, connection, specs)
            observations = [observe_source(spec, connection) for spec in specs]
        cursor = json.dumps(blocks, sort_keys=True)
        added = sum(len(r.partition_keys) for r in requests)
        if added:
            context.log.info(f"adding {added} block-range partitions")
        return dg.SensorResult(dynamic_partitions_requests=requests, asset_events=observations, cursor=cursor)

    return _partitions
