"""The chart's monitoring: the PrometheusRule checked and unit-tested by promtool, the Grafana
dashboard and the rules checked against the metric names the code exports, the ServiceMonitor
against the Service it must find."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.telemetry.metrics import Metrics
from tests.integration.test_deploy import CHART, VARIANTS, render

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = CHART / "dashboards" / "retry-sidecar.json"
ALERTS_TEST = ROOT / "tests" / "promtool" / "alerts_test.yaml"
NAME = re.compile(r"\bretry_sidecar_[a-z_]+\b")
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def exported() -> dict[str, str]:
    """Metric name -> type, from what the code's registry renders."""
    out = {}
    for line in Metrics().render().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            out[name] = kind
    return out


def unknown_names(exprs: list[str]) -> set[str]:
    """Names used in the expressions that the code does not export."""
    known = exported()
    bad = set()
    for expr in exprs:
        for name in NAME.findall(expr):
            base = name
            for suffix in HISTOGRAM_SERIES:
                if name.endswith(suffix) and known.get(name[: -len(suffix)]) == "histogram":
                    base = name[: -len(suffix)]
            if base not in known or (known[base] == "histogram" and base == name):
                bad.add(name)
    return bad


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_exprs(d: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in d["templating"]["list"] if v["type"] == "query"]
    return exprs


def monitoring_docs() -> dict[str, list[dict[str, Any]]]:
    docs: dict[str, list[dict[str, Any]]] = {}
    for d in render(VARIANTS["monitoring"]):
        docs.setdefault(d["kind"], []).append(d)
    return docs


def rules() -> list[dict[str, Any]]:
    [rule] = monitoring_docs()["PrometheusRule"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def test_the_checker_catches_a_renamed_metric():
    assert unknown_names(['rate(retry_sidecar_requests_total{route="a"}[5m])']) == set()
    assert unknown_names(["retry_sidecar_request_duration_seconds_bucket"]) == set()
    assert unknown_names(["rate(retry_sidecar_request_totals[5m])"]) == {
        "retry_sidecar_request_totals"
    }
    assert unknown_names(["retry_sidecar_requests_total_bucket"]) == {
        "retry_sidecar_requests_total_bucket"
    }
    assert unknown_names(["retry_sidecar_request_duration_seconds"]) == {
        "retry_sidecar_request_duration_seconds"  # a histogram has no bare series
    }


def test_dashboard_uses_only_exported_metrics_and_all_of_them():
    exprs = dashboard_exprs(dashboard())
    assert unknown_names(exprs) == set()
    used = {n for e in exprs for n in NAME.findall(e)}
    used_bases = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    assert set(exported()) - used_bases == set()  # every metric has a panel


def test_alert_rules_use_only_exported_metrics():
    exprs = [r["expr"] for g in rules() for r in g["rules"]]
    assert len(exprs) == 12 and unknown_names(exprs) == set()


def alerts(values: dict[str, Any]) -> list[dict[str, Any]]:
    [rule] = [d for d in render(values) if d["kind"] == "PrometheusRule"]
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def test_each_alert_links_its_runbook_section():
    """monitoring.runbookBaseUrl set: every alert carries a runbook_url to its own section of
    docs/incidents.md (a heading with that explicit id); unset (the default): none does."""
    assert [
        r["alert"] for r in alerts(VARIANTS["monitoring"]) if "runbook_url" in r["annotations"]
    ] == []
    values = {**VARIANTS["monitoring"]}
    values["monitoring"] = {
        **values["monitoring"],
        "runbookBaseUrl": "https://docs.example.com/rs/",
    }
    page = (ROOT / "docs" / "incidents.md").read_text()
    ids = set(re.findall(r"^#+ .*\{#([a-z0-9-]+)\}$", page, re.MULTILINE))
    found = alerts(values)
    assert len(found) >= 11
    for r in found:
        anchor = r["alert"].lower()
        assert r["annotations"]["runbook_url"] == f"https://docs.example.com/rs/incidents/#{anchor}"
        assert anchor in ids, r["alert"]


def test_runbook_base_url_must_be_a_url():
    import helm_python as helm

    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError):
        chart.validate_schema(chart.merge_values({"monitoring": {"runbookBaseUrl": "docs"}}))


def test_dashboard_shape():
    d = dashboard()
    assert d["uid"] == "retry-sidecar" and d["title"] == "retry-sidecar"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "pod", "route"} <= set(variables)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs))


def test_everything_is_off_by_default_and_the_dashboard_ships_as_is():
    kinds = {d["kind"] for d in render({})}
    assert not kinds & {"ServiceMonitor", "PrometheusRule"}
    assert [d for d in render({}) if d["metadata"]["name"].endswith("-dashboard")] == []
    [cm] = [
        d for d in monitoring_docs()["ConfigMap"] if d["metadata"]["name"].endswith("-dashboard")
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["retry-sidecar.json"]) == dashboard()
    assert len(DASHBOARD.read_bytes()) < 256 * 1024  # within a ConfigMap's comfortable size


def test_the_service_monitor_finds_every_pods_admin_port():
    docs = monitoring_docs()
    [sm] = docs["ServiceMonitor"]
    [svc] = [s for s in docs["Service"] if s["metadata"]["name"].endswith("-admin")]
    [workload] = docs["StatefulSet"]
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    [endpoint] = sm["spec"]["endpoints"]
    [port] = svc["spec"]["ports"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    pod = workload["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    containers = pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
    ports = {p["name"]: p for c in containers for p in c.get("ports", [])}
    assert ports[port["targetPort"]]["containerPort"] == port["port"]
    # The alerts select the series of this release by the job the ServiceMonitor gives them
    # (the Service's name).
    job = f'job="{svc["metadata"]["name"]}"'
    assert all(job in r["expr"] for g in rules() for r in g["rules"])


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return found


def test_rules_pass_promtool_check_and_unit_tests(tmp_path):
    tool = promtool()
    (tmp_path / "rules.yaml").write_text(
        yaml.safe_dump({"groups": rules()}, sort_keys=False, width=1000)
    )
    shutil.copy(ALERTS_TEST, tmp_path / "alerts_test.yaml")
    check = subprocess.run(
        [tool, "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 12 rules found" in check.stdout
    test = subprocess.run(
        [tool, "test", "rules", "alerts_test.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert test.returncode == 0, test.stdout + test.stderr
    # Every alert of the rule file is exercised by the unit tests.
    tested = set(re.findall(r"alertname: (\w+)", ALERTS_TEST.read_text()))
    assert tested == {r["alert"] for g in rules() for r in g["rules"]}
