"""deploy/ cannot run here (no container engine): check that what the
manifests tell the services (commands, environment, config files, ports)
is what the code reads."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import re
import shutil
import subprocess
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonschema
import pytest
import referencing
import yaml
from opentelemetry.sdk import environment_variables as otel_env

from gateway.config import GatewayConfig
from infermesh.config import env_names, load_config
from router_svc.config import RouterConfig
from router_svc.scaling import SERIES
from worker_svc.config import WorkerConfig
from worker_svc.config import load as load_worker_config
from worker_svc.vllm_engine.args import Devices, engine_args

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# JSON schemas of the kinds no Kubernetes library here validates (KEDA's CRD, autoscaling/v2)
SCHEMAS = Path(__file__).resolve().parent / "schemas"
AUTOSCALER_SCHEMAS = {
    "ScaledObject": "keda-scaledobject-v1alpha1.json",
    "HorizontalPodAutoscaler": "hpa-autoscaling-v2.json",
}
# module → (config class, env prefix); the probe is the health-check helper.
SERVICES = {
    "gateway": (GatewayConfig, "infermesh_gateway"),
    "router_svc": (RouterConfig, "infermesh_router"),
    "worker_svc": (WorkerConfig, "infermesh_worker"),
}
SHARED_ENV = {"INFERMESH_LOG_FORMAT", "INFERMESH_LOG_LEVEL", "POD_NAME"}
# Each service's [tls] section (infermesh's mutual TLS on every gRPC hop).
TLS_KEYS = ("cert_file", "key_file", "ca_file", "plaintext")
WORKLOADS = {"Deployment", "StatefulSet"}
_VLLM_CONFIGS = ["worker-vllm-h200.toml", "worker-vllm-h100x2.toml"]  # configmap keys
# the OpenTelemetry SDK's own variables (its exporter reads the OTLP TLS files)
OTEL_ENV = {
    otel_env.OTEL_EXPORTER_OTLP_ENDPOINT,
    otel_env.OTEL_EXPORTER_OTLP_CERTIFICATE,
    otel_env.OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE,
    otel_env.OTEL_EXPORTER_OTLP_CLIENT_KEY,
    otel_env.OTEL_TRACES_SAMPLER,
    otel_env.OTEL_TRACES_SAMPLER_ARG,
}


def _module(command: list[str]) -> str:
    assert command[:2] == ["python", "-m"], command
    assert command[2] in SERVICES, f"{command[2]} is not a service module"
    return command[2]


def _check_env(module: str, env: dict[str, str]) -> object:
    """Every variable is one the service reads; the values load without error."""
    cls, prefix = SERVICES[module]
    tls = {f"{prefix}_tls_{key}".upper() for key in TLS_KEYS}
    known = env_names(cls, prefix) | tls | {f"{prefix}_CONFIG".upper()} | SHARED_ENV | OTEL_ENV
    unknown = set(env) - known
    assert not unknown, f"{module}: variables no code reads: {sorted(unknown)}"
    overrides = {k: v for k, v in env.items() if "$" not in v}
    return load_config(cls, None, prefix, environ=overrides)


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _k8s() -> list[dict[str, Any]]:
    return [
        doc
        for path in sorted((DEPLOY / "k8s").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _cert_manager() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((DEPLOY / "k8s/optional/cert-manager.yaml").read_text()))


def _workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in WORKLOADS]


def _secret_keys(docs: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Secret name -> its keys: the Secret documents' and those kustomize generates."""
    keys = {d["metadata"]["name"]: set(d["stringData"]) for d in docs if d["kind"] == "Secret"}
    for kustomization in (d for d in docs if d["kind"] == "Kustomization"):
        for generator in kustomization.get("secretGenerator", []):
            keys[generator["name"]] = {f.split("=", 1)[0] for f in generator["files"]}
    return keys


@pytest.fixture(scope="module")
def credentials(tmp_path_factory) -> Path:
    """What deploy/make-secrets.sh writes for a deployment."""
    out = tmp_path_factory.mktemp("secrets")
    subprocess.run(["sh", str(DEPLOY / "make-secrets.sh"), str(out)], check=True)
    return out


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


