#!/usr/bin/env python3
"""Render the Grafana dashboard (services/grafana/eg-kv.json) offline, from a real run.

Starts a real eg-kv server (2 workers, a 32 MiB slab, an admin and two tenants with
quotas) and a real Prometheus scraping its /metrics every second, drives bounded traffic
of every kind the panels show, evaluates every panel's expressions through Prometheus'
``/api/v1/query_range`` and draws the panels in their grid as an SVG (no Grafana, no
browser). Prints one line per panel; exits 1 if Prometheus rejects any expression.

Usage: ``.venv/bin/python scripts/dashboard_snapshot.py [--seconds 60] [--out FILE.svg]``
(default ``docs/img/dashboard.svg``).
Needs ``prometheus`` on PATH (Debian: ``apt-get install prometheus``).
"""

from __future__ import annotations

import argparse
import hashlib
import html
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "services" / "grafana" / "eg-kv.json"
PYTHON = ROOT / ".venv" / "bin" / "python"
TENANTS = [  # name, role, quota
    ("ops", "admin", None),
    ("team-a", "readwrite", "8MiB"),
    ("team-b", "readwrite", "4MiB"),
]
RATE_INTERVAL = "10s"
MiB = 1 << 20


def token(name: str) -> str:
    """A tenant's bearer token for this run only (its sha256 goes in the tokens file)."""
    return f"dash-{name}-{os.getpid()}-{os.urandom(6).hex()}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check, timeout: float, what: str) -> None:
    """Poll ``check`` until it returns true; raises TimeoutError naming ``what``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


@dataclass
class Run:
    """The processes and files of one snapshot run (all removed by :meth:`stop`)."""

    tmp: Path
    kv_port: int
    prom_port: int
    slab: str
    tokens: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def stop(self) -> None:
        """Stop eg-kv and Prometheus by pid, unlink the slab, remove the temp dir."""
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)
        shm = Path("/dev/shm") / self.slab.lstrip("/")
        shm.unlink(missing_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


def start(tmp: Path) -> Run:
    """Start eg-kv and Prometheus on loopback; returns once Prometheus has scraped eg-kv."""
    tokens = {name: token(name) for name, _, _ in TENANTS}
    lines = []
    for name, role, quota in TENANTS:
        digest = hashlib.sha256(tokens[name].encode()).hexdigest()
        lines += [f'[[tenant]]\nname = "{name}"\ntoken_sha256 = "{digest}"\nrole = "{role}"']
        lines += [f'quota = "{quota}"'] if quota else []
    (tmp / "tokens.toml").write_text("\n".join(lines) + "\n")
    run = Run(tmp, free_port(), free_port(), f"/eg-kv-dash-{os.getpid()}", tokens)
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    env.pop("EPISTEMIC_GRAPH_KVCACHE_TOKEN", None)
    kv_log = (tmp / "eg-kv.log").open("wb")
    run.procs.append(
        subprocess.Popen(
            [
                str(PYTHON),
                "-m",
                "workers",
                "serve",
                "--addr",
                f"127.0.0.1:{run.kv_port}",
                "--slab-name",
                run.slab,
                "--capacity",
                "32MiB",
                "--workers",
                "2",
                "--fresh",
                "--tokens",
                str(tmp / "tokens.toml"),
                "--header-timeout",
                "1",
            ],
            cwd=ROOT,
            env=env,
            stdout=kv_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    )
    cred = tmp / "credentials"
    cred.write_text(tokens["ops"])
    cred.chmod(0o600)
    (tmp / "prometheus.yml").write_text(
        json.dumps(
            {  # JSON is YAML
                "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
                "scrape_configs": [
                    {
                        "job_name": "eg-kv",
                        "metrics_path": "/metrics",
                        "authorization": {"type": "Bearer", "credentials_file": str(cred)},
                        "static_configs": [{"targets": [f"127.0.0.1:{run.kv_port}"]}],
                    }
                ],
            }
        )
    )
    prom_log = (tmp / "prometheus.log").open("wb")
    run.procs.append(
        subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{run.prom_port}",
            ],
            cwd=tmp,
            stdout=prom_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    )
    try:
        wait_for(lambda: request(run, "GET", "/healthz")[0] == 200, 60, "eg-kv /healthz")
        wait_for(lambda: query(run, "up == 1", time.time())["result"], 60, "a scrape of eg-kv")
    except BaseException:
        run.stop()
        raise
    return run


def request(run: Run, method: str, path: str, body: bytes = b"", who: str = "ops") -> tuple:
    """One request to eg-kv; returns (status, body). ``who`` is a tenant or "" (none)."""
    conn = http.client.HTTPConnection("127.0.0.1", run.kv_port, timeout=10)
    try:
        headers = {"Authorization": f"Bearer {run.tokens.get(who, 'wrong')}"} if who else {}
        conn.request(method, path, body=body or None, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def traffic(run: Run, seconds: float) -> dict[int, int]:
    """Bounded traffic of every kind for ``seconds``; returns the count per status."""
    rng = random.Random(7)
    statuses: dict[int, int] = {}
    end = time.monotonic() + seconds
    held: list[socket.socket] = []
    stored: dict[str, list[str]] = {name: [] for name, _, _ in TENANTS}
    n = 0
    try:
        while time.monotonic() < end and n < 100_000:
            n += 1
            who = rng.choice(["team-a", "team-a", "team-b", "ops"])
            key = f"/kv/{who}-{rng.randrange(400)}"
            r = rng.random()
            if r < 0.35:  # puts: a 32 MiB slab and 2 quotas fill, then evict
                body = bytes([rng.randrange(256)]) * rng.choice([100_000, 200_000, 300_000])
                st = request(run, "PUT", key, body, who)[0]
                if st in (200, 201):
                    stored[who] = (stored[who] + [key])[-40:]
            elif r < 0.75:
                # Mostly keys put lately (hits, unless evicted), else any (misses).
                recent = stored[who] if rng.random() < 0.7 else []
                st = request(run, "GET", rng.choice(recent) if recent else key, who=who)[0]
            elif r < 0.82:
                st = request(run, "PUT", f"/kv/{who}-dup-{n % 3}", b"d" * 65_000, who)[0]
            elif r < 0.88:
                st = request(run, "DELETE", key, who=who)[0]
            elif r < 0.91:
                st = request(run, "GET", key, who=rng.choice(["", "nobody"]))[0]  # 401
            elif r < 0.93:
                st = request(run, "GET", "/metrics", who="team-a")[0]  # 403
            elif r < 0.95 and len(held) < 4:
                # An upload that announces 2 MiB and sends a little: in flight until cut.
                s = socket.create_connection(("127.0.0.1", run.kv_port), timeout=5)
                s.sendall(
                    f"PUT /kv/{who}-slow-{n} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
                    f"{run.tokens[who]}\r\nContent-Length: {2 * MiB}\r\n\r\n".encode()
                    + b"s" * 100_000
                )
                held.append(s)
                st = 0
            elif r < 0.96:
                # A request head that never ends: cut by --header-timeout.
                s = socket.create_connection(("127.0.0.1", run.kv_port), timeout=5)
                s.sendall(b"GET /kv/x HTTP/1.1\r\nHost: t\r\n")
                held.append(s)
                st = 0
            else:
                st = request(run, "GET", "/kv/", who=who)[0]  # a bad path: 4xx
            statuses[st] = statuses.get(st, 0) + 1
            if len(held) >= 4 and rng.random() < 0.1:
                held.pop(0).close()
            time.sleep(0.005)
    finally:
        for s in held:
            s.close()
    statuses.pop(0, None)
    return statuses


def query(run: Run, expr: str, at: float) -> dict:
    """An instant query; returns Prometheus' data, raises RuntimeError on its error."""
    return _api(run, "query", {"query": expr, "time": f"{at:.3f}"})


