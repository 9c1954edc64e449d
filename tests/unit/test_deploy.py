"""The deployment files agree with Kubernetes, the Compose specification and the code (no broker, no cluster).

- Core Kubernetes manifests validate with kubernetes-validate in strict mode (unknown fields fail).
- Strimzi and KEDA resources (CRDs, unknown to kubernetes-validate) validate against the small schemas below,
  which state the fields of those CRDs these manifests use (unknown fields fail there too).
- docker-compose.yml is parsed by compose-spec (bindings of the Rust ``compose_spec`` crate, a strict parser of
  the Compose specification: unknown keys, bad durations, bad ports and undefined resources fail) and checked
  against its pydantic models, which are generated from the specification's JSON schema. The schema file
  itself is not vendored.
- Consistency with the code: topics equal what ``batchline.kafka.topics`` creates, every command line parses with the
  real CLI, every ``BATCHLINE_*`` variable is a ``KafkaSettings`` field, every job TOML loads, every probe and
  healthcheck asks the paths ``batchline.telemetry.server`` serves on the port given to ``--metrics-port``.
"""

from __future__ import annotations

import copy
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from compose_spec import PyOptions
from compose_spec import parse_duration as compose_duration
from compose_spec.models import ComposeSpecification

from batchline.api.service import api_topic_specs
from batchline.api.settings import KEYS_ENV, KEYS_FILE_ENV, ApiTopics
from batchline.config import JobConfig, KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics, _specs
from batchline.telemetry.server import HEALTH_PATH, METRICS_PATH, READY_PATH
from tests.support.cli import parse_command

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
# Oldest Kubernetes the manifests target, and the newest kubernetes-validate knows.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
CRD_GROUPS = {"kafka.strimzi.io", "keda.sh"}
# A worker's drain on SIGTERM: in-flight records at no less than this rate, then one transaction.
DRAIN_FLOOR_RECORDS_PER_S = 20
# Probes: which path each Kubernetes probe asks, how long a process may take to open its port (importing torch
# and vLLM, CUDA init on a cold node), and how many failed liveness probes it takes to restart a pod.
PROBE_PATHS = {"startupProbe": HEALTH_PATH, "livenessProbe": HEALTH_PATH, "readinessProbe": READY_PATH}
PORT_OPEN_FLOOR_S = {"worker": 300, "streams": 60, "api": 60}
API_VARIABLES = {KEYS_ENV, KEYS_FILE_ENV}  # read by `batchline api` (batchline.api.settings), not KafkaSettings
LIVENESS_FAILURES_FLOOR = 2

# ---------------------------------------------------------------------------------------------- loading


def _kustomization() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for name in _kustomization()["resources"]:
        for doc in yaml.safe_load_all((DEPLOY / name).read_text()):
            if doc:
                docs.append((name, doc))
    return docs


MANIFESTS = _manifests()


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in MANIFESTS if doc["kind"] == kind]


def _one(kind: str, **match: str) -> dict[str, Any]:
    found = [d for d in _of_kind(kind) if all(_get(d, k.replace("__", ".")) == v for k, v in match.items())]
    assert len(found) == 1, f"expected one {kind} matching {match}, found {len(found)}"
    return found[0]


def _get(doc: dict[str, Any], dotted: str) -> Any:
    node: Any = doc
    for part in dotted.split("."):
        node = node[part]
    return node


def _group(doc: dict[str, Any]) -> str:
    api = doc["apiVersion"]
    return api.split("/")[0] if "/" in api else ""


def _containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for dep in _of_kind("Deployment"):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            yield dep, c


def _deployment_of(command: str) -> tuple[dict[str, Any], dict[str, Any]]:
    found = [(d, c) for d, c in _containers() if c["args"][1] == command]
    assert len(found) == 1, f"expected one Deployment running `batchline {command}`"
    return found[0]


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _job_config_from_configmap(tmp_path: Path, job: str) -> JobConfig:
    _, worker = _deployment_of("worker")
    path = tmp_path / "job.toml"
    path.write_text(_configmap_toml(worker))
    return load_job_config(job, path)