def _compose_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The mesh's services (each one of SERVICES' modules), by name."""
    return {
        name: s
        for name, s in compose["services"].items()
        if s.get("command", [""])[:2] == ["python", "-m"] and s["command"][2] in SERVICES
    }


def _compose_env(service: dict[str, Any], credentials: Path) -> dict[str, str]:
    """A compose service's environment: its env files (as make-secrets.sh writes them, under
    ./secrets/), then its own."""
    env: dict[str, str] = {}
    for path in service.get("env_file", []):
        assert path.startswith("./secrets/"), path
        env |= _env_file(credentials / Path(path).name)
    return env | {k: str(v) for k, v in service["environment"].items()}


def test_compose_services_read_the_environment_they_are_given(credentials):
    services = _compose_services(_compose())
    envs = {name: _compose_env(s, credentials) for name, s in services.items()}
    configs = {name: _check_env(_module(s["command"]), envs[name]) for name, s in services.items()}
    ports = {name: config.server.port for name, config in configs.items()}
    # its metrics side port too, where it has one (the admin gateway's console reads the router's)
    served = {name: [config.server.port] for name, config in configs.items()}
    for name, config in configs.items():
        if hasattr(config, "metrics"):
            served[name].append(config.metrics.port)
    for name, service in services.items():
        assert str(ports[name]) in " ".join(service["healthcheck"]["test"]), name
        for mapping in service.get("ports", []):
            assert mapping.split(":")[-1] == str(ports[name]), f"{name} publishes {mapping}"
        # every host:port naming another service dials a port that service serves
        for target, port in re.findall(r"\b([a-z-]+):(\d+)\b", " ".join(envs[name].values())):
            if target in ports:
                assert int(port) in served[target], f"{name} dials {target}:{port}"


def test_compose_gpu_worker_reserves_gpus():
    worker = _compose()["services"]["worker-gpu"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


@pytest.mark.parametrize(
    "module, key",
    [
        ("router_svc", "router.toml"),
        ("gateway", "gateway.toml"),
        ("worker_svc", "worker.toml"),
        *(("worker_svc", key) for key in _VLLM_CONFIGS),
    ],
)
def test_configmap_files_load(tmp_path, module, key):
    configmap = next(d for d in _k8s() if d["kind"] == "ConfigMap")
    path = tmp_path / key
    path.write_text(configmap["data"][key])
    cls, prefix = SERVICES[module]
    load_config(cls, path, prefix, environ={})


def test_deployments_match_their_services():
    docs = _k8s()
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    secrets = _secret_keys(docs)
    for deployment in _workloads(docs):
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        if "command" not in container or container["command"][0] == "vllm":  # vLLM's own: see below
            continue
        module = _module(container["command"])
        # a value from a Secret or the pod is known when the pod starts, as a $(reference) is
        env = {e["name"]: e.get("value", "$(valueFrom)") for e in container.get("env", [])}
        for e in container.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets[ref["name"]], ref
        _check_env(module, env)
        config_file = env[f"{SERVICES[module][1]}_CONFIG".upper()]
        assert config_file.startswith("/etc/infermesh/")
        config = load_config(SERVICES[module][0], None, SERVICES[module][1], environ={})
        toml_ports = re.findall(r"port = (\d+)", configmap["data"][Path(config_file).name])
        ports = {p["containerPort"] for p in container["ports"]}
        assert {int(p) for p in toml_ports} <= ports, deployment["metadata"]["name"]
        probe = container["readinessProbe"]
        if "exec" in probe:  # infermesh.probe, which presents the service's certificate
            assert probe["exec"]["command"][:4] == ["python", "-m", "infermesh.probe", "grpc"]
            probe_port = int(probe["exec"]["command"][4].rsplit(":", 1)[1])
        else:
            probe_port = probe["httpGet"]["port"]
        assert probe_port in ports
        assert config is not None
        if module == "worker_svc":
            assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
            assert (
                "nvidia.com/gpu.product" in deployment["spec"]["template"]["spec"]["nodeSelector"]
            )


def _vllm_worker(key: str, tmp_path: Path) -> tuple[WorkerConfig, dict[str, Any]]:
    """The configmap's vLLM worker config, over DeepSeek-V3's config.json, and its Deployment."""
    configmap = next(d for d in _k8s() if d["kind"] == "ConfigMap")
    path = tmp_path / key
    path.write_text(configmap["data"][key])
    config = load_worker_config(str(path))
    checkpoint = tmp_path / "DeepSeek-V3"
    checkpoint.mkdir(exist_ok=True)
    shutil.copy(
        DEPLOY.parent / "worker_svc" / "model" / "configs" / "DeepSeek-V3.json",
        checkpoint / "config.json",
    )
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, path=str(checkpoint))
    )
    deployment = next(
        d
        for d in _workloads(_k8s())
        if any(
            e.get("value", "").endswith(key)
            for e in d["spec"]["template"]["spec"]["containers"][0].get("env", [])
        )
    )
    return config, deployment


@pytest.mark.parametrize("key", _VLLM_CONFIGS)
def test_vllm_workers_fit_their_nodes(tmp_path, key):
    """DeepSeek-V3's FP8 weights over the GPUs the Deployment asks for map onto vLLM's arguments
    without one of the field's errors (FP8 on Hopper, the layout matching the GPUs and nodes)."""
    config, deployment = _vllm_worker(key, tmp_path)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    args = engine_args(config, Devices(gpus, "9.0"), "fp8")
    nodes = args.get("nnodes", 1)
    assert args["tensor_parallel_size"] * args["pipeline_parallel_size"] == gpus * nodes
    assert config.engine.kind == "vllm" and config.quantization.use_native_fp8
    assert "/dev/shm" in {m["mountPath"] for m in container["volumeMounts"]}


def test_the_second_h100_node_runs_vllm_headless_with_node_0_s_sizes(tmp_path):
    config, _ = _vllm_worker("worker-vllm-h100x2.toml", tmp_path)
    args = engine_args(config, Devices(8, "9.0"), "fp8")
    docs = _k8s()
    follower = next(
        d
        for d in _workloads(docs)
        if d["spec"]["template"]["spec"]["containers"][0].get("command", [""])[0] == "vllm"
    )
    container = follower["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    flags = dict(zip(command[4::2], command[5::2], strict=True))
    assert command[:4] == ["vllm", "serve", "/models/DeepSeek-V3", "--headless"]
    assert flags == {
        "--tensor-parallel-size": str(args["tensor_parallel_size"]),
        "--pipeline-parallel-size": str(args["pipeline_parallel_size"]),
        "--max-model-len": str(args["max_model_len"]),
        "--gpu-memory-utilization": str(args["gpu_memory_utilization"]),
        "--nnodes": str(args["nnodes"]),
        "--node-rank": "1",
        "--master-addr": args["master_addr"],
        "--master-port": str(args["master_port"]),
    }
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    # master_addr is a Service selecting node 0's worker pod, which exposes master_port
    service = next(
        d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == args["master_addr"]
    )
    head = next(d for d in _workloads(docs) if d["metadata"]["name"] == args["master_addr"])
    assert (
        service["spec"]["selector"].items()
        <= head["spec"]["template"]["metadata"]["labels"].items()
    )
    assert args["master_port"] in {
        p["containerPort"] for p in head["spec"]["template"]["spec"]["containers"][0]["ports"]
    }


def test_gateway_autoscales_and_services_select_pods():
    docs = _k8s()
    hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "gateway"
    labels = [d["spec"]["template"]["metadata"]["labels"] for d in _workloads(docs)]
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        assert any(selector.items() <= pod.items() for pod in labels), service["metadata"]["name"]


def test_dockerfile_builds_with_the_makefile_targets():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    makefile = (DEPLOY.parent / "Makefile").read_text()
    for target in re.findall(r"RUN make ([\w ]+)", dockerfile):
        for name in target.split():
            assert re.search(rf"^{name}:", makefile, re.M), f"Makefile has no target {name}"


# Locked down: each check returns the problems it finds in the documents it is given, so that a
# made-up bad document shows the check catches what it is for (as tests/test_layers.py does).

NAMESPACE = {"kubernetes.io/metadata.name": "infermesh"}
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
ROLES = {"gateway": "gateway", "router_svc": "router", "worker_svc": "worker"}  # module -> role
TLS_SECRET_FILES = {"cert_file": "tls.crt", "key_file": "tls.key", "ca_file": "ca.crt"}
_REDIS_URL = re.compile(r"\brediss?(\+\w+)?://")
_ANY_PORT = 12345  # a port no policy names: what default deny is for


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who opens a connection: a pod (its labels, its namespace's labels) or the outside."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()
    namespace: tuple[tuple[str, str], ...] = tuple(NAMESPACE.items())
    external: bool = False


# Callers besides the mesh's own pods (which are named by their app label).
SYNTHETIC_CALLERS = [
    Caller("admin-client", (("app", "ops"), ("infermesh.io/admin-client", "true"))),
    Caller("prometheus", (("app.kubernetes.io/name", "prometheus"),), tuple(MONITORING.items())),
    Caller("grafana", (("app.kubernetes.io/name", "grafana"),), tuple(MONITORING.items())),
    Caller("unrelated-pod", (("app", "unrelated"),)),
    Caller("gateway-elsewhere", (("app", "gateway"),), (("kubernetes.io/metadata.name", "dev"),)),
    Caller("internet", external=True),
]
EVERYONE = frozenset(
    {"gateway", "gateway-admin", "router", "worker", "worker-vllm-follower", "redis", "jaeger"}
    | {c.name for c in SYNTHETIC_CALLERS}
)
# (a pod's app label, port) -> who may connect; a port not listed: no one.
ACCESS: dict[tuple[str, int], frozenset[str]] = {
    ("gateway", 8000): EVERYONE,
    ("gateway", 9100): frozenset({"prometheus"}),
    ("gateway-admin", 8000): frozenset({"admin-client"}),
    ("gateway-admin", 9100): frozenset({"prometheus"}),
    ("router", 50051): frozenset({"gateway", "gateway-admin", "worker"}),
    ("router", 9101): frozenset({"prometheus", "gateway-admin"}),  # the console's Fleet page
    ("worker", 50061): frozenset({"gateway", "router"}),
    ("worker", 9102): frozenset({"prometheus"}),
    ("redis", 6379): frozenset({"gateway", "gateway-admin", "router"}),
    ("jaeger", 4317): frozenset({"gateway", "gateway-admin", "router", "worker"}),
    ("jaeger", 16686): frozenset({"prometheus", "grafana"}),
}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels is understood here: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_admits(peer: dict[str, Any], caller: Caller) -> bool:
    if "ipBlock" in peer:  # addresses may be pods' too: taken as open to every caller
        return True
    if caller.external:
        return False
    pods, namespaces = peer.get("podSelector"), peer.get("namespaceSelector")
    if namespaces is None:  # a podSelector alone: pods of the policy's own namespace
        return dict(caller.namespace) == NAMESPACE and _selects(pods or {}, dict(caller.labels))
    return _selects(namespaces, dict(caller.namespace)) and (
        pods is None or _selects(pods, dict(caller.labels))
    )


def reachable(docs: list[dict[str, Any]], pod: dict[str, str], port: int, caller: Caller) -> bool:
    """Whether the namespace's NetworkPolicies let ``caller`` connect to ``pod`` on ``port``."""
    policies = [
        p
        for p in docs
        if p["kind"] == "NetworkPolicy"
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and _selects(p["spec"]["podSelector"], pod)
    ]
    if not policies:
        return True
    for rule in (r for p in policies for r in p["spec"].get("ingress", [])):
        ports = rule.get("ports")
        if ports and not any(p.get("port", port) == port for p in ports):
            continue
        if not rule.get("from") or any(_peer_admits(peer, caller) for peer in rule["from"]):
            return True
    return False


def _pods(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, str], set[int]]]:
    """Workload name -> its pods' labels and container ports."""
    return {
        w["metadata"]["name"]: (
            w["spec"]["template"]["metadata"]["labels"],
            {
                p["containerPort"]
                for c in w["spec"]["template"]["spec"]["containers"]
                for p in c.get("ports", [])
            },
        )
        for w in _workloads(docs)
    }