def query_range(run: Run, expr: str, start: float, end: float, step: float) -> dict:
    return _api(
        run,
        "query_range",
        {
            "query": expr,
            "start": f"{start:.3f}",
            "end": f"{end:.3f}",
            "step": str(int(step)),
        },
    )


def _api(run: Run, what: str, params: dict) -> dict:
    url = f"http://127.0.0.1:{run.prom_port}/api/v1/{what}"
    data = urllib.parse.urlencode(params).encode()
    try:
        with urllib.request.urlopen(url, data=data, timeout=30) as resp:
            out = json.load(resp)
    except urllib.error.HTTPError as e:
        out = json.load(e)
    if out.get("status") != "success":
        raise RuntimeError(f"{out.get('errorType')}: {out.get('error')}")
    return out["data"]


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def substitute(expr: str, seconds: float) -> str:
    """Grafana's variables as "All" and its intervals for this run."""
    for var in ("$job", "$instance", "$namespace"):
        expr = expr.replace(f'"{var}"', '".*"')
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    return expr.replace("$__range", f"{int(seconds)}s")


def evaluate(run: Run, dash: dict, start: float, end: float) -> list[dict]:
    """Every panel with its series: [{panel, series: [(legend, [(t, v)], refId)], errors}]."""
    step = max(1, round((end - start) / 120))
    out = []
    for p in panels(dash):
        if p["type"] == "row":
            out.append({"panel": p, "series": [], "errors": []})
            continue
        series, errors = [], []
        for t in p["targets"]:
            expr = substitute(t["expr"], end - start)
            try:
                data = query_range(run, expr, start, end, step)
            except RuntimeError as e:
                errors.append(f"{t['refId']}: {e}")
                continue
            for s in data["result"]:
                legend = legend_of(t.get("legendFormat", ""), s["metric"], expr)
                points = [(float(ts), float(v)) for ts, v in s["values"]]
                points = [(ts, v) for ts, v in points if v == v and abs(v) != float("inf")]
                if points:
                    series.append((legend, points, t["refId"]))
        out.append({"panel": p, "series": series, "errors": errors})
    return out