def _configmap_toml(container: dict[str, Any]) -> str:
    """The job TOML the container's ``--config`` points at, followed through its volume to the ConfigMap."""
    args = container["args"]
    config_path = Path(args[args.index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    dep, _ = next((d, c) for d, c in _containers() if c is container)
    volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    cm = _one("ConfigMap", metadata__name=volume["configMap"]["name"])
    return str(cm["data"][config_path.name])


JOB = _deployment_of("worker")[1]["args"][2]

# ------------------------------------------------------------------------------ Kubernetes: core resources

CORE = [
    (f"{name}:{doc['kind']}/{doc['metadata']['name']}", doc) for name, doc in MANIFESTS if _group(doc) not in CRD_GROUPS
]


def test_every_manifest_is_core_kubernetes_or_a_known_crd() -> None:
    groups = {_group(doc) for _, doc in MANIFESTS}
    assert groups - CRD_GROUPS <= {"", "apps"}, groups
    assert {doc["kind"] for _, doc in MANIFESTS} >= {
        "Namespace",
        "ConfigMap",
        "Deployment",
        "Kafka",
        "KafkaNodePool",
        "KafkaTopic",
        "ScaledObject",
    }


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("doc", [d for _, d in CORE], ids=[i for i, _ in CORE])
def test_core_manifest_validates_strictly(doc: dict[str, Any], version: str) -> None:
    validated = kubernetes_validate.validate(doc, version, strict=True)  # raises on the first invalid field
    assert validated == kubernetes_validate.utils.major_minor(version)


def test_strict_validation_rejects_an_unknown_field() -> None:
    dep, _ = _deployment_of("worker")
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["containers"][0]["argz"] = ["oops"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest_and_names_the_image() -> None:
    kust = _kustomization()
    assert kust["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and kust["kind"] == "Kustomization"
    on_disk = sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kust["resources"]) == on_disk
    assert kust["namespace"] == _one("Namespace")["metadata"]["name"]
    images = {i["name"] for i in kust["images"]}
    assert {c["image"].split(":")[0] for _, c in _containers()} <= images


# ----------------------------------------------------------------------- Kubernetes: Strimzi and KEDA CRDs

_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {"name": {"type": "string", "pattern": _DNS_SUBDOMAIN}, "labels": _LABELS, "annotations": _LABELS},
}
_CLUSTER_METADATA = {**_METADATA, "required": ["name", "labels"]}
_CLUSTER_METADATA["properties"] = {
    **_METADATA["properties"],
    "labels": {**_LABELS, "required": ["strimzi.io/cluster"]},
}
_RESOURCES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"requests": _LABELS | {"additionalProperties": {"type": ["string", "integer"]}}, "limits": _LABELS},
}
_SCALAR = {"type": ["string", "integer", "number", "boolean"]}


def _resource(api: str, kind: str, metadata: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api},
            "kind": {"const": kind},
            "metadata": metadata,
            "spec": {"type": "object", "additionalProperties": False, **spec},
        },
    }


CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "KafkaTopic": _resource(
        "kafka.strimzi.io/v1beta2",
        "KafkaTopic",
        _CLUSTER_METADATA,
        {
            "required": ["partitions", "replicas"],
            "properties": {
                "topicName": {"type": "string", "pattern": r"^[a-zA-Z0-9._-]{1,249}$"},
                "partitions": {"type": "integer", "minimum": 1},
                "replicas": {"type": "integer", "minimum": 1, "maximum": 32767},
                "config": {"type": "object", "additionalProperties": _SCALAR},
            },
        },
    ),
    "KafkaNodePool": _resource(
        "kafka.strimzi.io/v1beta2",
        "KafkaNodePool",
        _CLUSTER_METADATA,
        {
            "required": ["replicas", "roles", "storage"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "roles": {
                    "type": "array",
                    "minItems": 1,
                    "uniqueItems": True,
                    "items": {"enum": ["controller", "broker"]},
                },
                "storage": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {
                        "type": {"enum": ["jbod", "persistent-claim", "ephemeral"]},
                        "volumes": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["id", "type"],
                                "additionalProperties": False,
                                "properties": {
                                    "id": {"type": "integer", "minimum": 0},
                                    "type": {"enum": ["persistent-claim", "ephemeral"]},
                                    "size": {"type": "string", "pattern": r"^[0-9]+([KMGTPE]i?)?$"},
                                    "class": {"type": "string"},
                                    "deleteClaim": {"type": "boolean"},
                                    "kraftMetadata": {"enum": ["shared"]},
                                },
                            },
                        },
                    },
                },
                "resources": _RESOURCES,
                "jvmOptions": {"type": "object"},
                "template": {"type": "object"},
            },
        },
    ),
    "Kafka": _resource(
        "kafka.strimzi.io/v1beta2",
        "Kafka",
        _METADATA,
        {
            "required": ["kafka"],
            # KRaft with node pools: no ZooKeeper, and replicas/storage live in the KafkaNodePools.
            "properties": {
                "kafka": {
                    "type": "object",
                    "required": ["listeners"],
                    "not": {"anyOf": [{"required": ["replicas"]}, {"required": ["storage"]}]},
                    "properties": {
                        "version": {"type": "string", "pattern": r"^[0-9]+\.[0-9]+\.[0-9]+$"},
                        "metadataVersion": {"type": "string"},
                        "listeners": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "required": ["name", "port", "type", "tls"],
                                "properties": {
                                    "name": {"type": "string", "pattern": r"^[a-z0-9]{1,11}$"},
                                    "port": {"type": "integer", "minimum": 9092, "maximum": 65535},
                                    "type": {
                                        "enum": [
                                            "internal",
                                            "route",
                                            "loadbalancer",
                                            "nodeport",
                                            "ingress",
                                            "cluster-ip",
                                        ]
                                    },
                                    "tls": {"type": "boolean"},
                                },
                            },
                        },
                        "config": {"type": "object", "additionalProperties": _SCALAR},
                    },
                },
                "entityOperator": {
                    "type": "object",
                    "required": ["topicOperator"],
                    "properties": {"topicOperator": {"type": "object"}, "userOperator": {"type": "object"}},
                },
                "kafkaExporter": {"type": "object"},
                "cruiseControl": {"type": "object"},
            },
        },
    ),
    "ScaledObject": _resource(
        "keda.sh/v1alpha1",
        "ScaledObject",
        _METADATA,
        {
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                        },
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            # The CRD types trigger metadata as map[string]string: a bare YAML number fails.
                            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                            "authenticationRef": {"type": "object"},
                        },
                    },
                },
            },
        },
    ),
}

CRDS = [
    (f"{name}:{doc['kind']}/{doc['metadata']['name']}", doc) for name, doc in MANIFESTS if _group(doc) in CRD_GROUPS
]


@pytest.mark.parametrize("doc", [d for _, d in CRDS], ids=[i for i, _ in CRDS])
def test_crd_resource_matches_its_schema(doc: dict[str, Any]) -> None:
    assert doc["kind"] in CRD_SCHEMAS, f"no schema for {doc['kind']}"
    jsonschema.Draft202012Validator(CRD_SCHEMAS[doc["kind"]]).validate(doc)


def test_crd_schemas_reject_a_misspelt_field() -> None:
    topic = copy.deepcopy(_of_kind("KafkaTopic")[0])
    topic["spec"]["partitons"] = topic["spec"].pop("partitions")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(topic, CRD_SCHEMAS["KafkaTopic"])
    scaled = copy.deepcopy(_one("ScaledObject"))
    scaled["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 5
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, CRD_SCHEMAS["ScaledObject"])


def _kafka() -> dict[str, Any]:
    return _one("Kafka")


def _plain_port() -> int:
    ports = [lst["port"] for lst in _kafka()["spec"]["kafka"]["listeners"] if not lst["tls"]]
    assert ports, "the clients connect in plaintext: the Kafka needs a listener without TLS"
    return int(ports[0])