def _ranks_of_one_engine(pod: dict[str, str], caller: dict[str, str]) -> bool:
    """vLLM's ranks of one multi-node engine (same GPU kind) connect to each other on any port."""
    return pod.get("engine") == caller.get("engine") == "vllm" and pod["gpu"] == caller.get("gpu")


def network_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Every pod, port and caller: reachable exactly as ACCESS says (closed where it says
    nothing), and a pod no policy names is reachable by no one."""
    pods = _pods(docs)
    callers = [Caller(labels["app"], tuple(labels.items())) for labels, _ in pods.values()]
    callers += SYNTHETIC_CALLERS
    targets = [*pods.items(), ("unrelated", ({"app": "unrelated"}, set()))]
    problems = []
    for name, (labels, ports) in targets:
        for port in sorted(ports | {_ANY_PORT}):
            allowed = ACCESS.get((labels["app"], port), frozenset())
            for caller in callers:
                may = reachable(docs, labels, port, caller)
                ranks = _ranks_of_one_engine(labels, dict(caller.labels))
                if may and caller.name not in allowed and not ranks:
                    problems.append(f"{caller.name} can reach {name}:{port}")
                if not may and caller.name in allowed:
                    problems.append(f"{caller.name} cannot reach {name}:{port}")
    return problems


def test_the_admin_gateways_console_reads_a_routers_metrics():
    """The console's Fleet page in Kubernetes: the admin gateway names the router's metrics
    port, which the router's Service publishes and its pods' policy opens to the admin gateway."""
    docs = _k8s()
    admin = _named(docs, "Deployment", "gateway-admin")
    env = _env(_container(admin))["INFERMESH_GATEWAY_CONSOLE_ROUTER_METRICS_URL"]
    url = urlsplit(env["value"])
    assert url.hostname and url.port and url.path == "/metrics"
    service = _named(docs, "Service", url.hostname)
    assert url.port in {p.get("targetPort", p["port"]) for p in service["spec"]["ports"]}
    labels, ports = _pods(docs)[url.hostname]
    assert url.port in ports and service["spec"]["selector"].items() <= labels.items()
    caller = Caller("gateway-admin", tuple(admin["spec"]["template"]["metadata"]["labels"].items()))
    assert reachable(docs, labels, url.port, caller)


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = workload["spec"]["template"]["spec"]["containers"][0]
    return container


def _service_containers(docs: list[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    """(workload name, module, container) of every pod running one of the mesh's services."""
    found = []
    for workload in _workloads(docs):
        container = _container(workload)
        command = container.get("command", [])
        if command[:2] == ["python", "-m"] and command[2] in SERVICES:
            found.append((workload["metadata"]["name"], command[2], container))
    return found


def _config_file(docs: list[dict[str, Any]], module: str, env: dict[str, Any]) -> dict[str, Any]:
    """The TOML file (as a dict) a container's config variable names in the ConfigMap."""
    path = env.get(f"{SERVICES[module][1]}_CONFIG".upper(), {}).get("value", "")
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    text = configmap["data"].get(Path(path).name)
    return tomllib.loads(text) if text else {}


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def admin_problems(docs: list[dict[str, Any]]) -> list[str]:
    """The admin API's credential only in pods no public Service selects."""
    admin_pods = []
    for name, module, container in _service_containers(docs):
        env = _env(container)
        admin = _config_file(docs, module, env).get("admin", {})
        if module == "gateway" and (
            {"INFERMESH_GATEWAY_ADMIN_TOKEN", "INFERMESH_GATEWAY_ADMIN_TOKEN_SHA256"} & set(env)
            or admin.get("token")
            or admin.get("token_sha256")
        ):
            workload = next(w for w in _workloads(docs) if w["metadata"]["name"] == name)
            admin_pods.append((name, workload["spec"]["template"]["metadata"]["labels"]))
    problems = [] if admin_pods else ["no gateway serves the admin API"]
    for service in (d for d in docs if d["kind"] == "Service"):
        public = service["metadata"]["name"] == "gateway" or service["spec"].get("type") in (
            "LoadBalancer",
            "NodePort",
        )
        for name, labels in admin_pods:
            if public and service["spec"]["selector"].items() <= labels.items():
                problems.append(f"public Service {service['metadata']['name']} selects {name}")
    return problems


