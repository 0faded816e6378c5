"""deploy/grafana/ cannot run here (no container engine): check that the compose file provisions
the dashboard and its Prometheus, that Prometheus scrapes every service where it serves /metrics,
and that every metric a panel queries is one the code exports."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from tests.deploy.test_manifests import DEPLOY, SERVICES, _check_env, _compose, _compose_services

ROOT = DEPLOY.parent
DASHBOARD = DEPLOY / "grafana/dashboards/infermesh.json"
GRAFANA_PROVISIONING = "/etc/grafana/provisioning"
# What each kind of metric exposes (prometheus_client: a counter's name without _total, + _total)
_SUFFIXES = {
    "Counter": ("_total",),
    "CounterMetricFamily": ("_total",),
    "Gauge": ("",),
    "GaugeMetricFamily": ("",),
    "Histogram": ("_bucket", "_sum", "_count"),
    "HistogramMetricFamily": ("_bucket", "_sum", "_count"),
}
_DEFINITION = re.compile(rf"\b({'|'.join(_SUFFIXES)})\(\s*\"([a-zA-Z_:][\w:]*)\"")
_CODE = ("gateway", "router_svc", "worker_svc", "telemetry", "infermesh")


def exported_metrics() -> set[str]:
    """The series names the services' code exports, from each metric's definition."""
    names = set()
    for package in _CODE:
        for path in (ROOT / package).rglob("*.py"):
            for kind, name in _DEFINITION.findall(path.read_text()):
                base = name.removesuffix("_total") if "Counter" in kind else name
                names |= {base + suffix for suffix in _SUFFIXES[kind]}
    return names


def queried_metrics(expr: str) -> set[str]:
    """The metric names of a PromQL expression: its identifiers that are not functions,
    aggregations' label lists, label matchers, ranges or keywords."""
    expr = re.sub(r'"[^"]*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)  # label matchers, ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    identifiers = re.findall(r"\b([a-zA-Z_:][\w:]*)\b(?!\s*\()", expr)
    return set(identifiers) - {"and", "or", "unless", "bool", "offset", "group_left", "group_right"}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _provisioned(relative: str) -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "grafana/provisioning" / relative).read_text())


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """A compose service's bind mounts, target: source."""
    return {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}


def dashboard_problems(dashboard: dict[str, Any]) -> list[str]:
    """Each panel queries the provisioned Prometheus for metrics the code exports."""
    (datasource,) = _provisioned("datasources/prometheus.yml")["datasources"]
    known = exported_metrics()
    problems = []
    for panel in dashboard["panels"]:
        title = panel["title"]
        if not panel.get("targets"):
            problems.append(f"{title}: no queries")
        for target in panel.get("targets", []):
            for source in (panel.get("datasource"), target.get("datasource")):
                if source and source.get("uid") != datasource["uid"]:
                    problems.append(f"{title}: datasource {source.get('uid')}")
            unknown = queried_metrics(target["expr"]) - known
            if unknown:
                problems.append(f"{title}: queries {sorted(unknown)}, which no code exports")
    return problems


def provisioning_problems(compose: dict[str, Any]) -> list[str]:
    """Grafana mounts the provisioning files and the dashboards' directory where its provider
    looks; its datasource is the compose file's Prometheus, which mounts its config."""
    problems = []
    grafana, prometheus = compose["services"].get("grafana"), compose["services"].get("prometheus")
    if grafana is None or prometheus is None:
        return ["no grafana or prometheus service"]
    mounts = _mounts(grafana)
    if mounts.get(GRAFANA_PROVISIONING) != "./grafana/provisioning":
        problems.append(f"grafana: {GRAFANA_PROVISIONING} is {mounts.get(GRAFANA_PROVISIONING)}")
    (provider,) = _provisioned("dashboards/infermesh.yml")["providers"]
    folder = mounts.get(provider["options"]["path"])
    if folder is None or (DEPLOY / folder / DASHBOARD.name).resolve() != DASHBOARD.resolve():
        problems.append(f"grafana: {provider['options']['path']} holds no {DASHBOARD.name}")
    (datasource,) = _provisioned("datasources/prometheus.yml")["datasources"]
    if datasource["url"] != "http://prometheus:9090":
        problems.append(f"grafana: datasource {datasource['url']} is not the prometheus service")
    if _mounts(prometheus).get("/etc/prometheus/prometheus.yml") != "./prometheus/prometheus.yml":
        problems.append("prometheus: deploy/prometheus/prometheus.yml not mounted")
    return problems


def _metrics_port(module: str, config: Any) -> int:
    """Where Prometheus reads a service's metrics: its [metrics] side port (the gateway's
    API port serves no per-key series)."""
    return int(config.metrics.port)


