"""The Grafana dashboard (services/grafana/eg-kv.json) and how it is provisioned: with the
compose profile "monitoring" (Prometheus and Grafana beside eg-kv) and as a Kubernetes
ConfigMap (services/k8s/components/grafana-dashboard, for the Grafana sidecar).

Every PromQL expression names only metrics that a real server's /metrics exposes after
traffic of every kind the panels show (hits, misses, evictions, a tenant with a quota, a
connection timeout, a disk tier's spills), plus Prometheus' own ``up``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers.common import ROOT, free_port, wait_for
from helpers.server_http import request
from helpers.tenants import token_of, write_tokens

GRAFANA = ROOT / "services" / "grafana"
DASHBOARD = GRAFANA / "eg-kv.json"
COMPONENT = ROOT / "services" / "k8s" / "components" / "grafana-dashboard"
COMPOSE_FILES = [ROOT / "services" / "vllm" / n for n in ("compose.kvcache.yml", "compose.cpu.yml")]
TOKEN_VAR = "EPISTEMIC_GRAPH_KVCACHE_TOKEN"
#: Series Prometheus adds itself, per scraped target.
PROMETHEUS_OWN = {"up"}
#: PromQL words that are not metric names.
KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan",
}  # fmt: skip
MiB = 1024 * 1024


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def expressions(dash: dict) -> list[str]:
    """Every PromQL expression: the panels' targets and the query variables."""
    exprs = [t["expr"] for p in all_panels(dash) for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["definition"])
            assert m, var["definition"]
            exprs.append(m.group(1))
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (a small lexer, not a parser)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values, quantile strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in KEYWORDS:
            continue
        names.add(word)
    return names


def test_the_lexer_finds_names_and_only_names():
    expr = (
        'histogram_quantile(0.99, sum by (le, route) (rate(a_bucket{job=~"$job", x="b c"}'
        "[$__rate_interval]))) / on (instance) group_left b_total offset 5m > bool 1e-9"
    )
    assert metric_names(expr) == {"a_bucket", "b_total"}
    assert metric_names('up{job=~"$job"} == 0 unless c') == {"up", "c"}


def scraped_names(text: str) -> set[str]:
    return {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> set[str]:
    """The metric names of a real server's /metrics after traffic of every kind."""
    from helpers.servers import start_server, stop_server

    tmp = tmp_path_factory.mktemp("dash")
    tokens = write_tokens(tmp / "tokens.toml", [
        {"name": "ops", "role": "admin"}, {"name": "team-a", "quota": "2MiB"},
    ])  # fmt: skip
    (tmp / "disk").mkdir(mode=0o700)
    srv = start_server(
        tmp, workers=2, capacity="4MiB",
        extra=("--tokens", str(tokens), "--header-timeout", "0.5", "--disk", str(tmp / "disk"),
               "--disk-capacity", "64MiB",
               "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"),
    )  # fmt: skip
    try:
        team = token_of("team-a")
        for i in range(60):  # 6 MB into a 4 MiB slab (2 MiB quota): evictions
            assert request(srv, "PUT", f"/kv/k{i}", b"x" * 100_000, token=team).status == 201
        assert request(srv, "PUT", "/kv/k59", b"x" * 100_000, token=team).status == 200
        assert request(srv, "GET", "/kv/k59", token=team).status == 200
        assert request(srv, "GET", "/kv/absent", token=team).status == 404
        assert request(srv, "GET", "/kv/k1", token="wrong").status == 401
        # A request head that never ends: closed by --header-timeout.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as raw:
            raw.sendall(b"GET /kv/k1 HTTP/1.1\r\nHost: t\r\n")
            raw.recv(4096)  # the server closes it after 0.5 s

        def text() -> str:
            return request(srv, "GET", "/metrics", token=token_of("ops")).text

        wait_for(lambda: "eg_kv_connection_timeouts_total{" in text(), timeout=15,
                 what="the header timeout in /metrics")  # fmt: skip
        wait_for(lambda: re.search(r"^eg_kv_disk_spills_total [1-9]", text(), re.M), timeout=15,
                 what="the disk tier's spills in /metrics")  # fmt: skip
        wait_for(lambda: re.search(r"^eg_kv_kv_events_published_total [1-9]", text(), re.M),
                 timeout=15, what="the KV-events publisher's counters in /metrics")  # fmt: skip
        return scraped_names(text())
    finally:
        stop_server(srv)


def test_every_expression_names_metrics_a_real_server_exposes(scraped):
    exprs = expressions(dashboard())
    used: set[str] = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - scraped - PROMETHEUS_OWN
        assert not unknown, f"{expr!r} reads {unknown}, which /metrics does not expose"
        used |= names
    # The panels the issue asks for read what they are about.
    for name in (
        "up", "eg_kv_get_hits_total", "eg_kv_get_misses_total", "eg_kv_resident_bytes",
        "eg_kv_capacity_bytes", "eg_kv_unique_blocks", "eg_kv_evictions_total",
        "eg_kv_page_waste_bytes", "eg_kv_requests_total",
        "eg_kv_request_duration_seconds_bucket", "eg_kv_reserved_pages",
        "eg_kv_connections_shed_total", "eg_kv_connection_timeouts_total",
        "eg_kv_namespace_quota_used_bytes", "eg_kv_namespace_quota_bytes",
        "eg_kv_workers_up", "eg_kv_kv_events_published_total", "eg_kv_kv_events_skipped_total",
    ):  # fmt: skip
        assert name in used, f"no panel reads {name}"


def test_the_dashboard_is_well_formed():
    dash = dashboard()
    assert dash["schemaVersion"] >= 39 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance", "namespace"} <= set(variables)
    panels = all_panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in panels:
        assert p.get("title"), p["id"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]
            for sel in ('job=~"$job"', 'instance=~"$instance"'):
                assert t["expr"].count("{") == t["expr"].count(sel), (p["title"], sel)
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, p["title"]
    # No two panels overlap on the grid.
    cells = set()
    for p in panels:
        pos = p["gridPos"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))