def _mounted_secret(workload: dict[str, Any], path: str) -> tuple[str, str] | None:
    """(Secret name, its key) of the file at ``path`` in the workload's first container."""
    spec = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in _container(workload).get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret and str(Path(path).parent) == mount["mountPath"]:
            return secret["secretName"], Path(path).name
    return None


def _probe_problems(name: str, command: list[str], files: list[str | None]) -> list[str]:
    """A gRPC health probe must present the service's own certificate: TLS asks every caller
    for one."""
    probe = ["python", "-m", "infermesh.probe", "grpc"]
    if command[: len(probe)] == probe and command[len(probe) + 1 :] != files:
        return [f"{name}: its probe does not present its certificate ({command})"]
    return []


def tls_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Every service has its [tls] files set, from its own role's certificate Secret, and none
    is plaintext."""
    problems = []
    workloads = {w["metadata"]["name"]: w for w in _workloads(docs)}
    for name, module, container in _service_containers(docs):
        role, prefix = ROLES[module], SERVICES[module][1].upper()
        env = _env(container)
        plaintext = env.get(f"{prefix}_TLS_PLAINTEXT", {}).get("value", "false")
        toml_plaintext = _config_file(docs, module, env).get("tls", {}).get("plaintext", False)
        if plaintext.lower() in ("1", "true", "yes", "on") or toml_plaintext:
            problems.append(f"{name}: plaintext")
        for key, secret_key in TLS_SECRET_FILES.items():
            path = env.get(f"{prefix}_TLS_{key.upper()}", {}).get("value")
            if not path:
                problems.append(f"{name}: [tls] {key} not set")
                continue
            mounted = _mounted_secret(workloads[name], path)
            if mounted != (_own_secret(name, role), secret_key):
                problems.append(f"{name}: [tls] {key} {path} is {mounted}, not its own")
        files = [
            env.get(f"{prefix}_TLS_{key.upper()}", {}).get("value") for key in TLS_SECRET_FILES
        ]
        for probe in ("readinessProbe", "livenessProbe"):
            command = container.get(probe, {}).get("exec", {}).get("command", [])
            problems += _probe_problems(name, command, files)
        secrets = {
            v["secret"]["secretName"]
            for v in workloads[name]["spec"]["template"]["spec"].get("volumes", [])
            if "secret" in v
        }
        others = {s for s in secrets if s.startswith("infermesh-tls-")} - {_own_secret(name, role)}
        if others:
            problems.append(f"{name}: mounts another role's certificate {sorted(others)}")
    return problems


def _own_secret(workload: str, role: str) -> str:
    """The certificate Secret a workload's pods mount: its role's, a worker pod's own (its
    StatefulSet's one pod, ``<name>-0``)."""
    return f"infermesh-tls-{workload}-0" if role == "worker" else f"infermesh-tls-{role}"


def _worker_pods(docs: list[dict[str, Any]]) -> list[str]:
    return [f"{name}-0" for name, module, _ in _service_containers(docs) if module == "worker_svc"]


def certificate_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Each role's Secret, and each worker pod's own: kubernetes.io/tls with the CA, from its
    files, or (the alternative) from a cert-manager Certificate naming its SPIFFE URI."""
    problems = []
    generators = {
        g["name"]: g
        for k in docs
        if k["kind"] == "Kustomization"
        for g in k.get("secretGenerator", [])
    }
    certificates = {c["spec"]["secretName"]: c for c in docs if c["kind"] == "Certificate"}
    identities = [(role, role, role) for role in ("gateway", "router", "redis")] + [
        (pod, f"worker/{pod.removeprefix('worker-')}", f"{pod}.workers")
        for pod in _worker_pods(docs)
    ]
    for stem, identity, host in identities:
        secret = f"infermesh-tls-{stem}"
        if secret in generators:
            generator = generators[secret]
            files = dict(f.split("=", 1) for f in generator["files"])
            expected = {
                "tls.crt": f"certs/{stem}.crt",
                "tls.key": f"certs/{stem}.key",
                "ca.crt": "certs/ca.crt",
            }
            if generator.get("type") != "kubernetes.io/tls" or files != expected:
                problems.append(f"{secret}: {generator}")
        if secret in certificates:
            spec = certificates[secret]["spec"]
            if (
                spec.get("uris") != [f"spiffe://infermesh/{identity}"]
                or host not in spec["dnsNames"]
            ):
                problems.append(f"Certificate of {secret} does not name {identity} at {host}")
        if secret not in generators and secret not in certificates:
            problems.append(f"nothing writes {secret}")
    return problems


def redis_problems(docs: list[dict[str, Any]]) -> list[str]:
    """No Redis URL in a ConfigMap; each service's from a Secret; Redis serves TLS only, with
    its ACL users."""
    problems = []
    for configmap in (d for d in docs if d["kind"] == "ConfigMap"):
        for key, text in configmap.get("data", {}).items():
            if _REDIS_URL.search(text):
                problems.append(f"ConfigMap {configmap['metadata']['name']} {key}: a Redis URL")
    for workload in _workloads(docs):
        container = _container(workload)
        for name, entry in _env(container).items():
            if name.endswith("_REDIS_URL") and "secretKeyRef" not in entry.get("valueFrom", {}):
                problems.append(f"{workload['metadata']['name']}: {name} not from a Secret")
        if container.get("image", "").startswith("redis:"):
            args = container.get("args", [])
            flags = dict(zip(args[::2], args[1::2], strict=False))
            if flags.get("--port") != "0" or "--tls-port" not in flags or "--aclfile" not in flags:
                problems.append(f"{workload['metadata']['name']}: Redis not TLS-only with ACLs")
    for name, module, container in _service_containers(docs):
        url_variable = f"{SERVICES[module][1]}_REDIS_URL".upper()
        if module != "worker_svc" and url_variable not in _env(container):
            problems.append(f"{name}: no Redis URL (the default is plaintext, no user)")
    return problems


def redis_url_problems(url: str, user: str, ca_file: str) -> list[str]:
    """A service's Redis URL: TLS, checked against the CA the service mounts, as its own user."""
    parsed = urlsplit(url)
    problems = []
    if parsed.scheme != "rediss":
        problems.append(f"{user}: scheme {parsed.scheme}, not rediss")
    if parsed.username != user or not parsed.password:
        problems.append(f"{user}: not the {user} ACL user with a password")
    if parse_qs(parsed.query).get("ssl_ca_certs") != [ca_file]:
        problems.append(f"{user}: Redis's certificate not checked against {ca_file}")
    return problems