def legend_of(fmt: str, labels: dict, expr: str) -> str:
    if not fmt:
        name = labels.get("__name__", expr.split("{")[0])
        rest = ", ".join(f"{k}={v}" for k, v in labels.items() if k not in ("__name__", "job"))
        return f"{name} {rest}".strip()
    for k, v in labels.items():
        fmt = fmt.replace("{{" + k + "}}", v).replace("{{ " + k + " }}", v)
    return fmt


# ---- drawing ---------------------------------------------------------------------------

COL, ROW, PAD = 52, 30, 6  # pixels per grid column and row; gap between panels
PALETTE = [
    "#7eb26d",
    "#eab839",
    "#6ed0e0",
    "#ef843c",
    "#e24d42",
    "#1f78c1",
    "#ba43a9",
    "#705da0",
    "#508642",
    "#cca300",
]
BG, PANEL, GRID, TEXT, MUTED = "#111217", "#181b1f", "#2c3235", "#d8d9da", "#8e8e8e"


def fmt_value(v: float, unit: str) -> str:
    """A value in the panel's unit, as Grafana would show it (roughly)."""
    if unit == "percentunit":
        return f"{v * 100:.1f}%"
    if unit == "bytes":
        for u, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1024)):
            if abs(v) >= size:
                return f"{v / size:.1f} {u}"
        return f"{v:.0f} B"
    if unit == "Bps":
        return fmt_value(v, "bytes") + "/s"
    if unit == "s":
        return f"{v * 1000:.1f} ms" if abs(v) < 1 else f"{v:.2f} s"
    suffix = {"ops": " ops/s", "reqps": " req/s", "cps": " /s"}.get(unit, "")
    if abs(v) >= 1e6:
        return f"{v / 1e6:.1f}M{suffix}"
    if abs(v) >= 1e3:
        return f"{v / 1e3:.1f}K{suffix}"
    return f"{v:.3g}{suffix}" if v != int(v) else f"{int(v)}{suffix}"


