"""Declares the checks on every target asset, the job that runs them and their schedule.

One multi-asset check per (table, target) holds the four checks, each runnable alone from the UI or
`siphon-dagster check`; the `<group>_checks` schedule runs every one.
"""

from collections.abc import Iterator, Sequence

import dagster as dg
from dagster._core.definitions.asset_checks.asset_checks_definition import AssetChecksDefinition
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from siphon_core import naming
from siphon_core.config import SiphonConfig, expand_settings
from siphon_dagster.checks import freshness, row_count, row_parity, schema_parity
from siphon_dagster.checks.outcome import CheckContext, loading, result, run_guarded
from siphon_dagster.checks.stream_position import StreamWatch
from siphon_dagster.specs import TableSpec
from siphon_dagster.streaming import metrics as stream_metrics
from siphon_dagster.table_state import snapshot_runs_in_progress

CHECKS = (schema_parity, row_count, row_parity, freshness)
SEVERITIES = {module.NAME: module.SEVERITY for module in CHECKS}
# Checks that compare the table's rows: not run while a snapshot writes block ranges into it.
ROW_CHECKS = frozenset({row_count.NAME, row_parity.NAME})


SECRET_SETTINGS = ("password", "private_key_passphrase", "token")


def checks_job_name(group: str) -> str:
    return f"{group}_checks_job"


def checks_schedule_name(group: str) -> str:
    return f"{group}_checks"


def check_keys(spec: TableSpec, target: str) -> list[dg.AssetCheckKey]:
    return [dg.AssetCheckKey(spec.target_key(target), module.NAME) for module in CHECKS]


def build_table_checks(spec: TableSpec, target: str, config: SiphonConfig) -> dg.AssetChecksDefinition:
    resource_key = f"{target}_target"
    application = config.application_identifier
    slot = config.producer.slot_name or naming.slot_name(application)

    specs = {module.NAME: dg.AssetCheckSpec(module.NAME, asset=spec.target_key(target),
                                            description=module.DESCRIPTION) for module in CHECKS}

    # Built as @multi_asset_check builds it, but with output names of our own: Dagster derives them
    # from the asset key, which keeps the source's spelling (any table name) and need not be a valid name.
    @dg.op(
        name=f"checks_{spec.job_suffix}_{target}",
        out={name: dg.Out(None, is_required=False) for name in specs},
        required_resource_keys={"source", "queue", resource_key},
        description=f"Schema, row count, row parity and freshness of {spec.qualified_name} at {target}.",
    )
    def _checks(context: dg.OpExecutionContext) -> Iterator[dg.AssetCheckResult]:
        if context.run.asset_selection:
            # Dagster adds an asset's checks to a run that materializes it (a partition snapshot from
            # the UI or `dagster asset materialize`): whole-table checks in the middle of a load would
            # only report the load in progress. They run on their own (schedule, UI, CLI, resync).
            context.log.info(f"{spec.qualified_name} at {target}: checks are not run beside a snapshot; "
                             "run them with siphon-dagster check or from the asset's Checks tab")
            return
        resource = getattr(context.resources, resource_key)
        destination = resource.open_target()
        # Whatever the target's settings hold as a secret never appears in a check's message.
        settings = expand_settings(resource.settings, f"targets.{target}")
        secrets = tuple(str(settings[key]) for key in SECRET_SETTINGS if settings.get(key)) + tuple(
            str(value) for value in settings.values() if isinstance(value, str) and "@" in value)
        watch = StreamWatch(
            source_dsn=context.resources.source.dsn, slot=slot,
            subject=naming.table_subject(application, spec.schema, spec.name),
            consumer=naming.consumer_name(target, spec.schema, spec.name),
            make_queue=lambda: context.resources.queue.queue(client_name=f"siphon checks {spec.qualified_name}"))
        check_context = CheckContext(spec, destination, context.resources.source.dsn, watch, config.checks,
                                     context.instance, secrets)
        selected = {key.name for key in context.selected_asset_check_keys}
        stream_metrics.serve(config.streaming.metrics_port, config.streaming.metrics_host)
        # The load of a new or dropped table (or a partition's snapshot from the UI) is in progress.
        snapshots = snapshot_runs_in_progress(context.instance, check_context.asset_key) \
            if selected & ROW_CHECKS else []
        try:
            for module in CHECKS:
                if module.NAME not in selected:
                    continue
                if snapshots and module.NAME in ROW_CHECKS:
                    # The gauge keeps the last comparison: an alert on it must not fire for a load.
                    outcome = loading(snapshots)
                else:
                    outcome = run_guarded(module.NAME, module.check, check_context, module.SEVERITY)
                    stream_metrics.record_check(naming.asset_path_text(target, spec.schema, spec.name), module.NAME,
                                                outcome.passed, module.SEVERITY.value)
                log = context.log.info if outcome.passed else context.log.warning
                log(f"{naming.asset_path_text(target, spec.schema, spec.name)} {module.NAME}: {outcome.summary}")
                yield result(module.NAME, check_context.asset_key, outcome)
        finally:
            destination.close()

    return AssetChecksDefinition.create(node_def=_checks, keys_by_input_name={}, check_specs_by_output_name=specs,
                                        can_subset=True)


def build_asset_checks(specs: Sequence[TableSpec], config: SiphonConfig) -> list[dg.AssetChecksDefinition]:
    return [build_table_checks(spec, target, config) for spec in specs for target in spec.targets]


def build_checks_job(group: str, checks: Sequence[dg.AssetChecksDefinition]) -> UnresolvedAssetJobDefinition:
    keys = [key for definition in checks for key in definition.check_keys]
    return dg.define_asset_job(checks_job_name(group), selection=dg.AssetSelection.checks(*keys),
                               description="Every check of every target asset (siphon-dagster check runs a part).")


def build_checks_schedule(group: str, job: UnresolvedAssetJobDefinition,
                          config: SiphonConfig) -> dg.ScheduleDefinition:
    status = dg.DefaultScheduleStatus.RUNNING if config.checks.enabled else dg.DefaultScheduleStatus.STOPPED
    return dg.ScheduleDefinition(name=checks_schedule_name(group), cron_schedule=config.checks.schedule, job=job,
                                 default_status=status,
                                 description="Runs every check of every target asset (checks: in siphon.yaml).")