def compose_problems(compose: dict[str, Any]) -> list[str]:
    """Only the gateway publishes a port, its own; everything else sits on the internal network."""
    problems = []
    if not compose["networks"]["mesh"].get("internal"):
        problems.append("network mesh is not internal")
    gateway_port = str(GatewayConfig().server.port)
    for name, service in compose["services"].items():
        for mapping in service.get("ports", []):
            if name != "gateway" or str(mapping).split(":")[-1] != gateway_port:
                problems.append(f"{name} publishes {mapping}")
        networks = set(service.get("networks", []))
        if name != "gateway" and networks - {"mesh"}:
            problems.append(f"{name} is on {sorted(networks - {'mesh'})}")
        if "networks" not in service and service.get("network_mode") != "none":
            problems.append(f"{name} is on the default network")
        if service.get("network_mode") not in (None, "none"):
            problems.append(f"{name}: network_mode {service['network_mode']}")
    return problems


def compose_tls_problems(compose: dict[str, Any]) -> list[str]:
    """Each service's [tls] files set, bind-mounted from its own role's files, none plaintext."""
    problems = []
    holders: dict[str, str] = {}  # a worker certificate -> the service mounting it
    for name, service in _compose_services(compose).items():
        module = service["command"][2]
        role, prefix = ROLES[module], SERVICES[module][1].upper()
        env = {k: str(v) for k, v in service.get("environment", {}).items()}
        if env.get(f"{prefix}_TLS_PLAINTEXT", "false").lower() in ("1", "true", "yes", "on"):
            problems.append(f"{name}: plaintext")
        mounts = dict(v.rsplit(":", 2)[:2] for v in service.get("volumes", []))  # source: target
        by_target = {target: source for source, target in mounts.items()}
        stem = role
        if role == "worker":  # each worker its own identity
            stem = _compose_worker_stem(service) or "worker-?"
            if stem in holders:
                problems.append(f"{name} shares {stem}.crt with {holders[stem]}")
            holders[stem] = name
        sources = {
            "cert_file": f"./certs/{stem}.crt",
            "key_file": f"./certs/{stem}.key",
            "ca_file": "./certs/ca.crt",
        }
        for key, source in sources.items():
            path = env.get(f"{prefix}_TLS_{key.upper()}")
            if not path:
                problems.append(f"{name}: [tls] {key} not set")
            elif by_target.get(path) != source:
                problems.append(
                    f"{name}: [tls] {key} {path} is {by_target.get(path)}, not {source}"
                )
        files = [env.get(f"{prefix}_TLS_{key.upper()}") for key in sources]
        problems += _probe_problems(name, service["healthcheck"]["test"][1:], files)
        keys = {s for s in mounts if s.startswith("./certs/") and s.endswith(".key")}
        if keys - {f"./certs/{stem}.key"}:
            problems.append(f"{name}: mounts {sorted(keys - {f'./certs/{stem}.key'})}")
    return problems


def _compose_worker_stem(service: dict[str, Any]) -> str | None:
    """The worker certificate a compose worker mounts as its own ("worker-NAME"), if any."""
    mounts = dict(v.rsplit(":", 2)[:2] for v in service.get("volumes", []))
    cert = next((s for s, t in mounts.items() if t == "/etc/infermesh-tls/tls.crt"), "")
    match = re.fullmatch(r"\./certs/(worker-[\w.-]+)\.crt", cert)
    return match.group(1) if match else None


def compose_redis_problems(compose: dict[str, Any]) -> list[str]:
    """No Redis URL in any environment (they come from ./secrets/ env files); Redis TLS-only."""
    problems = []
    for name, service in compose["services"].items():
        for key, value in service.get("environment", {}).items():
            if key.endswith("_REDIS_URL") or _REDIS_URL.search(str(value)):
                problems.append(f"{name}: {key} in its environment")
    for name, service in _compose_services(compose).items():
        if service["command"][2] != "worker_svc" and not service.get("env_file"):
            problems.append(f"{name}: no env file with its Redis URL")
    command = " ".join(compose["services"]["redis"]["command"])
    if not all(f in command for f in ("--port 0", "--tls-port", "--aclfile")):
        problems.append("redis: not TLS-only with ACLs")
    return problems


def worker_address_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Each worker pod registers its StatefulSet pod DNS name, which its certificate names."""
    problems = []
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    certificates = {c["spec"]["secretName"]: c for c in docs if c["kind"] == "Certificate"}
    workloads = {w["metadata"]["name"]: w for w in _workloads(docs)}
    for name, module, container in _service_containers(docs):
        if module != "worker_svc":
            continue
        workload = workloads[name]
        governing = services.get(workload["spec"].get("serviceName", ""), {}).get("spec", {})
        if workload["kind"] != "StatefulSet" or governing.get("clusterIP") != "None":
            problems.append(f"{name}: no stable pod DNS name (a StatefulSet, a headless Service)")
            continue
        env = _env(container)
        pod_name = env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {})
        address = env.get("INFERMESH_WORKER_SERVER_ADVERTISE_ADDRESS", {}).get("value", "")
        host = address.rsplit(":", 1)[0]
        if (
            pod_name.get("fieldPath") != "metadata.name"
            or host != f"$(POD_NAME).{workload['spec']['serviceName']}"
        ):
            problems.append(f"{name} advertises {address}, not its pod DNS name")
            continue
        if workload["spec"].get("replicas", 1) != 1:
            problems.append(f"{name}: more than the one pod its Secret is the identity of")
        pod_host = host.replace("$(POD_NAME)", f"{name}-0")
        certificate = certificates.get(_own_secret(name, "worker"), {"spec": {"dnsNames": []}})
        if pod_host not in certificate["spec"]["dnsNames"]:
            problems.append(f"the certificate of {name}-0 does not name {pod_host}")
    return problems


def compose_worker_address_problems(compose: dict[str, Any]) -> list[str]:
    """Each compose worker's advertised host is one its own certificate names (the certs
    service's ``--worker NAME=HOST,...``)."""
    command = " ".join(compose["services"]["certs"]["command"]).split()
    named = {
        f"worker-{name}": set(hosts.split(",")) | {"localhost"}
        for arg, value in itertools.pairwise(command)
        if arg == "--worker"
        for name, _, hosts in [value.partition("=")]
    }
    problems = []
    for name, service in _compose_services(compose).items():
        address = service["environment"].get("INFERMESH_WORKER_SERVER_ADVERTISE_ADDRESS")
        stem = _compose_worker_stem(service)
        if address is not None and address.rsplit(":", 1)[0] not in named.get(stem or "", set()):
            problems.append(f"{name} advertises {address}, which its certificate {stem} lacks")
    return problems