def test_kafka_runs_kraft_with_a_controller_quorum_and_enough_brokers_for_transactions() -> None:
    name = _kafka()["metadata"]["name"]
    pools = _of_kind("KafkaNodePool")
    assert pools and all(p["metadata"]["labels"]["strimzi.io/cluster"] == name for p in pools)
    controllers = sum(p["spec"]["replicas"] for p in pools if "controller" in p["spec"]["roles"])
    brokers = sum(p["spec"]["replicas"] for p in pools if "broker" in p["spec"]["roles"])
    assert controllers % 2 == 1, "a KRaft quorum needs an odd number of controllers"
    config = _kafka()["spec"]["kafka"]["config"]
    assert int(config["transaction.state.log.replication.factor"]) <= brokers
    assert int(config["transaction.state.log.min.isr"]) < int(config["transaction.state.log.replication.factor"])
    for topic in _of_kind("KafkaTopic"):
        assert topic["metadata"]["labels"]["strimzi.io/cluster"] == name
        assert int(config["min.insync.replicas"]) < topic["spec"]["replicas"] <= brokers


# ------------------------------------------------------------------------------------- topics of the job


def _declared_topics() -> dict[str, dict[str, Any]]:
    return {t["spec"].get("topicName", t["metadata"]["name"]): t["spec"] for t in _of_kind("KafkaTopic")}


def test_kafka_topics_are_the_topics_of_the_job(tmp_path: Path) -> None:
    cfg = _job_config_from_configmap(tmp_path, JOB)
    topics = JobTopics(JOB, cfg.retry.tiers)
    declared = _declared_topics()
    api_specs = api_topic_specs(ApiTopics(), declared[ApiTopics().chunks]["partitions"])
    assert sorted(declared) == sorted(topics.all() + ApiTopics().all())
    # The same partitions and configs that `batchline topics create JOB --partitions N` (and `batchline api` for its
    # own topics) gives them.
    for spec in [*_specs(topics, declared[topics.requests]["partitions"]), *api_specs]:
        got = declared[spec.topic]
        assert got["partitions"] == spec.num_partitions, spec.topic
        assert {k: str(v) for k, v in got.get("config", {}).items()}.items() >= (spec.config or {}).items(), spec.topic


def test_kafka_topics_keep_the_partition_and_compaction_rules(tmp_path: Path) -> None:
    topics = JobTopics(JOB, _job_config_from_configmap(tmp_path, JOB).retry.tiers)
    declared = _declared_topics()
    requests = declared[topics.requests]["partitions"]
    for name in [*topics.retries, topics.dlq]:
        assert declared[name]["partitions"] >= requests, f"{name} < {requests} partitions (docs/architecture.md#topics)"
    for name in (topics.runs, topics.ledger):
        assert declared[name]["config"]["cleanup.policy"] == "compact", name


# ---------------------------------------------------------------------------------------- workers and KEDA


def test_worker_requests_one_gpu_and_leaves_replicas_to_keda() -> None:
    dep, worker = _deployment_of("worker")
    assert "replicas" not in dep["spec"], "KEDA owns the worker's replica count"
    resources = worker["resources"]
    assert str(resources["limits"]["nvidia.com/gpu"]) == "1"
    assert str(resources["requests"].get("nvidia.com/gpu", "1")) == "1", "GPU requests must equal limits"
    assert "command" not in worker, "use args: command would replace the image's tini entrypoint"


def test_worker_grace_period_covers_the_drain(tmp_path: Path) -> None:
    dep, _ = _deployment_of("worker")
    cfg = _job_config_from_configmap(tmp_path, JOB)
    transaction_s = KafkaSettings().transaction_timeout_ms / 1000
    drain_s = cfg.batching.max_in_flight_records / DRAIN_FLOOR_RECORDS_PER_S + transaction_s
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain_s


def test_deployments_reach_the_strimzi_bootstrap_service() -> None:
    bootstrap = f"{_kafka()['metadata']['name']}-kafka-bootstrap:{_plain_port()}"
    containers = list(_containers())
    assert {c["args"][1] for _, c in containers} >= {"worker", "streams"}  # never vacuous: both deployments
    for _, container in containers:
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["BATCHLINE_BOOTSTRAP"] == bootstrap