def esc(s: str, limit: int = 60) -> str:
    return html.escape(s if len(s) <= limit else s[: limit - 1] + "…")


def overrides(panel: dict) -> dict[str, tuple[str | None, bool]]:
    """refId -> (unit, on the right axis) from the panel's byFrameRefID overrides."""
    out: dict[str, tuple[str | None, bool]] = {}
    for o in panel.get("fieldConfig", {}).get("overrides", []):
        if o["matcher"]["id"] != "byFrameRefID":
            continue
        props = {q["id"]: q["value"] for q in o["properties"]}
        right = props.get("custom.axisPlacement") == "right"
        out[o["matcher"]["options"]] = (props.get("unit"), right)
    return out


def draw_timeseries(x, y, w, h, series, unit, panel) -> list[str]:
    """Lines on a left axis (the panel's unit) and, for overridden targets, a right one."""
    over = overrides(panel)
    legend_rows = min(len(series), 4)
    has_right = any(over.get(ref, (None, False))[1] for _, _, ref in series)
    lx, ly, lh = x + 58, y + 30, h - 50 - 13 * legend_rows
    lw = w - (116 if has_right else 70)
    out = []
    times = [t for _, pts, _ in series for t, _ in pts]
    t0, t1 = min(times), max(times)
    t1 = t1 if t1 > t0 else t0 + 1

    def side(ref: str) -> tuple[str, bool]:
        u, right = over.get(ref, (None, False))
        return (u or unit), right

    axes = {}
    for right in (False, True):
        values = [v for _, pts, ref in series if side(ref)[1] == right for _, v in pts]
        if not values:
            continue
        lo, hi = min([*values, 0.0]), max([*values, 0.0])
        axis_unit = next(side(ref)[0] for _, _, ref in series if side(ref)[1] == right)
        axes[right] = (lo, hi if hi > lo else lo + 1)
        for i in range(3):  # horizontal grid with labels
            a, b = axes[right]
            v = a + (b - a) * i / 2
            gy = ly + lh - lh * i / 2
            if not right:
                out.append(
                    f'<line x1="{lx}" y1="{gy:.1f}" x2="{lx + lw}" y2="{gy:.1f}" stroke="{GRID}"/>'
                )
            tx, anchor = (lx + lw + 4, "start") if right else (lx - 4, "end")
            out.append(
                f'<text x="{tx}" y="{gy + 3:.1f}" fill="{MUTED}" font-size="9" '
                f'text-anchor="{anchor}">{esc(fmt_value(v, axis_unit), 12)}</text>'
            )
    for i, (_, pts, ref) in enumerate(series):
        lo, hi = axes[side(ref)[1]]
        path = " ".join(
            f"{lx + lw * (t - t0) / (t1 - t0):.1f},{ly + lh - lh * (v - lo) / (hi - lo):.1f}"
            for t, v in pts
        )
        out.append(
            f'<polyline points="{path}" fill="none" stroke="{PALETTE[i % 10]}" stroke-width="1.5"/>'
        )
    for i, (legend, pts, ref) in enumerate(series[:legend_rows]):
        more = (
            f" (+{len(series) - legend_rows} more)"
            if i == legend_rows - 1 and len(series) > legend_rows
            else ""
        )
        ty = ly + lh + 18 + 13 * i
        out.append(
            f'<rect x="{x + 10}" y="{ty - 7}" width="10" height="3" fill="{PALETTE[i % 10]}"/>'
        )
        label = f"{legend}  last {fmt_value(pts[-1][1], side(ref)[0])}{more}"
        out.append(
            f'<text x="{x + 25}" y="{ty}" fill="{TEXT}" font-size="10">{esc(label, w // 6)}</text>'
        )
    return out