_OTLP_TLS = {
    "OTEL_EXPORTER_OTLP_CERTIFICATE": "ca_file",
    "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": "cert_file",
    "OTEL_EXPORTER_OTLP_CLIENT_KEY": "key_file",
}
_JAEGER_TLS = [
    "--collector.otlp.grpc.tls.enabled=true",
    "--collector.otlp.grpc.tls.client-ca=/etc/jaeger-tls/ca.crt",
    "--collector.otlp.http.tls.enabled=true",
    "--collector.otlp.http.tls.client-ca=/etc/jaeger-tls/ca.crt",
]


def _otlp_env_problems(name: str, prefix: str, env: dict[str, str]) -> list[str]:
    """A service's traces go over TLS to Jaeger, checked against the mesh's CA, with the
    service's own certificate."""
    problems = []
    if not env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").startswith("https://"):
        problems.append(f"{name}: traces in plaintext ({env.get('OTEL_EXPORTER_OTLP_ENDPOINT')})")
    for variable, key in _OTLP_TLS.items():
        if env.get(variable) != env.get(f"{prefix}_TLS_{key.upper()}"):
            problems.append(f"{name}: {variable} is not its [tls] {key}")
    return problems


def otlp_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Traces over mutual TLS: every service's exporter, and Jaeger's collector serving only
    TLS with its certificate from the mesh's CA."""
    problems = []
    for name, module, container in _service_containers(docs):
        env = {k: e.get("value", "") for k, e in _env(container).items()}
        problems += _otlp_env_problems(name, SERVICES[module][1].upper(), env)
    jaeger = _named(docs, "Deployment", "jaeger")
    args = _container(jaeger).get("args", [])
    problems += [f"jaeger: no {flag}" for flag in _JAEGER_TLS if flag not in args]
    if _mounted_secret(jaeger, "/etc/jaeger-tls/tls.crt") != ("infermesh-tls-jaeger", "tls.crt"):
        problems.append("jaeger: its certificate is not infermesh-tls-jaeger")
    return problems


def compose_otlp_problems(compose: dict[str, Any]) -> list[str]:
    """As ``otlp_problems``, for the compose file."""
    problems = []
    for name, service in _compose_services(compose).items():
        env = {k: str(v) for k, v in service.get("environment", {}).items()}
        problems += _otlp_env_problems(name, SERVICES[service["command"][2]][1].upper(), env)
    jaeger = compose["services"]["jaeger"]
    problems += [
        f"jaeger: no {flag}" for flag in _JAEGER_TLS if flag not in jaeger.get("command", [])
    ]
    mounts = dict(v.rsplit(":", 2)[:2] for v in jaeger.get("volumes", []))
    if mounts.get("./certs/jaeger.crt") != "/etc/jaeger-tls/tls.crt":
        problems.append("jaeger: ./certs/jaeger.crt not mounted as its certificate")
    return problems


def _named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _all_k8s() -> list[dict[str, Any]]:
    return _k8s() + _cert_manager()


K8S_CHECKS = {
    "network": network_problems,
    "admin": admin_problems,
    "tls": tls_problems,
    "certificates": certificate_problems,
    "redis": redis_problems,
    "worker address": worker_address_problems,
    "otlp": otlp_problems,
}
COMPOSE_CHECKS = {
    "exposure": compose_problems,
    "tls": compose_tls_problems,
    "redis": compose_redis_problems,
    "worker address": compose_worker_address_problems,
    "otlp": compose_otlp_problems,
}


@pytest.mark.parametrize("check", K8S_CHECKS)
def test_the_kubernetes_manifests_are_locked_down(check):
    assert K8S_CHECKS[check](_all_k8s()) == []


@pytest.mark.parametrize("check", COMPOSE_CHECKS)
def test_the_compose_file_is_locked_down(check):
    assert COMPOSE_CHECKS[check](_compose()) == []


def _open_worker_to_all(docs):
    del _named(docs, "NetworkPolicy", "worker")["spec"]["ingress"][0]["from"]


def _no_default_deny(docs):
    docs.remove(_named(docs, "NetworkPolicy", "default-deny-ingress"))


def _redis_from_workers(docs):
    rule = _named(docs, "NetworkPolicy", "redis")["spec"]["ingress"][0]
    rule["from"].append({"podSelector": {"matchLabels": {"app": "worker"}}})


def _metrics_from_any_namespace(docs):
    rule = _named(docs, "NetworkPolicy", "router")["spec"]["ingress"][1]
    rule["from"] = [{"namespaceSelector": {}}]


def _admin_api_from_anywhere(docs):
    del _named(docs, "NetworkPolicy", "gateway-admin")["spec"]["ingress"][0]["from"]


def _admin_token_on_public_gateway(docs):
    env = _container(_named(docs, "Deployment", "gateway"))["env"]
    env.append({"name": "INFERMESH_GATEWAY_ADMIN_TOKEN_SHA256", "value": "0" * 64})


def _admin_service_public(docs):
    _named(docs, "Service", "gateway-admin")["spec"]["type"] = "LoadBalancer"


def _public_service_selects_admin(docs):
    _named(docs, "Service", "gateway")["spec"]["selector"] = {"app": "gateway-admin"}


def _worker_mounts_router_certificate(docs):
    volumes = _named(docs, "StatefulSet", "worker-h100")["spec"]["template"]["spec"]["volumes"]
    next(v for v in volumes if v["name"] == "tls")["secret"]["secretName"] = "infermesh-tls-router"


def _workers_share_a_certificate(docs):
    volumes = _named(docs, "StatefulSet", "worker-a100")["spec"]["template"]["spec"]["volumes"]
    secret = next(v for v in volumes if v["name"] == "tls")["secret"]
    secret["secretName"] = "infermesh-tls-worker-h100-0"


def _worker_certificate_of_another_pod(docs):
    certificate = next(
        c for c in docs if c["kind"] == "Certificate" and "worker-a100" in c["spec"]["secretName"]
    )
    certificate["spec"]["uris"] = ["spiffe://infermesh/worker/h100-0"]


def _router_plaintext(docs):
    env = _container(_named(docs, "Deployment", "router"))["env"]
    env.append({"name": "INFERMESH_ROUTER_TLS_PLAINTEXT", "value": "true"})


def _gateway_without_ca(docs):
    container = _container(_named(docs, "Deployment", "gateway"))
    container["env"] = [e for e in container["env"] if e["name"] != "INFERMESH_GATEWAY_TLS_CA_FILE"]


def _plaintext_in_toml(docs):
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    configmap["data"]["worker.toml"] += "\n[tls]\nplaintext = true\n"


def _certificate_of_another_role(docs):
    certificate = next(c for c in docs if c["kind"] == "Certificate")
    certificate["spec"]["uris"] = ["spiffe://infermesh/admin"]


def _generated_secret_of_another_role(docs):
    kustomization = next(d for d in docs if d["kind"] == "Kustomization")
    generator = kustomization["secretGenerator"][0]
    generator["files"] = [f.replace("gateway", "router") for f in generator["files"]]