def test_scaled_object_scales_the_worker_on_the_lag_of_its_group() -> None:
    dep, _ = _deployment_of("worker")
    scaled = _one("ScaledObject")["spec"]
    assert scaled["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "kafka"
    meta = trigger["metadata"]
    topics = JobTopics(JOB)
    assert meta["topic"] == topics.requests
    # The worker's group is `J.workers.<fingerprint>` (consumers/worker.py); the fingerprint is filled in at deploy.
    fingerprint = meta["consumerGroup"].removeprefix(topics.worker_group() + ".")
    assert fingerprint and topics.worker_group(fingerprint) == meta["consumerGroup"]
    host, port = meta["bootstrapServers"].rsplit(":", 1)
    assert host.split(".")[0] == f"{_kafka()['metadata']['name']}-kafka-bootstrap" and int(port) == _plain_port()
    assert int(meta["lagThreshold"]) > 0
    assert meta["allowIdleConsumers"] == "false"
    partitions = _declared_topics()[topics.requests]["partitions"]
    assert scaled["minReplicaCount"] <= scaled["maxReplicaCount"] <= partitions, "a worker beyond a partition idles"


# ------------------------------------------------------------------------------------------------- probes


def _metrics_port(argv: list[str]) -> int:
    flag = "--port" if argv[1] == "api" else "--metrics-port"  # the API serves the probes on its own port
    assert flag in argv, f"`{' '.join(argv)}` serves no metrics or probes"
    return int(argv[argv.index(flag) + 1])


@pytest.mark.parametrize("command", ["worker", "streams", "api"])
def test_probes_ask_the_health_paths_on_the_metrics_port(command: str) -> None:
    dep, container = _deployment_of(command)
    port = _metrics_port(container["args"])
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port in named.values()
    for probe, path in PROBE_PATHS.items():
        http = container[probe]["httpGet"]
        assert http["path"] == path, probe
        assert named.get(http["port"], http["port"]) == port, probe
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port) and annotations["prometheus.io/path"] == METRICS_PATH


@pytest.mark.parametrize("command", ["worker", "streams", "api"])
def test_probes_leave_time_to_start_and_never_restart_on_one_slow_answer(command: str) -> None:
    _, container = _deployment_of(command)
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= PORT_OPEN_FLOOR_S[command]
    liveness = container["livenessProbe"]
    assert liveness["failureThreshold"] >= LIVENESS_FAILURES_FLOOR
    assert liveness["timeoutSeconds"] < liveness["periodSeconds"]


# ------------------------------------------------------------------------------------------ docker compose


def test_compose_file_follows_the_compose_specification() -> None:
    text = COMPOSE_FILE.read_text()
    parsed = PyOptions(apply_merge=True).from_yaml(text)  # strict: raises ValueError on anything off-spec
    parsed.validate()
    ComposeSpecification.model_validate(_compose())
    assert set(parsed.service_names()) == {"kafka", "topics", "worker", "streams", "api", "otel-collector", "jaeger"}