def draw_stat(x, y, w, h, series, unit, gauge: bool) -> list[str]:
    out = []
    n = len(series)
    for i, (legend, pts, _) in enumerate(series[:4]):
        cx = x + w * (2 * i + 1) / (2 * min(n, 4))
        v = pts[-1][1]
        out.append(
            f'<text x="{cx:.1f}" y="{y + h / 2 + 8:.1f}" fill="{PALETTE[0]}" '
            f'font-size="30" font-weight="bold" text-anchor="middle">'
            f"{esc(fmt_value(v, unit), 14)}</text>"
        )
        out.append(
            f'<text x="{cx:.1f}" y="{y + h / 2 + 30:.1f}" fill="{MUTED}" '
            f'font-size="10" text-anchor="middle">{esc(legend, 30)}</text>'
        )
        if gauge:
            bw = w - 40
            frac = max(0.0, min(1.0, v))
            out.append(
                f'<rect x="{x + 20}" y="{y + h - 30}" width="{bw}" height="8" fill="{GRID}"/>'
            )
            color = PALETTE[0] if frac < 0.8 else PALETTE[4]
            out.append(
                f'<rect x="{x + 20}" y="{y + h - 30}" width="{bw * frac:.1f}" '
                f'height="8" fill="{color}"/>'
            )
    return out


def draw_bars(x, y, w, h, series, unit) -> list[str]:
    out = []
    for i, (legend, pts, _) in enumerate(series[:6]):
        v = pts[-1][1]
        by = y + 36 + 30 * i
        frac = max(0.0, min(1.0, v)) if unit == "percentunit" else 1.0
        out.append(
            f'<text x="{x + 10}" y="{by}" fill="{TEXT}" font-size="10">{esc(legend, w // 7)}</text>'
        )
        out.append(f'<rect x="{x + 10}" y="{by + 4}" width="{w - 90}" height="10" fill="{GRID}"/>')
        color = PALETTE[0] if frac < 0.8 else PALETTE[1] if frac < 0.95 else PALETTE[4]
        out.append(
            f'<rect x="{x + 10}" y="{by + 4}" width="{(w - 90) * frac:.1f}" '
            f'height="10" fill="{color}"/>'
        )
        out.append(
            f'<text x="{x + w - 10}" y="{by + 13}" fill="{TEXT}" font-size="11" '
            f'text-anchor="end">{esc(fmt_value(v, unit), 12)}</text>'
        )
    return out


def draw_table(x, y, w, h, entry) -> list[str]:
    """One row per namespace, one column per target (the table's merge), named as its
    organize transformation renames them."""
    p = entry["panel"]
    names: dict[str, str] = {}
    for tr in p.get("transformations", []):
        if tr["id"] == "organize":
            names = tr["options"].get("renameByName", {})
    refs = [t["refId"] for t in p["targets"]]
    cols = [names.get(f"Value #{r}", r) for r in refs]
    rows: dict[str, dict[str, float]] = {}
    for legend, pts, ref in entry["series"]:
        labels = dict(kv.split("=", 1) for kv in legend.split(" ", 1)[-1].split(", ") if "=" in kv)
        row = f"{labels.get('namespace', '?')} @ {labels.get('instance', '?')}"
        rows.setdefault(row, {})[ref] = pts[-1][1]
    cw = (w - 20) / (len(cols) + 1)
    out = []
    for j, head in enumerate(["namespace", *cols]):
        out.append(
            f'<text x="{x + 10 + cw * j:.1f}" y="{y + 40}" fill="{MUTED}" '
            f'font-size="10">{esc(head, 28)}</text>'
        )
    for i, (row, vals) in enumerate(sorted(rows.items())[:9]):
        ry = y + 60 + 20 * i
        cells = [row] + [
            fmt_value(vals[r], "bytes" if "bytes" in c else "short") if r in vals else "-"
            for r, c in zip(refs, cols, strict=True)
        ]
        for j, cell in enumerate(cells):
            out.append(
                f'<text x="{x + 10 + cw * j:.1f}" y="{ry}" fill="{TEXT}" '
                f'font-size="11">{esc(cell, 28)}</text>'
            )
    return out