def _redis_url_in_configmap(docs):
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    configmap["data"]["gateway.toml"] += '\n[redis]\nurl = "rediss://gateway:pw@redis:6379/0"\n'


def _redis_url_in_clear(docs):
    container = _container(_named(docs, "Deployment", "router"))
    url = next(e for e in container["env"] if e["name"] == "INFERMESH_ROUTER_REDIS_URL")
    url.pop("valueFrom")
    url["value"] = "redis://redis:6379/0"


def _redis_url_missing(docs):
    container = _container(_named(docs, "Deployment", "gateway"))
    container["env"] = [e for e in container["env"] if e["name"] != "INFERMESH_GATEWAY_REDIS_URL"]


def _redis_plaintext_port(docs):
    container = _container(_named(docs, "Deployment", "redis"))
    container["args"] = [a for a in container["args"] if a not in ("--port", "0")]


def _worker_scaled_past_its_certificate(docs):
    _named(docs, "StatefulSet", "worker-h100")["spec"]["replicas"] = 2


def _worker_advertises_its_ip(docs):
    env = _container(_named(docs, "StatefulSet", "worker-a100"))["env"]
    address = next(e for e in env if e["name"] == "INFERMESH_WORKER_SERVER_ADVERTISE_ADDRESS")
    address["value"] = "$(POD_IP):50061"


def _worker_as_deployment(docs):
    _named(docs, "StatefulSet", "worker-vllm-h200")["kind"] = "Deployment"


def _traces_in_plaintext(docs):
    env = _container(_named(docs, "Deployment", "router"))["env"]
    next(e for e in env if e["name"] == "OTEL_EXPORTER_OTLP_ENDPOINT")["value"] = (
        "http://jaeger:4317"
    )


def _jaeger_without_tls(docs):
    _container(_named(docs, "Deployment", "jaeger"))["args"] = []


def _probe_without_certificate(docs):
    probe = _container(_named(docs, "StatefulSet", "worker-a100"))["readinessProbe"]
    del probe["exec"]["command"][5:]


BAD_K8S = {
    "network": [
        _open_worker_to_all,
        _no_default_deny,
        _redis_from_workers,
        _metrics_from_any_namespace,
        _admin_api_from_anywhere,
    ],
    "admin": [_admin_token_on_public_gateway, _admin_service_public, _public_service_selects_admin],
    "tls": [
        _worker_mounts_router_certificate,
        _workers_share_a_certificate,
        _router_plaintext,
        _gateway_without_ca,
        _plaintext_in_toml,
        _probe_without_certificate,
    ],
    "certificates": [
        _certificate_of_another_role,
        _generated_secret_of_another_role,
        _worker_certificate_of_another_pod,
    ],
    "redis": [
        _redis_url_in_configmap,
        _redis_url_in_clear,
        _redis_url_missing,
        _redis_plaintext_port,
    ],
    "worker address": [
        _worker_scaled_past_its_certificate,
        _worker_advertises_its_ip,
        _worker_as_deployment,
    ],
    "otlp": [_traces_in_plaintext, _jaeger_without_tls],
}


@pytest.mark.parametrize(
    "check, spoil",
    [(check, spoil) for check, spoils in BAD_K8S.items() for spoil in spoils],
    ids=lambda x: getattr(x, "__name__", x).strip("_"),
)
def test_each_kubernetes_check_catches_a_bad_document(check, spoil):
    docs = _all_k8s()
    spoil(docs)
    assert K8S_CHECKS[check](docs)


def _jaeger_ui_published(compose):
    compose["services"]["jaeger"]["ports"] = ["16686:16686"]


def _redis_on_frontend(compose):
    compose["services"]["redis"]["networks"] = ["frontend", "mesh"]


def _mesh_not_internal(compose):
    compose["networks"]["mesh"] = {}


def _worker_on_default_network(compose):
    del compose["services"]["worker"]["networks"]


def _worker_with_gateway_key(compose):
    compose["services"]["worker"]["volumes"].append("./certs/gateway.key:/tmp/gateway.key:ro")


def _compose_workers_share_a_certificate(compose):
    volumes = compose["services"]["worker-gpu"]["volumes"]
    volumes[:] = [v.replace("worker-gpu.", "worker-dev.") for v in volumes]


def _router_without_key(compose):
    del compose["services"]["router"]["environment"]["INFERMESH_ROUTER_TLS_KEY_FILE"]


def _gateway_plaintext(compose):
    compose["services"]["gateway"]["environment"]["INFERMESH_GATEWAY_TLS_PLAINTEXT"] = "true"


def _redis_url_in_environment(compose):
    compose["services"]["router"]["environment"]["INFERMESH_ROUTER_REDIS_URL"] = "redis://redis"


def _gateway_without_env_file(compose):
    del compose["services"]["gateway"]["env_file"]


def _redis_plaintext(compose):
    compose["services"]["redis"]["command"] = ["redis-server"]


def _worker_host_not_in_certificate(compose):
    compose["services"]["worker-gpu"]["environment"][
        "INFERMESH_WORKER_SERVER_ADVERTISE_ADDRESS"
    ] = "gpu-box:50061"


def _compose_traces_without_the_ca(compose):
    del compose["services"]["gateway"]["environment"]["OTEL_EXPORTER_OTLP_CERTIFICATE"]


def _compose_jaeger_without_tls(compose):
    del compose["services"]["jaeger"]["command"]


def _healthcheck_without_certificate(compose):
    compose["services"]["router"]["healthcheck"]["test"][6:] = []


BAD_COMPOSE = {
    "exposure": [
        _jaeger_ui_published,
        _redis_on_frontend,
        _mesh_not_internal,
        _worker_on_default_network,
    ],
    "tls": [
        _worker_with_gateway_key,
        _compose_workers_share_a_certificate,
        _router_without_key,
        _gateway_plaintext,
        _healthcheck_without_certificate,
    ],
    "redis": [_redis_url_in_environment, _gateway_without_env_file, _redis_plaintext],
    "worker address": [_worker_host_not_in_certificate],
    "otlp": [_compose_traces_without_the_ca, _compose_jaeger_without_tls],
}


@pytest.mark.parametrize(
    "check, spoil",
    [(check, spoil) for check, spoils in BAD_COMPOSE.items() for spoil in spoils],
    ids=lambda x: getattr(x, "__name__", x).strip("_"),
)
def test_each_compose_check_catches_a_bad_document(check, spoil):
    compose = _compose()
    spoil(compose)
    assert COMPOSE_CHECKS[check](compose)


@pytest.mark.parametrize("service", ["gateway", "router"])
def test_the_redis_urls_written_are_tls_with_the_service_s_own_user(credentials, service):
    url = (credentials / f"{service}-redis-url").read_text()
    assert redis_url_problems(url, service, "/etc/infermesh-tls/ca.crt") == []
    section = GatewayConfig().redis if service == "gateway" else RouterConfig().redis
    dataclasses.replace(section, url=url)  # the service's own check of a URL accepts it
    assert _env_file(credentials / f"{service}.env") == {
        f"INFERMESH_{service.upper()}_REDIS_URL": url
    }