def test_compose_parser_rejects_a_misspelt_key() -> None:
    bad = COMPOSE_FILE.read_text().replace("stop_grace_period: 5m", "stop_grace_periode: 5m")
    with pytest.raises(ValueError):
        PyOptions(apply_merge=True).from_yaml(bad)


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def test_compose_kafka_is_a_single_kraft_node_that_supports_transactions() -> None:
    services = _compose()["services"]
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    env = _env(kafka)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"].startswith(f"{env['KAFKA_NODE_ID']}@kafka:")
    for key in ("OFFSETS_TOPIC", "TRANSACTION_STATE_LOG"):
        assert env[f"KAFKA_{key}_REPLICATION_FACTOR"] == "1"
    assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "1"
    advertised = dict(reversed(item.split("://")) for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    for name in ("topics", "worker", "streams", "api"):
        assert _env(services[name])["BATCHLINE_BOOTSTRAP"] in advertised
    assert "healthcheck" in kafka


def test_compose_starts_topics_then_worker_and_streams() -> None:
    services = _compose()["services"]
    assert services["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    for name in ("worker", "streams", "api"):
        assert services[name]["depends_on"]["topics"]["condition"] == "service_completed_successfully"


def test_compose_worker_reserves_a_gpu_and_drains_on_stop(tmp_path: Path) -> None:
    worker = _compose()["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and int(device["count"]) >= 1
    cfg = load_job_config(JOB, _compose_config_file(worker))
    drain_s = (
        cfg.batching.max_in_flight_records / DRAIN_FLOOR_RECORDS_PER_S + KafkaSettings().transaction_timeout_ms / 1000
    )
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert compose_duration(worker["stop_grace_period"]) >= drain_s


@pytest.mark.parametrize("name", ["worker", "streams", "api"])
def test_compose_healthcheck_asks_health_and_readiness_on_the_metrics_port(name: str) -> None:
    service = _compose()["services"][name]
    port = _metrics_port(service["command"])
    check = service["healthcheck"]
    assert check["test"][:3] == ["CMD", "python", "-c"]
    script = check["test"][3]
    assert f"http://127.0.0.1:{port}" in script and HEALTH_PATH in script and READY_PATH in script
    compile(script, "healthcheck", "exec")  # the image's python must be able to run it
    assert any(p.split(":")[-1] == str(port) for p in service["ports"]), "publish the metrics port"


def test_compose_worker_health_waits_out_model_loading() -> None:
    worker = _compose()["services"]["worker"]
    cfg = load_job_config(JOB, _compose_config_file(worker))
    # Unready while the model loads: compose must not call that unhealthy before the worker itself would.
    assert compose_duration(worker["healthcheck"]["start_period"]) >= cfg.telemetry.startup_bound_s


def _compose_config_file(service: dict[str, Any]) -> Path:
    """The host file mounted where the service's ``--config`` points."""
    command = service["command"]
    target = command[command.index("--config") + 1]
    for volume in service["volumes"]:
        source, mounted, *_ = volume.split(":")
        if mounted == target:
            return ROOT / source
    raise AssertionError(f"{target} is not mounted")


def test_compose_worker_exports_traces_to_the_collector_and_jaeger() -> None:
    services = _compose()["services"]
    cfg = load_job_config(JOB, _compose_config_file(services["worker"]))
    assert cfg.telemetry.exporter == "otlp"
    endpoint = re.fullmatch(r"http://([^:/]+):(\d+)/?", cfg.telemetry.otlp_endpoint)
    assert endpoint and endpoint.group(1) in services and endpoint.group(2) == "4318"
    collector = services[endpoint.group(1)]
    config_file = next(v.split(":")[0] for v in collector["volumes"] if v.split(":")[1] in collector["command"][0])
    otel = yaml.safe_load((ROOT / config_file).read_text())
    assert otel["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    (exporter,) = otel["service"]["pipelines"]["traces"]["exporters"]
    assert otel["exporters"][exporter]["endpoint"].split(":")[0] == "jaeger" and "jaeger" in services


# -------------------------------------------------------------------------------- command lines and settings


def _command_lines() -> list[tuple[str, list[str]]]:
    lines = [
        (f"compose:{name}", svc["command"])
        for name, svc in _compose()["services"].items()
        if name in {"topics", "worker", "streams", "api"}
    ]
    lines += [(f"k8s:{dep['metadata']['name']}", c["args"]) for dep, c in _containers()]
    return lines


COMMAND_LINES = _command_lines()


@pytest.mark.parametrize("argv", [a for _, a in COMMAND_LINES], ids=[i for i, _ in COMMAND_LINES])
def test_command_line_parses_with_the_cli(argv: list[str]) -> None:
    name, parsed = parse_command(argv)  # raises on unknown commands or options, bad arguments or values
    assert parsed is not None, argv
    if name == "api":  # every model routes to the job, whose config is given
        assert {m.split("=", 1)[1] for m in parsed.params["model"]} == {JOB}
        assert [c.split("=", 1)[0] for c in parsed.params["config"]] == [JOB]
    else:
        assert parsed.params.get("job") == JOB


def _mentioned_commands() -> list[tuple[str, list[str]]]:
    """``batchline`` commands the comments of the Dockerfile, compose and the manifests show: in backquotes, or run
    by ``docker compose run ... SERVICE batchline ...`` (continuation lines joined)."""
    found = []
    for path in [DOCKERFILE, COMPOSE_FILE, *sorted(DEPLOY.rglob("*.yaml"))]:
        comments = [line.strip()[1:] for line in path.read_text().splitlines() if line.strip().startswith("#")]
        text = "\n".join(comments).replace("\\\n", " ")
        mentions = re.findall(r"`(batchline [^`]+)`", text)
        mentions += re.findall(r"docker compose run .*?\s(batchline [^#\n]+)", text)
        found += [(f"{path.relative_to(ROOT)}:{m.strip()}", shlex.split(m)) for m in mentions]
    return found


MENTIONED = _mentioned_commands()


def test_commands_the_comments_mention_are_found() -> None:
    assert len(MENTIONED) >= 5, MENTIONED  # never vacuous: compose's usage block and the manifests' notes
    assert any(argv[:2] == ["batchline", "submit"] for _, argv in MENTIONED)


@pytest.mark.parametrize("argv", [a for _, a in MENTIONED], ids=[i for i, _ in MENTIONED])
def test_every_command_a_comment_mentions_exists(argv: list[str]) -> None:
    parse_command(argv, strict=False)  # the commands and options exist; arguments may be left out


def _batchline_env() -> list[tuple[str, str]]:
    pairs = [(k, v) for name, svc in _compose()["services"].items() for k, v in _env(svc).items()]
    pairs += [(e["name"], e["value"]) for _, c in _containers() for e in c.get("env", [])]
    return sorted({(k, v) for k, v in pairs if k.startswith("BATCHLINE_")})


def test_every_batchline_variable_is_a_kafka_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    pairs = _batchline_env()
    assert any(k == "BATCHLINE_BOOTSTRAP" for k, _ in pairs)
    assert {k for k, _ in pairs} & API_VARIABLES, "the API's keys come from BATCHLINE_API_KEYS(_FILE)"
    prefix = KafkaSettings.model_config["env_prefix"]
    for key, value in [(k, v) for k, v in pairs if k not in API_VARIABLES]:
        field = key.removeprefix(prefix).lower()
        assert field in KafkaSettings.model_fields, f"{key} is not a KafkaSettings field"
        monkeypatch.setenv(key, value)
        assert str(getattr(KafkaSettings(), field)) == value
        monkeypatch.delenv(key)


# ---------------------------------------------------------------------------------- image and job configs


def test_api_reads_the_job_config_the_worker_reads_and_its_keys_from_a_secret() -> None:
    dep, api = _deployment_of("api")
    _, worker = _deployment_of("worker")
    config_path = api["args"][api["args"].index("--config") + 1].split("=", 1)[1]
    mounts = {m["mountPath"]: m["name"] for m in api["volumeMounts"]}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    worker_config = worker["args"][worker["args"].index("--config") + 1]
    assert Path(config_path).parent == Path(worker_config).parent
    assert volumes[mounts[str(Path(config_path).parent)]]["configMap"] == {"name": "batchline-job-demo"}
    keys_file = {e["name"]: e.get("value") for e in api["env"]}[KEYS_FILE_ENV]
    assert "secret" in volumes[mounts[str(Path(keys_file).parent)]], "API keys belong in a Secret"
    service = _one("Service", metadata__name=dep["metadata"]["name"])
    assert service["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in api["ports"]}


def test_job_configs_load(tmp_path: Path) -> None:
    compose_cfg = load_job_config(JOB, _compose_config_file(_compose()["services"]["worker"]))
    k8s_cfg = _job_config_from_configmap(tmp_path, JOB)
    for cfg in (compose_cfg, k8s_cfg):
        assert cfg.engine.name == "vllm" and cfg.engine.model
        assert cfg.engine.model in DOCKERFILE.read_text(), "the image must carry the job's model"
    # Both deployments run the same job: only where it runs may differ.
    assert compose_cfg.model_dump(exclude={"telemetry"}) == k8s_cfg.model_dump(exclude={"telemetry"})