def render(dash: dict, entries: list[dict], seconds: float, stamp: str) -> str:
    """The dashboard as an SVG: each panel where its gridPos puts it."""
    top = 50
    bottom = max(e["panel"]["gridPos"]["y"] + e["panel"]["gridPos"]["h"] for e in entries)
    width, height = 24 * COL, top + bottom * ROW + 30
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">',
        f'<rect width="{width}" height="{height}" fill="{BG}"/>',
        f'<text x="{PAD}" y="24" fill="{TEXT}" font-size="18">{esc(dash["title"])}</text>',
        f'<text x="{PAD}" y="42" fill="{MUTED}" font-size="11">Rendered offline by '
        f"scripts/dashboard_snapshot.py from a real Prometheus scraping a real eg-kv every "
        f"second: {int(seconds)} s of traffic, {esc(stamp)}</text>",
    ]
    for e in entries:
        p, pos = e["panel"], e["panel"]["gridPos"]
        x, y = pos["x"] * COL + PAD / 2, top + pos["y"] * ROW + PAD / 2
        w, h = pos["w"] * COL - PAD, pos["h"] * ROW - PAD
        if p["type"] == "row":
            out.append(
                f'<text x="{x}" y="{y + 18}" fill="{TEXT}" font-size="14" '
                f'font-weight="bold">{esc(p["title"])}</text>'
            )
            continue
        out.append(
            f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="3" fill="{PANEL}" '
            f'stroke="{GRID}"/>'
        )
        out.append(
            f'<text x="{x + 8}" y="{y + 17}" fill="{TEXT}" font-size="12">'
            f"{esc(p['title'], w // 7)}</text>"
        )
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        if e["errors"]:
            msg, color = "; ".join(e["errors"]), PALETTE[4]
        elif not e["series"]:
            msg, color = "No data", MUTED
        else:
            msg = ""
        if msg:
            out.append(
                f'<text x="{x + w / 2}" y="{y + h / 2}" fill="{color}" font-size="12" '
                f'text-anchor="middle">{esc(msg, w // 7)}</text>'
            )
        elif p["type"] == "timeseries":
            out += draw_timeseries(x, y, w, h, e["series"], unit, p)
        elif p["type"] in ("stat", "gauge"):
            out += draw_stat(x, y, w, h, e["series"], unit, p["type"] == "gauge")
        elif p["type"] == "bargauge":
            out += draw_bars(x, y, w, h, e["series"], unit)
        elif p["type"] == "table":
            out += draw_table(x, y, w, h, e)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def snapshot(seconds: float, out: Path) -> tuple[list[dict], dict[int, int]]:
    """The whole run: start, traffic, evaluate, render to ``out``, stop; returns the
    evaluated panels and the traffic's statuses."""
    dash = json.loads(DASHBOARD.read_text())
    tmp = Path(tempfile.mkdtemp(prefix="eg-kv-dash-"))
    try:
        run = start(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        begin = time.time()
        statuses = traffic(run, seconds)
        time.sleep(2.5)  # two more scrapes, so the last traffic is in Prometheus
        end = time.time()
        entries = evaluate(run, dash, begin, end)
    finally:
        run.stop()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(end))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(dash, entries, end - begin, stamp))
    return entries, statuses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60, help="traffic to drive (default 60)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.svg")
    args = ap.parse_args(argv)
    if not shutil.which("prometheus"):
        print("prometheus is not on PATH (Debian: apt-get install prometheus)", file=sys.stderr)
        return 2
    entries, statuses = snapshot(args.seconds, args.out)
    print("traffic statuses:", dict(sorted(statuses.items())))
    bad = with_data = total = 0
    for e in entries:
        p = e["panel"]
        if p["type"] == "row":
            continue
        total += 1
        with_data += bool(e["series"])
        state = (
            "ERROR " + "; ".join(e["errors"])
            if e["errors"]
            else (f"data ({len(e['series'])} series)" if e["series"] else "no data")
        )
        bad += bool(e["errors"])
        print(f"{p['type']:<10} {p['title']:<45} {state}")
    print(f"{with_data}/{total} panels with data; wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