def test_the_admin_gateway_holds_only_the_admin_token_s_hash(credentials):
    token = (credentials / "admin-token").read_text()
    env = _env_file(credentials / "admin.env")
    config = load_config(GatewayConfig, None, "infermesh_gateway", environ=env)
    assert config.admin.digest() == hashlib.sha256(token.encode()).hexdigest()
    assert token not in (credentials / "admin.env").read_text()


@pytest.mark.parametrize(
    "url",
    [
        "redis://gateway:pw@redis:6379/0?ssl_ca_certs=/etc/infermesh-tls/ca.crt",
        "rediss://redis:6379/0?ssl_ca_certs=/etc/infermesh-tls/ca.crt",
        "rediss://router:pw@redis:6379/0?ssl_ca_certs=/etc/infermesh-tls/ca.crt",
        "rediss://gateway:pw@redis:6379/0",
    ],
)
def test_the_redis_url_check_catches_a_bad_url(url):
    assert redis_url_problems(url, "gateway", "/etc/infermesh-tls/ca.crt")


def test_a_password_rotated_is_written_into_the_urls_again(tmp_path):
    subprocess.run(["sh", str(DEPLOY / "make-secrets.sh"), str(tmp_path)], check=True)
    before = {p.name: p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    subprocess.run(["sh", str(DEPLOY / "make-secrets.sh"), str(tmp_path)], check=True)
    assert {p.name: p.read_text() for p in tmp_path.rglob("*") if p.is_file()} == before
    (tmp_path / "redis-users" / "router").unlink()
    subprocess.run(["sh", str(DEPLOY / "make-secrets.sh"), str(tmp_path)], check=True)
    password = (tmp_path / "redis-users" / "router").read_text()
    assert password != before["router"] and password in (tmp_path / "router-redis-url").read_text()
    assert (tmp_path / "gateway-redis-url").read_text() == before["gateway-redis-url"]
    assert all(p.stat().st_mode & 0o077 == 0 for p in tmp_path.rglob("*"))


def _optional(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s/optional" / name).read_text()) if d]


def _autoscalers() -> list[dict[str, Any]]:
    docs = _k8s() + _optional("keda-workers.yaml") + _optional("hpa-workers.yaml")
    return [d for d in docs if d["kind"] in AUTOSCALER_SCHEMAS]


def _schema_validator(kind: str) -> jsonschema.Draft202012Validator:
    schemas = {
        name: json.loads((SCHEMAS / name).read_text()) for name in AUTOSCALER_SCHEMAS.values()
    }
    registry = referencing.Registry().with_resources(
        (name, referencing.Resource.from_contents(schema)) for name, schema in schemas.items()
    )
    return jsonschema.Draft202012Validator(schemas[AUTOSCALER_SCHEMAS[kind]], registry=registry)


def _schema_problems(doc: dict[str, Any]) -> list[str]:
    errors = _schema_validator(doc["kind"]).iter_errors(doc)
    return [f"{doc['metadata']['name']}: {'/'.join(map(str, e.path))}: {e.message}" for e in errors]


def test_the_autoscalers_validate_against_their_schemas():
    autoscalers = _autoscalers()
    kinds = Counter(d["kind"] for d in autoscalers)
    assert kinds["ScaledObject"] >= 3 and kinds["HorizontalPodAutoscaler"] >= 4, kinds
    assert [p for d in autoscalers for p in _schema_problems(d)] == []


def _queries(doc: dict[str, Any]) -> list[str]:
    """The series an autoscaler reads: its Prometheus queries, or its external metrics."""
    if doc["kind"] == "ScaledObject":
        return [t["metadata"]["query"] for t in doc["spec"]["triggers"]]
    return [
        m["external"]["metric"]["name"] for m in doc["spec"].get("metrics", []) if "external" in m
    ]


def _served(worker_toml: str) -> set[str]:
    model = tomllib.loads(worker_toml).get("model", {})
    return {model["name"]} if "name" in model else set()


def test_each_worker_pool_scales_on_series_the_routers_export():
    workloads = {(d["kind"], d["metadata"]["name"]) for d in _workloads(_k8s())}
    configs = _named(_k8s(), "ConfigMap", "infermesh-config")["data"]
    served = {
        m for name, text in configs.items() if name.startswith("worker") for m in _served(text)
    }
    pools = [d for d in _autoscalers() if d["spec"]["scaleTargetRef"]["name"].startswith("worker")]
    assert {d["kind"] for d in pools} == {"ScaledObject", "HorizontalPodAutoscaler"}
    for doc in pools:
        target = doc["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) in workloads, target
        queries = _queries(doc)
        assert queries, doc["metadata"]["name"]
        for query in queries:
            names = set(re.findall(r"infermesh_[a-z_]+", query))
            assert names and names <= set(SERIES), query
        for model in re.findall(r'model="([^"]+)"', " ".join(queries)):
            assert model in served, model
    rules = _named(_optional("hpa-workers.yaml"), "ConfigMap", "infermesh-prometheus-adapter")
    adapter = yaml.safe_load(rules["data"]["config.yaml"])
    exposed = {r["seriesQuery"].split("{")[0] for r in adapter["externalRules"]}
    hpa_metrics = {q for d in pools if d["kind"] == "HorizontalPodAutoscaler" for q in _queries(d)}
    assert hpa_metrics <= exposed, hpa_metrics - exposed


@pytest.mark.parametrize(
    "kind, spoil, says",
    [
        (
            "ScaledObject",
            lambda d: d["spec"]["triggers"][0]["metadata"].pop("threshold"),
            "threshold",
        ),
        ("ScaledObject", lambda d: d["spec"].update(maxReplicas=3), "maxReplicas"),
        (
            "ScaledObject",
            lambda d: d["spec"]["triggers"][0].update(metricType="Average"),
            "Average",
        ),
        ("ScaledObject", lambda d: d["spec"]["triggers"][0]["metadata"].update(threshold=4), "4"),
        ("HorizontalPodAutoscaler", lambda d: d["spec"].pop("maxReplicas"), "maxReplicas"),
        (
            "HorizontalPodAutoscaler",
            lambda d: d["spec"]["metrics"][0].update(type="Extern"),
            "Extern",
        ),
    ],
)
def test_the_autoscaler_schemas_catch_a_bad_document(kind, spoil, says):
    doc = copy.deepcopy(next(d for d in _autoscalers() if d["kind"] == kind))
    assert _schema_problems(doc) == []
    spoil(doc)
    problems = _schema_problems(doc)
    assert problems and any(says in p for p in problems), problems