def scrape_problems(compose: dict[str, Any], prometheus: dict[str, Any]) -> list[str]:
    """Prometheus scrapes exactly the mesh's services, each on its metrics port."""
    ports = {}
    for name, service in _compose_services(compose).items():
        module = service["command"][2]
        env = {k: str(v) for k, v in service["environment"].items() if "$" not in str(v)}
        ports[name] = _metrics_port(module, _check_env(module, env))
    targets = {
        target
        for job in prometheus["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    wanted = {f"{name}:{port}" for name, port in ports.items() if port}
    return [f"not scraped: {t}" for t in sorted(wanted - targets)] + [
        f"scraped, not a service's metrics: {t}" for t in sorted(targets - wanted)
    ]


def _prometheus() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())


def test_the_dashboard_is_a_grafana_json_model_of_the_fleet() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"]
    titles = [panel["title"] for panel in dashboard["panels"]]
    assert len(set(titles)) == len(titles)
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(titles)
    queried = set().union(
        *(queried_metrics(t["expr"]) for p in dashboard["panels"] for t in p["targets"])
    )
    for metric in (  # what the fleet's operators asked to see
        "infermesh_worker_running_sequences",
        "infermesh_worker_queue_depth",
        "infermesh_worker_kv_cache_usage_ratio",
        "infermesh_router_prefix_tokens_saved_total",
        "gen_ai_server_time_to_first_token_seconds_bucket",
        "gen_ai_server_time_per_output_token_seconds_bucket",
        "infermesh_tokens_total",
        "infermesh_router_queue_depth",
        "infermesh_router_queue_wait_seconds_bucket",
        "infermesh_reasoning_tokens_total",  # reasoning tokens per model (#39)
        "infermesh_worker_kv_pull_bytes_total",  # KV cache moved between workers (#35)
        "infermesh_worker_kv_pulls_total",
    ):
        assert metric in queried, metric


def test_every_panel_queries_metrics_the_code_exports() -> None:
    assert dashboard_problems(_dashboard()) == []


def test_the_compose_file_provisions_grafana_and_prometheus() -> None:
    assert provisioning_problems(_compose()) == []


def test_prometheus_scrapes_every_service_on_its_metrics_port() -> None:
    assert {s["command"][2] for s in _compose_services(_compose()).values()} == set(SERVICES)
    assert scrape_problems(_compose(), _prometheus()) == []


def test_the_metric_names_are_read_as_prometheus_exposes_them() -> None:
    exported = exported_metrics()
    assert {"infermesh_requests_total", "infermesh_worker_queue_depth"} <= exported
    assert "gen_ai_server_time_to_first_token_seconds_bucket" in exported
    assert "infermesh_requests" not in exported  # a counter is queried as its _total
    assert queried_metrics(
        'histogram_quantile(0.95, sum by (le, model) (rate(a_bucket{service="x"}[5m]))) / '
        "on (model) group_left sum without (type) (b_total offset 1h)"
    ) == {"a_bucket", "b_total"}


def _made_up_metric(dashboard: dict[str, Any]) -> None:
    dashboard["panels"][0]["targets"][0]["expr"] = "sum by (instance) (infermesh_worker_busyness)"


def _counter_without_total(dashboard: dict[str, Any]) -> None:
    dashboard["panels"][0]["targets"][0]["expr"] = "rate(infermesh_requests[5m])"


def _unknown_datasource(dashboard: dict[str, Any]) -> None:
    dashboard["panels"][0]["datasource"] = {"type": "prometheus", "uid": "elsewhere"}


def _grafana_without_dashboards(compose: dict[str, Any]) -> None:
    volumes = compose["services"]["grafana"]["volumes"]
    volumes[:] = [v for v in volumes if "dashboards" not in v]


def _prometheus_without_config(compose: dict[str, Any]) -> None:
    compose["services"]["prometheus"]["volumes"] = []


def _no_grafana(compose: dict[str, Any]) -> None:
    del compose["services"]["grafana"]


def _router_unscraped(prometheus: dict[str, Any]) -> None:
    prometheus["scrape_configs"] = [
        j for j in prometheus["scrape_configs"] if j["job_name"] != "router"
    ]


def _worker_on_its_grpc_port(prometheus: dict[str, Any]) -> None:
    prometheus["scrape_configs"][-1]["static_configs"][0]["targets"][0] = "worker:50061"


_BAD: list[tuple[Callable[[Any], None], Callable[[], dict[str, Any]], Callable[[Any], list[str]]]]
_BAD = [
    (_made_up_metric, _dashboard, dashboard_problems),
    (_counter_without_total, _dashboard, dashboard_problems),
    (_unknown_datasource, _dashboard, dashboard_problems),
    (_grafana_without_dashboards, _compose, provisioning_problems),
    (_prometheus_without_config, _compose, provisioning_problems),
    (_no_grafana, _compose, provisioning_problems),
    (_router_unscraped, _prometheus, lambda p: scrape_problems(_compose(), p)),
    (_worker_on_its_grpc_port, _prometheus, lambda p: scrape_problems(_compose(), p)),
]


@pytest.mark.parametrize(
    "spoil, document, check", _BAD, ids=[spoil.__name__.strip("_") for spoil, _, _ in _BAD]
)
def test_each_check_catches_a_bad_document(
    spoil: Callable[[Any], None],
    document: Callable[[], dict[str, Any]],
    check: Callable[[Any], list[str]],
) -> None:
    spoiled = copy.deepcopy(document())
    spoil(spoiled)
    assert check(spoiled)