def test_the_kubernetes_copy_is_the_dashboard():
    assert (COMPONENT / "eg-kv.json").read_bytes() == DASHBOARD.read_bytes(), (
        "cp services/grafana/eg-kv.json services/k8s/components/grafana-dashboard/"
    )


def seconds(duration: str) -> int:
    m = re.fullmatch(r"(\d+)s", duration)
    assert m, duration
    return int(m.group(1))


def _services(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["services"]


def _mounts(svc: dict, compose: Path) -> dict[str, Path]:
    """Container path -> host path of each bind mount (relative to the compose file)."""
    out = {}
    for vol in svc.get("volumes", []):
        parts = vol.split(":")
        if len(parts) >= 2 and parts[0].startswith("."):
            assert parts[2:] == ["ro"], f"{vol}: mounted writable"
            out[parts[1]] = (compose.parent / parts[0]).resolve()
    return out


@pytest.mark.parametrize("compose", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_provisions_prometheus_and_grafana_under_a_profile(compose):
    services = _services(compose)
    mon = {n: s for n, s in services.items() if s.get("profiles")}
    assert set(mon) == {"prometheus", "grafana"}
    assert all(s["profiles"] == ["monitoring"] for s in mon.values())
    for name, svc in mon.items():
        user = str(svc["user"]).split(":")[0]
        assert user.isdigit() and int(user) != 0, f"{name} runs as root"
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name
        for port in svc["ports"]:
            assert port.startswith("127.0.0.1:"), f"{name} published beyond loopback: {port}"
        hc = svc["healthcheck"]
        assert hc["test"][0] == "CMD" and seconds(hc["timeout"]) < seconds(hc["interval"])
        assert TOKEN_VAR not in json.dumps(svc), f"{name} has the token in its definition"
        assert re.fullmatch(r"\$\{[A-Z_]+:-[\w./-]+:[\w.]+\}", svc["image"]), svc["image"]
    # Prometheus: its config is ours, the token a secret from the environment.
    prom = mon["prometheus"]
    mounts = _mounts(prom, compose)
    config = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "eg-kv" and job["metrics_path"] == "/metrics"
    (secret,) = prom["secrets"]
    assert job["authorization"]["credentials_file"] == f"/run/secrets/{secret}"
    assert yaml.safe_load(compose.read_text())["secrets"][secret] == {"environment": TOKEN_VAR}
    eg = services["eg-kv"]
    port = eg["command"][eg["command"].index("--addr") + 1].rsplit(":", 1)[1]
    assert job["static_configs"] == [{"targets": [f"eg-kv:{port}"]}]
    assert prom["depends_on"]["eg-kv"]["condition"] == "service_healthy"
    # Grafana: the datasource is that Prometheus, the provider loads this dashboard.
    graf = mon["grafana"]
    mounts = _mounts(graf, compose)
    ds_dir = mounts["/etc/grafana/provisioning/datasources"]
    (ds,) = [d for f in sorted(ds_dir.glob("*.yml"))
             for d in yaml.safe_load(f.read_text())["datasources"]]  # fmt: skip
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    assert "9090" in prom["command"][-1]
    db_dir = mounts["/etc/grafana/provisioning/dashboards"]
    (provider,) = [p for f in sorted(db_dir.glob("*.yml"))
                   for p in yaml.safe_load(f.read_text())["providers"]]  # fmt: skip
    folder = provider["options"]["path"]
    dashboards = {c: h for c, h in mounts.items() if c.startswith(folder + "/")}
    assert list(dashboards.values()) == [DASHBOARD]
    home = graf["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home in dashboards


def test_both_compose_files_monitor_alike():
    a, b = (_services(p) for p in COMPOSE_FILES)
    for name in ("prometheus", "grafana"):
        assert a[name] == b[name], name


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl (its kustomize) not installed")
def test_the_kubernetes_component_builds_a_labelled_configmap(tmp_path):
    """The component added to the base, as an overlay would, built by the real kustomize."""
    base = os.path.relpath(ROOT / "services" / "k8s" / "base", tmp_path)
    comp = os.path.relpath(COMPONENT, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": "kvcache", "resources": [base], "components": [comp],
    }))  # fmt: skip
    out = subprocess.run(
        ["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    objects = [o for o in yaml.safe_load_all(out.stdout) if o]
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["name"] == "eg-kv-grafana-dashboard"
    assert cm["metadata"]["namespace"] == "kvcache"
    assert json.loads(cm["data"]["eg-kv.json"]) == dashboard()
    assert len(out.stdout) < 1 << 20  # a ConfigMap holds at most 1 MiB


def test_the_component_kustomization_validates(tmp_path):
    """Without kubectl: the generated ConfigMap validates against Kubernetes' schemas."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    k = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text())
    assert k["kind"] == "Component"
    (gen,) = k["configMapGenerator"]
    cm = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": gen["name"], "labels": gen["options"]["labels"]},
        "data": {f: (COMPONENT / f).read_text() for f in gen["files"]},
    }  # fmt: skip
    kubernetes_validate.validate(cm, kubernetes_validate.latest_version(), strict=True)
    assert gen["options"]["labels"]["grafana_dashboard"] == "1"
    assert gen["options"]["disableNameSuffixHash"] is True


def _snapshot_module():
    """scripts/dashboard_snapshot.py, imported from its path (scripts/ is no package)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        "dashboard_snapshot", ROOT / "scripts" / "dashboard_snapshot.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks itself up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(
    not shutil.which("prometheus"),
    reason="prometheus not installed (scripts/setup installs it as root: apt-get)",
)
def test_every_panel_evaluates_in_a_real_prometheus(tmp_path):
    """The snapshot script's run, short: a real Prometheus scraping a real eg-kv through 15 s
    of traffic accepts every panel's expressions, and the panels that traffic must move
    show data; the SVG has every panel."""
    snap = _snapshot_module()
    out = tmp_path / "dashboard.svg"
    entries, statuses = snap.snapshot(15, out)
    assert statuses.get(201) and statuses.get(404) and statuses.get(401), statuses
    by_title = {e["panel"]["title"]: e for e in entries if e["panel"]["type"] != "row"}
    errors = {t: e["errors"] for t, e in by_title.items() if e["errors"]}
    assert not errors, f"Prometheus rejected: {errors}"
    for title in (
        "Hit ratio", "Request rate by route and status", "Bytes resident against capacity",
        "Evictions", "Namespace use against quota", "Namespace bytes: used, resident, quota",
    ):  # fmt: skip
        assert by_title[title]["series"], f"{title}: no data after the traffic"
    # Hits and evictions happened, and both tenants with quotas show their use.
    (ratio,) = by_title["Hit ratio"]["series"]
    assert 0 < ratio[1][-1][1] < 1, ratio
    assert max(v for _, pts, _ in by_title["Evictions"]["series"] for _, v in pts) > 0
    quota = {
        legend.split(" @ ")[0] for legend, _, _ in by_title["Namespace use against quota"]["series"]
    }
    assert quota == {"team-a", "team-b"}, quota
    svg = out.read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    for title in by_title:
        assert snap.esc(title, 1000) in svg, title
    assert not list(Path("/dev/shm").glob(f"eg-kv-dash-{os.getpid()}*")), "slab left behind"
