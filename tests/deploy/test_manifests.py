"""deploy/ cannot run here (no container engine): check that what the
manifests tell the services (commands, environment, config files, ports)
is what the code reads."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import GatewayConfig
from infermesh.config import env_names, load_config
from router_svc.config import RouterConfig
from worker_svc.config import WorkerConfig
from worker_svc.config import load as load_worker_config
from worker_svc.vllm_engine.args import Devices, engine_args

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
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
OTEL_ENV = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"}


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
    ports = {
        name: _check_env(_module(s["command"]), envs[name]).server.port
        for name, s in services.items()
    }
    for name, service in services.items():
        assert str(ports[name]) in " ".join(service["healthcheck"]["test"]), name
        for mapping in service.get("ports", []):
            assert mapping.split(":")[-1] == str(ports[name]), f"{name} publishes {mapping}"
        # every host:port naming another service dials the port that service serves
        for target, port in re.findall(r"\b([a-z-]+):(\d+)\b", " ".join(envs[name].values())):
            if target in ports:
                assert int(port) == ports[target], f"{name} dials {target}:{port}"


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
