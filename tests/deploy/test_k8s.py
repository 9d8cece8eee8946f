"""The Kubernetes deployment: services/k8s (a kustomize base, a ServiceMonitor component,
the LMCache side as an example, and an overlay putting them together).

No cluster runs here and kustomize is neither on PyPI nor in Debian, so the files are
checked directly (and, where kubectl is installed, its built-in kustomize must build the
same objects): every manifest against the Kubernetes OpenAPI schemas shipped inside
kubernetes-validate (offline: the check runs with sockets forbidden), and the manifests
against each other (selectors, port names, the Secret), against our CLI parser, against
eg_kv/config.py's environment names, and against the README's sizing rule. The overlay is
built by a small re-implementation of the kustomize features the files use (resources,
components, namespace, images, strategic-merge patches), which refuses any other feature
so it cannot silently build something kustomize would not.

The README's rule for a port beyond loopback (the token, TLS, only the cache's clients)
is checked per overlay: the NetworkPolicies by a small evaluator of their rules (who is
admitted to which port), the TLS overlay against the Secret's keys and a real server and
client started as the manifests say, LMCache's listeners by LMCache's own parsers, and
every container's securityContext; each check is shown to catch its breakage.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.common import ROOT

K8S = ROOT / "services" / "k8s"
BASE = K8S / "base"
OVERLAY = K8S / "overlays" / "example"
LOCAL_READS = K8S / "overlays" / "local-reads"
TLS = K8S / "overlays" / "tls"
CERT_MANAGER = K8S / "examples" / "cert-manager"
#: Every overlay: each is checked for the network policy and the securityContexts.
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
DOCKERFILE = ROOT / "services" / "vllm" / "Dockerfile"

kubernetes_validate = pytest.importorskip("kubernetes_validate")

#: The oldest Kubernetes the manifests are meant for, and the newest schemas shipped.
VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
#: Kinds whose schemas are CRDs, not in Kubernetes' OpenAPI: checked structurally below.
CRD_KINDS = {"ServiceMonitor", "Certificate", "Issuer"}
#: The memory the README's sizing rule leaves for each worker and for the supervisor: a
#: worker idles at ~35 MiB RSS (measured: 32 MiB with 2 workers and a 256 MiB slab) and
#: may hold a few spooled chunked bodies of --max-block-size.
WORKER_MEMORY = 256 << 20
SUPERVISOR_MEMORY = 256 << 20
#: Room in the pod's /dev/shm, beyond the slab, for the shared memory of the LMCache (and
#: vLLM) processes that share it in the local-reads shape (vLLM's Kubernetes guide gives
#: vLLM a 2Gi /dev/shm).
READERS_SHM_HEADROOM = 2 << 30
LOCAL_READS_VAR = "EPISTEMIC_GRAPH_KVCACHE_LOCAL_READS"
SRV_URL = re.compile(
    r"dnssrv\+https?://_([a-z0-9-]+)\._tcp\.([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local"
)


# --------------------------------------------------------------------- a small kustomize

KUSTOMIZATION_KEYS = {
    "apiVersion", "kind", "resources", "components", "namespace", "images", "patches",
    "configMapGenerator",  # components/grafana-dashboard only: never built here (see build)
}  # fmt: skip
#: The merge keys of the lists the patches touch (kustomize's strategic merge).
MERGE_KEYS = {"containers": "name", "env": "name", "volumeMounts": "mountPath",
              "volumes": "name"}  # fmt: skip


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomization(directory: Path) -> dict:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}: kustomize features this test does not build: {unknown}"
    return k


def build(directory: Path) -> list[dict]:
    """The objects ``kustomize build directory`` makes, for the features the files use."""
    k = kustomization(directory)
    want = "Component" if k["kind"] == "Component" else "Kustomization"
    assert k["kind"] == want
    # Generators are built by the real kustomize only (tests/deploy/test_dashboard.py).
    assert "configMapGenerator" not in k, f"{directory}: a generator this test does not build"
    objects: list[dict] = []
    for entry in k.get("resources", []):
        path = (directory / entry).resolve()
        assert path.exists(), f"{directory}: resource {entry} does not exist"
        objects += build(path) if path.is_dir() else load_docs(path)
    # A component's patches apply to the objects of the kustomization that includes it.
    patches = patch_docs(directory) if want == "Kustomization" else []
    for entry in k.get("components", []):
        path = (directory / entry).resolve()
        assert kustomization(path)["kind"] == "Component", f"{entry} is not a Component"
        objects += build(path)
        patches += patch_docs(path)
    objects = copy.deepcopy(objects)
    for patch in patches:
        targets = [o for o in objects if (o["kind"], o["metadata"]["name"]) ==
                   (patch["kind"], patch["metadata"]["name"])]  # fmt: skip
        assert len(targets) == 1, f"patch of {patch['kind']} {patch['metadata']['name']}"
        merge(targets[0], patch)
    for image in k.get("images", []):
        for obj in objects:
            for container in pod_spec(obj).get("containers", []) if pod_spec(obj) else []:
                name, _, _ = container["image"].partition(":")
                if name == image["name"]:
                    new = image.get("newName", name)
                    container["image"] = f"{new}:{image['newTag']}" if "newTag" in image else new
    if "namespace" in k:
        for obj in objects:
            obj["metadata"]["namespace"] = k["namespace"]
    return objects


def patch_docs(directory: Path) -> list[dict]:
    """The strategic-merge patches a kustomization lists (``path`` entries only)."""
    out = []
    for entry in kustomization(directory).get("patches", []):
        assert set(entry) == {"path"}, f"{directory}: patch features not built here: {entry}"
        out += load_docs(directory / entry["path"])
    return out


def merge(target: dict, patch: dict) -> None:
    """Strategic merge: maps merge, the lists of MERGE_KEYS merge by their key."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        elif key in MERGE_KEYS and isinstance(value, list):
            items = target.setdefault(key, [])
            for item in value:
                same = [t for t in items if t[MERGE_KEYS[key]] == item[MERGE_KEYS[key]]]
                if same:
                    merge(same[0], item)
                else:
                    items.append(copy.deepcopy(item))
        else:
            target[key] = copy.deepcopy(value)


def pod_spec(obj: dict) -> dict | None:
    if obj["kind"] in ("StatefulSet", "Deployment"):
        return obj["spec"]["template"]["spec"]
    return None


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"want one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(obj: dict, name: str) -> dict:
    found = [c for c in pod_spec(obj)["containers"] if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def manifest_files() -> list[Path]:
    patches = {
        d / e["path"] for d in kustomized_dirs() for e in kustomization(d).get("patches", [])
    }
    return sorted(
        p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and p not in patches
    )


def kustomized_dirs() -> list[Path]:
    return [p.parent for p in K8S.rglob("kustomization.yaml")]


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return build(BASE)


@pytest.fixture(scope="module")
def overlay() -> list[dict]:
    return build(OVERLAY)


def test_every_file_is_used_by_a_kustomization_and_the_overlay_builds_all(overlay):
    listed = set()
    for k_path in K8S.rglob("kustomization.yaml"):
        k = kustomization(k_path.parent)
        for entry in k.get("resources", []) + k.get("components", []):
            listed.add((k_path.parent / entry).resolve())
    assert set(manifest_files()) <= listed, "a manifest no kustomization lists"
    kinds = sorted(o["kind"] for o in overlay)
    assert kinds == sorted(
        ["Service", "StatefulSet", "PodDisruptionBudget", "ServiceMonitor", "ConfigMap",
         "Deployment", "NetworkPolicy", "NetworkPolicy"]
    )  # fmt: skip
    assert {o["metadata"]["namespace"] for o in overlay} == {"kvcache"}
    names = [(o["kind"], o["metadata"]["name"]) for o in overlay]
    assert len(names) == len(set(names))


# --------------------------------------------------------------------- schemas, offline

_VALIDATE_OFFLINE = """
import json, sys
def no_network(event, args):
    if event in ("socket.connect", "socket.getaddrinfo", "urllib.Request"):
        raise RuntimeError(f"network use during validation: {event} {args}")
sys.addaudithook(no_network)
import kubernetes_validate
docs, versions = json.loads(sys.stdin.read())
for version in versions:
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
print("validated", len(docs) * len(versions))
"""


def test_every_manifest_validates_against_the_kubernetes_schemas_offline():
    docs = [d for p in manifest_files() for d in load_docs(p) if d["kind"] not in CRD_KINDS]
    assert len(docs) == 7
    out = subprocess.run(
        [sys.executable, "-c", _VALIDATE_OFFLINE], input=json.dumps([docs, VERSIONS]),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == f"validated {len(docs) * len(VERSIONS)}"


@pytest.mark.parametrize(
    "breakage",
    ["unknown field", "port as text", "missing selector"],
)
def test_the_schema_check_really_refuses_a_broken_manifest(breakage):
    sts = copy.deepcopy(one(load_docs(BASE / "statefulset.yaml"), "StatefulSet"))
    c = sts["spec"]["template"]["spec"]["containers"][0]
    if breakage == "unknown field":
        c["volumeMount"] = c.pop("volumeMounts")  # a typo strict validation catches
    elif breakage == "port as text":
        c["ports"][0]["containerPort"] = "9130"
    else:
        del sts["spec"]["selector"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("directory", [OVERLAY, TLS], ids=["example", "tls"])
def test_the_service_monitor_has_the_shape_the_operator_wants(directory):
    sm = one(build(directory), "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm["spec"]) == {"selector", "endpoints"}
    (endpoint,) = sm["spec"]["endpoints"]
    assert set(endpoint) <= {"port", "path", "scheme", "interval", "scrapeTimeout",
                             "authorization", "tlsConfig"}  # fmt: skip
    assert endpoint["path"] == "/metrics" and endpoint["scheme"] in ("http", "https")
    assert duration(endpoint["scrapeTimeout"]) < duration(endpoint["interval"])
    assert endpoint["authorization"]["type"] == "Bearer"
    assert set(endpoint["authorization"]["credentials"]) == {"name", "key"}


def duration(text: str) -> float:
    m = re.fullmatch(r"(\d+)(s|m|h)", text)
    assert m, text
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


# --------------------------------------------------------------------- agreement


def test_selectors_match_the_pod_labels(overlay):
    sts = one(overlay, "StatefulSet", "eg-kv")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    svc = one(overlay, "Service", "eg-kv")
    selectors = {
        "StatefulSet": sts["spec"]["selector"]["matchLabels"],
        "Service": svc["spec"]["selector"],
        "PodDisruptionBudget": one(overlay, "PodDisruptionBudget")["spec"]["selector"][
            "matchLabels"
        ],
    }
    for spread in pod_spec(sts)["topologySpreadConstraints"]:
        selectors["topologySpread"] = spread["labelSelector"]["matchLabels"]
    for what, selector in selectors.items():
        assert selector and selector.items() <= pod_labels.items(), what
    # The ServiceMonitor selects the Service (by its labels), not the pods.
    sm_selector = one(overlay, "ServiceMonitor")["spec"]["selector"]["matchLabels"]
    assert sm_selector.items() <= svc["metadata"]["labels"].items()
    # The LMCache example selects its own pods and none of eg-kv's.
    dep = one(overlay, "Deployment", "lmcache")
    dep_selector = dep["spec"]["selector"]["matchLabels"]
    assert dep_selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert not dep_selector.items() <= pod_labels.items()
    assert (
        not svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    )


def test_a_headless_service_with_a_named_port_publishes_the_srv_records(overlay):
    sts = one(overlay, "StatefulSet", "eg-kv")
    svc = one(overlay, "Service", "eg-kv")
    assert svc["spec"]["clusterIP"] == "None"
    assert not svc["spec"].get("publishNotReadyAddresses", False), "unready pods in the set"
    # Pods get stable names eg-kv-N.<serviceName>.<ns>.svc: the member ids.
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    (port,) = svc["spec"]["ports"]
    assert port["protocol"] == "TCP" and port["name"] == "http"
    (cport,) = container(sts, "eg-kv")["ports"]
    assert port["targetPort"] == cport["name"] and cport["protocol"] == "TCP"
    settings = serve_settings(sts)
    assert cport["containerPort"] == settings.port == port["port"]
    assert settings.host == "0.0.0.0"
    c = container(sts, "eg-kv")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/healthz" and get["port"] == cport["name"], probe
        assert c[probe]["timeoutSeconds"] < c[probe]["periodSeconds"], probe
    (endpoint,) = one(overlay, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] == port["name"]


def test_the_lmcache_example_points_at_the_srv_records_of_this_service(overlay):
    from eg_kv.client.members import parse_server_set
    from eg_kv.config import ENV_URL

    svc = one(overlay, "Service", "eg-kv")
    cm = one(overlay, "ConfigMap", "lmcache-eg-kv")
    url = cm["data"][ENV_URL]
    m = SRV_URL.fullmatch(url)
    assert m, url
    assert m.groups() == (
        svc["spec"]["ports"][0]["name"],
        svc["metadata"]["name"],
        svc["metadata"]["namespace"],
    ), "the URL names another port, service or namespace than the overlay deploys"
    (query,) = parse_server_set(url).queries
    assert query.kind == "srv"
    dep = one(overlay, "Deployment", "lmcache")
    c = container(dep, "lmcache")
    assert c["envFrom"] == [{"configMapRef": {"name": cm["metadata"]["name"]}}]
    assert cm["data"]["LMCACHE_TRACK_USAGE"] == "false"
    assert_our_adapter_without_url_or_token(c["args"])


def assert_our_adapter_without_url_or_token(args: list[str]) -> None:
    """LMCache's ``--l2-adapter`` is eg-kv's native_plugin, its set and token left to the
    environment."""
    spec = json.loads(args[args.index("--l2-adapter") + 1])
    assert (spec["type"], spec["module_path"], spec["class_name"]) == (
        "native_plugin", "eg_kv.kvcache", "RemoteKVL2Connector"
    )  # fmt: skip
    # No base_url: the set comes from the environment; no token: LMCache logs this JSON.
    assert not {"base_url", "addr", "token"} & set(spec["adapter_params"])
    from eg_kv.client.settings import CONFIG_KEYWORDS

    assert set(spec["adapter_params"]) <= set(CONFIG_KEYWORDS)
    import importlib

    assert hasattr(importlib.import_module(spec["module_path"]), spec["class_name"])


@pytest.mark.lmcache
def test_lmcache_accepts_the_example_command_line(overlay):
    import argparse

    pytest.importorskip("lmcache")
    from lmcache.cli.commands.server import ServerCommand

    c = container(one(overlay, "Deployment", "lmcache"), "lmcache")
    assert c["command"] == ["lmcache", "server"]
    parser = argparse.ArgumentParser(prog="lmcache server")
    ServerCommand().add_arguments(parser)
    args = parser.parse_args(c["args"])
    # Loopback only (vLLM is a container of the same pod): no port is declared.
    assert args.port == 5555 and args.host == "127.0.0.1" and "ports" not in c


def test_the_token_comes_from_one_secret_through_the_environment_only(overlay):
    from eg_kv.config import ENV_TOKEN

    refs = []
    for obj in overlay:
        spec = pod_spec(obj)
        for c in spec["containers"] if spec else []:
            for env in c.get("env", []):
                if env["name"] == ENV_TOKEN:
                    assert "value" not in env, f"{obj['metadata']['name']}: a literal token"
                    refs.append(env["valueFrom"]["secretKeyRef"])
            assert ENV_TOKEN not in json.dumps(c.get("args", [])), "token on a command line"
    (endpoint,) = one(overlay, "ServiceMonitor")["spec"]["endpoints"]
    refs.append(endpoint["authorization"]["credentials"])
    assert len(refs) == 3
    assert all(r == refs[0] for r in refs), refs
    assert not any(r.get("optional") for r in refs), "a pod must not start without the token"
    assert not [o for o in overlay if o["kind"] == "Secret"], "a secret value in git"
    cm = one(overlay, "ConfigMap", "lmcache-eg-kv")
    assert ENV_TOKEN not in cm["data"]


def test_every_environment_name_is_one_eg_kv_reads(overlay):
    import eg_kv.config as config

    known = {v for k, v in vars(config).items() if k.startswith("ENV_")}
    used = set()
    for obj in overlay:
        spec = pod_spec(obj)
        for c in spec["containers"] if spec else []:
            used |= {e["name"] for e in c.get("env", [])}
        if obj["kind"] == "ConfigMap":
            used |= set(obj["data"])
    ours = {name for name in used if name.startswith("EPISTEMIC_GRAPH_KVCACHE_")}
    assert ours and ours <= known, ours - known
    assert used - ours <= {"LMCACHE_TRACK_USAGE", "HOME"}, used - ours


# --------------------------------------------------------------------- the server pod


def serve_settings(sts: dict, env: dict | None = None):
    """The Settings ``eg-kv serve`` builds from the pod's arguments and environment."""
    from eg_kv.config import ENV_TOKEN, settings_from_env
    from workers.__main__ import SERVE_FLAGS, build_parser

    args = build_parser().parse_args(container(sts, "eg-kv")["args"])
    assert args.command == "serve"
    env = {ENV_TOKEN: "a-token-from-the-secret"} if env is None else env
    return settings_from_env(env, **{k: getattr(args, k) for k in SERVE_FLAGS})


def test_the_serve_arguments_are_accepted_by_our_cli(base):
    sts = one(base, "StatefulSet", "eg-kv")
    s = serve_settings(sts)
    assert (s.host, s.port, s.workers) == ("0.0.0.0", 9130, 4)
    assert (s.capacity, s.page_size, s.max_block_size) == (8 << 30, 64 << 10, 64 << 20)
    assert s.keep and not s.fresh and s.token == "a-token-from-the-secret"
    # The parser really checks: a misspelt flag is refused.
    from workers.__main__ import build_parser

    args = list(container(sts, "eg-kv")["args"])
    args[args.index("--workers")] = "--wrokers"
    with pytest.raises(SystemExit):
        build_parser().parse_args(args)


def test_the_image_runs_eg_kv_as_the_pods_user(base):
    sts = one(base, "StatefulSet", "eg-kv")
    c = container(sts, "eg-kv")
    assert c["image"] == "eg-kv:local"  # the base's images entry applied
    server = DOCKERFILE.read_text().split("AS server", 1)[1]
    assert 'ENTRYPOINT ["eg-kv"]' in server and "command" not in c
    uid = int(re.search(r"useradd[^\n]*--uid (\d+)", server).group(1))
    sec = pod_spec(sts)["securityContext"]
    assert sec["runAsNonRoot"] and sec["runAsUser"] == uid and sec["runAsUser"] != 0
    csec = c["securityContext"]
    assert csec["readOnlyRootFilesystem"] and not csec["allowPrivilegeEscalation"]
    assert csec["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(sts)["volumes"]}
    # The slab and the run directory (tempfile's folder) need writable memory and disk.
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert not pod_spec(sts)["automountServiceAccountToken"]


_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?")
_QUANTITY_UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
                   "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}  # fmt: skip


def quantity(text) -> int:
    """A Kubernetes memory quantity in bytes (the suffixes the manifests may use)."""
    m = _QUANTITY.fullmatch(str(text))
    assert m, f"not a memory quantity this test reads: {text!r}"
    return int(float(m.group(1)) * _QUANTITY_UNITS[m.group(2)])


def test_sizes_follow_the_sizing_rule(base):
    from eg_kv.slab.layout import Geometry

    sts = one(base, "StatefulSet", "eg-kv")
    s = serve_settings(sts)
    c = container(sts, "eg-kv")
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    shm = quantity({v["name"]: v for v in pod_spec(sts)["volumes"]}[mounts["/dev/shm"]][
        "emptyDir"]["sizeLimit"])  # fmt: skip
    # The README's rule, and the slab the server really lays out, with room to spare.
    assert shm >= s.capacity * 1.03 + (64 << 20)
    slab = Geometry.plan(s.capacity, s.page_size, s.max_block_size).total_size
    assert shm - slab >= 64 << 20
    # The memory limit holds /dev/shm (a memory-backed emptyDir counts against it), the
    # workers and the supervisor; the request equals it, so the node sets it aside.
    limit = quantity(c["resources"]["limits"]["memory"])
    assert limit >= shm + s.workers * WORKER_MEMORY + SUPERVISOR_MEMORY
    assert quantity(c["resources"]["requests"]["memory"]) == limit
    # One worker per requested core: the default would count the node's cores.
    assert "--workers" in c["args"] and float(c["resources"]["requests"]["cpu"]) == s.workers


def test_the_grace_period_outlasts_the_drain(base):
    sts = one(base, "StatefulSet", "eg-kv")
    s = serve_settings(sts)
    assert "--drain-timeout" in container(sts, "eg-kv")["args"]
    assert pod_spec(sts)["terminationGracePeriodSeconds"] >= s.drain_timeout_s + 5
    # And with the default drain timeout, were the flag dropped.
    from eg_kv.config import DEFAULT_DRAIN_TIMEOUT_S

    assert pod_spec(sts)["terminationGracePeriodSeconds"] >= DEFAULT_DRAIN_TIMEOUT_S + 5


def test_the_sizing_checks_catch_a_capacity_raised_alone(base):
    """Raise --capacity without sizeLimit and memory: the checks above must refuse it."""
    sts = copy.deepcopy(one(base, "StatefulSet", "eg-kv"))
    args = container(sts, "eg-kv")["args"]
    args[args.index("--capacity") + 1] = "16GiB"
    with pytest.raises(AssertionError):
        test_sizes_follow_the_sizing_rule([sts])


# --------------------------------------------------------------------- tenants


def test_the_tenants_overlay_mounts_the_tokens_file_from_a_secret(overlay):
    from eg_kv.config import ENV_TOKEN, ENV_TOKENS_FILE

    tenanted = build(K8S / "overlays" / "tenants")
    sts = one(tenanted, "StatefulSet", "eg-kv")
    c = container(sts, "eg-kv")
    env = {e["name"]: e for e in c["env"]}
    path = env[ENV_TOKENS_FILE]["value"]
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"]
    (volume,) = [v for v in pod_spec(sts)["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]
    assert secret["secretName"] == "eg-kv-tokens" and not secret.get("optional")
    assert secret["defaultMode"] & 0o007 == 0, "the file is not world-readable"
    assert pod_spec(sts)["securityContext"]["fsGroup"], "the pod's group reads the file"
    # The single token stays (an admin tenant has it); everything else is the overlay's.
    assert ENV_TOKEN in env
    # The server reads that setting: eg-kv serve's Settings carry the file.
    s = serve_settings(sts, {ENV_TOKEN: "t", ENV_TOKENS_FILE: path})
    assert s.tokens_file == path
    base_sts = one(overlay, "StatefulSet", "eg-kv")
    assert ENV_TOKENS_FILE not in json.dumps(base_sts), "the base needs no tokens file"
    # The patched StatefulSet is still a valid StatefulSet.
    out = subprocess.run(
        [sys.executable, "-c", _VALIDATE_OFFLINE], input=json.dumps([[sts], list(VERSIONS)]),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]


# --------------------------------------------------------------------- local reads


@pytest.fixture(scope="module")
def local_reads() -> list[dict]:
    return build(LOCAL_READS)


def dev_shm_volume(obj: dict, c: dict) -> dict:
    """The pod volume a container mounts at /dev/shm (it must mount one)."""
    mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    assert len(mounts) == 1, f"{c['name']} mounts {len(mounts)} volumes at /dev/shm"
    mount = mounts[0]
    assert not mount.get("readOnly"), "POSIX shm_open needs a writable /dev/shm"
    (volume,) = [v for v in pod_spec(obj)["volumes"] if v["name"] == mount["name"]]
    return volume


def run_as(obj: dict, c: dict) -> tuple[int | None, int | None]:
    """The uid and gid a container runs as: its own securityContext over the pod's."""
    pod, own = pod_spec(obj).get("securityContext", {}), c.get("securityContext", {})
    return tuple(own.get(k, pod.get(k)) for k in ("runAsUser", "runAsGroup"))


def resolved_env(obj: dict, c: dict) -> dict[str, str]:
    """A container's literal environment as the kubelet makes it: ``$(NAME)`` expands to
    an earlier entry, ``$$`` escapes; a metadata.namespace fieldRef is the object's
    namespace. Secret references stay out (they are not literals)."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(
                r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                e["value"],
            )
        elif e["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[e["name"]] = obj["metadata"]["namespace"]
    return env


def dockerfile_uid(stage: str) -> int:
    """The uid a Dockerfile stage's useradd gives its user."""
    text = DOCKERFILE.read_text().split(f"AS {stage}", 1)[1].split("\nFROM ", 1)[0]
    (uid,) = re.findall(r"useradd[^\n]*--uid (\d+)", text)
    return int(uid)


def assert_lmcache_reads_eg_kv_locally(objects: list[dict]) -> None:
    """In each eg-kv pod an LMCache container can open the slab: it mounts the same
    memory-backed /dev/shm, sized for the slab and the readers, runs as eg-kv's uid, keeps
    local reads on, and its URL reaches this pod's eg-kv."""
    from eg_kv.client.members import parse_server_set
    from eg_kv.config import ENV_TOKEN, ENV_URL
    from eg_kv.slab.layout import Geometry

    sts = one(objects, "StatefulSet", "eg-kv")
    eg, lm = container(sts, "eg-kv"), container(sts, "lmcache")
    # One /dev/shm: pods share none across pods, containers of a pod share its volumes.
    shm = dev_shm_volume(sts, eg)
    assert dev_shm_volume(sts, lm) is shm, "LMCache mounts another /dev/shm than eg-kv"
    assert shm["emptyDir"]["medium"] == "Memory", "the slab must live in memory"
    s = serve_settings(sts)
    slab = Geometry.plan(s.capacity, s.page_size, s.max_block_size).total_size
    size = quantity(shm["emptyDir"]["sizeLimit"])
    assert size - slab >= (64 << 20) + READERS_SHM_HEADROOM, "no room for the readers"
    # One user: the slab is mode 0600.
    assert run_as(sts, lm) == run_as(sts, eg), "LMCache runs as another user than eg-kv"
    uid, gid = run_as(sts, eg)
    assert uid and gid, "runAsUser and runAsGroup must be set, and not root"
    assert uid == dockerfile_uid("server") == dockerfile_uid("lmcache")
    # The URL reaches this pod's eg-kv: loopback, or a server set this pod is in.
    env = resolved_env(sts, lm)
    off = env.get(LOCAL_READS_VAR, "1").lower() in ("0", "false", "no", "off")
    assert not off, f"{LOCAL_READS_VAR} turns local reads off"
    url = env[ENV_URL]
    (http,) = eg["ports"]
    assert http["containerPort"] == s.port
    loopback = re.fullmatch(r"http://(?:127\.0\.0\.1|localhost):(\d+)", url)
    if loopback:
        assert int(loopback.group(1)) == s.port
    else:
        m = SRV_URL.fullmatch(url)
        assert m, f"neither loopback nor the SRV records of a Service: {url}"
        port_name, svc_name, namespace = m.groups()
        assert namespace == sts["metadata"].get("namespace"), "a set in another namespace"
        svc = one(objects, "Service", svc_name)
        assert svc["spec"].get("clusterIP") == "None", "SRV records name pods: headless"
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items(), "the set lacks this pod"
        (port,) = [p for p in svc["spec"]["ports"] if p["name"] == port_name]
        assert port["targetPort"] in (http["name"], s.port)
        (query,) = parse_server_set(url).queries
        assert query.kind == "srv"
    # The token: eg-kv's Secret, by the environment only.
    refs = [e["valueFrom"]["secretKeyRef"] for c in (eg, lm) for e in c["env"]
            if e["name"] == ENV_TOKEN]  # fmt: skip
    assert len(refs) == 2 and refs[0] == refs[1], refs
    assert_our_adapter_without_url_or_token(lm["args"])


def test_the_local_reads_overlay_puts_lmcache_beside_eg_kv_on_one_dev_shm(local_reads):
    assert_lmcache_reads_eg_kv_locally(local_reads)
    sts = one(local_reads, "StatefulSet", "eg-kv")
    lm = container(sts, "lmcache")
    assert lm["image"] == "eg-kv-lmcache:local" and lm["command"] == ["lmcache", "server"]
    assert lm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert not lm["securityContext"]["allowPrivilegeEscalation"]
    # The base's sizing rule still holds with the larger /dev/shm.
    test_sizes_follow_the_sizing_rule(local_reads)
    # The sidecars replace the separate LMCache Deployment; everything is in one namespace.
    assert sorted(o["kind"] for o in local_reads) == sorted(
        ["Service", "StatefulSet", "PodDisruptionBudget", "ServiceMonitor", "NetworkPolicy"]
    )
    assert {o["metadata"]["namespace"] for o in local_reads} == {"kvcache"}
    import eg_kv.config as config

    known = {v for k, v in vars(config).items() if k.startswith("ENV_")} | {LOCAL_READS_VAR}
    names = {e["name"] for e in lm["env"]}
    ours = {n for n in names if n.startswith("EPISTEMIC_GRAPH_KVCACHE_")}
    assert ours <= known and names - ours <= {"POD_NAMESPACE", "LMCACHE_TRACK_USAGE", "HOME"}
    # Still a valid StatefulSet, offline.
    out = subprocess.run(
        [sys.executable, "-c", _VALIDATE_OFFLINE], input=json.dumps([[sts], list(VERSIONS)]),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]


def _break(objects: list[dict], breakage: str) -> list[dict]:
    objects = copy.deepcopy(objects)
    sts = one(objects, "StatefulSet", "eg-kv")
    lm = container(sts, "lmcache")
    env = {e["name"]: e for e in lm["env"]}
    if breakage == "its own /dev/shm":
        pod_spec(sts)["volumes"].append({"name": "own", "emptyDir": {"medium": "Memory"}})
        (mount,) = [m for m in lm["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        mount["name"] = "own"
    elif breakage == "no /dev/shm":
        lm["volumeMounts"] = [m for m in lm["volumeMounts"] if m["mountPath"] != "/dev/shm"]
    elif breakage == "another user":
        lm["securityContext"]["runAsUser"] = 0
    elif breakage == "the slab's size only":
        dev_shm_volume(sts, lm)["emptyDir"]["sizeLimit"] = "9Gi"
    elif breakage == "another namespace":
        env["EPISTEMIC_GRAPH_KVCACHE_URL"]["value"] = (
            "dnssrv+http://_http._tcp.eg-kv.other.svc.cluster.local"
        )
    elif breakage == "another service":
        env["EPISTEMIC_GRAPH_KVCACHE_URL"]["value"] = "http://eg-kv-elsewhere:9130"
    else:
        lm["env"].append({"name": LOCAL_READS_VAR, "value": "off"})
    return objects


@pytest.mark.parametrize(
    "breakage",
    ["its own /dev/shm", "no /dev/shm", "another user", "the slab's size only",
     "another namespace", "another service", "local reads off"],
)  # fmt: skip
def test_the_local_reads_checks_catch_a_broken_shape(local_reads, breakage):
    with pytest.raises(AssertionError):
        assert_lmcache_reads_eg_kv_locally(_break(local_reads, breakage))


# ------------------------------------------------- issue 21 item 9: the README's own rule
# "Bind beyond loopback only with the token set, and then with TLS": the network admits
# only the cache's clients, TLS is one component away, LMCache's unauthenticated listeners
# stay in their pod, and no container runs as root or keeps a privilege.

CLIENT_LABEL = {"eg-kv/client": "true"}
CLIENT_NAMESPACE_LABEL = {"eg-kv/clients": "true"}
PROMETHEUS = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@pytest.fixture(scope="module")
def every_overlay() -> dict[str, list[dict]]:
    return {d.name: build(d) for d in OVERLAYS}


def test_there_are_the_overlays_these_checks_cover():
    assert [d.name for d in OVERLAYS] == ["example", "local-reads", "tenants", "tls"]


def _matches(selector: dict, labels: dict) -> bool:
    """A label selector of matchLabels only (the only kind the manifests use)."""
    assert set(selector) <= {"matchLabels"}, f"selector features not modelled: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_admits(peer: dict, policy_ns: str, source: tuple[str, dict, dict]) -> bool:
    """Whether one ``from`` peer of a NetworkPolicy in ``policy_ns`` admits ``source``
    (its namespace, that namespace's labels, its pod's labels)."""
    assert set(peer) <= {"podSelector", "namespaceSelector"}, f"peer not modelled: {peer}"
    ns, ns_labels, pod_labels = source
    # Kubernetes labels every namespace with its name.
    ns_labels = {**ns_labels, "kubernetes.io/metadata.name": ns}
    if "namespaceSelector" in peer:
        if not _matches(peer["namespaceSelector"], ns_labels):
            return False
    elif ns != policy_ns:
        return False  # a podSelector alone selects in the policy's own namespace
    return _matches(peer.get("podSelector", {}), pod_labels)


def admitted(objects: list[dict], target: dict, port: dict, source: tuple) -> bool:
    """Whether the NetworkPolicies in ``objects`` admit ``source`` (namespace, namespace
    labels, pod labels) to ``port`` (a container port) of ``target``'s pods, by the
    NetworkPolicy rules: isolated once a policy selects the pod for Ingress, then
    admitted if any rule of any such policy admits it (a rule without ``from`` admits
    every source, one without ``ports`` every port)."""
    ns = target["metadata"]["namespace"]
    labels = target["spec"]["template"]["metadata"]["labels"]
    policies = [p for p in objects if p["kind"] == "NetworkPolicy"
                and p["metadata"]["namespace"] == ns
                and _matches(p["spec"]["podSelector"], labels)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]  # fmt: skip
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(
                p.get("protocol", "TCP") == port.get("protocol", "TCP")
                and p.get("port") in (port.get("name"), port["containerPort"])
                for p in ports
            ):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_admits(peer, ns, source) for peer in peers):
                return True
    return False


def eg_kv_clients(objects: list[dict]) -> list[dict]:
    """The workloads whose containers are eg-kv clients (they carry its URL)."""
    from eg_kv.config import ENV_URL

    maps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    out = []
    for obj in objects:
        for c in pod_spec(obj)["containers"] if pod_spec(obj) else []:
            names = {e["name"] for e in c.get("env", [])}
            for ref in c.get("envFrom", []):
                names |= set(maps[ref["configMapRef"]["name"]]["data"])
            if ENV_URL in names:
                out.append(obj)
                break
    return out


def assert_only_the_caches_clients_reach_eg_kv(objects: list[dict]) -> None:
    """eg-kv's port admits its clients (pods labelled eg-kv/client in its namespace, or in
    a namespace labelled eg-kv/clients) and Prometheus from "monitoring", nobody else,
    and no other port; the LMCache Deployment, whose listeners are loopback, admits none."""
    sts = one(objects, "StatefulSet", "eg-kv")
    ns = sts["metadata"]["namespace"]
    (http,) = container(sts, "eg-kv")["ports"]
    other_port = {"name": "other", "containerPort": 9999, "protocol": "TCP"}
    clients = eg_kv_clients(objects)
    assert clients, "no client of eg-kv in this overlay"
    for client in clients:
        labels = client["spec"]["template"]["metadata"]["labels"]
        assert labels.items() >= CLIENT_LABEL.items(), f"{client['metadata']['name']}: unlabelled"
        assert admitted(objects, sts, http, (ns, {}, labels)), client["metadata"]["name"]
    prometheus = (PROMETHEUS[0], {}, PROMETHEUS[1])
    assert admitted(objects, sts, http, prometheus), "Prometheus cannot scrape"
    assert admitted(objects, sts, http, ("team-a", CLIENT_NAMESPACE_LABEL, CLIENT_LABEL))
    refused = {
        "an unlabelled pod of the namespace": (ns, {}, {"app": "curl"}),
        "a labelled pod of another namespace": ("team-b", {}, CLIENT_LABEL),
        "a pod of a clients' namespace without the label": ("team-a", CLIENT_NAMESPACE_LABEL, {}),
        "a Prometheus-labelled pod outside monitoring": (ns, {}, PROMETHEUS[1]),
        "any pod of monitoring": ("monitoring", {}, {"app": "grafana"}),
    }  # fmt: skip
    for what, source in refused.items():
        assert not admitted(objects, sts, http, source), f"admitted: {what}"
    for source in [(ns, {}, CLIENT_LABEL), prometheus]:
        assert not admitted(objects, sts, other_port, source), "a port beyond http admitted"
    for dep in [o for o in objects if o["kind"] == "Deployment"]:
        for c in pod_spec(dep)["containers"]:
            for port in c.get("ports", [{"containerPort": 5555}, {"containerPort": 8080}]):
                for source in [(ns, {}, CLIENT_LABEL), (ns, {}, {}), prometheus]:
                    assert not admitted(objects, dep, port, source), (
                        f"{dep['metadata']['name']}: port {port['containerPort']} admitted"
                    )


@pytest.mark.parametrize("name", [d.name for d in OVERLAYS])
def test_a_network_policy_admits_only_the_caches_clients(every_overlay, name):
    assert_only_the_caches_clients_reach_eg_kv(every_overlay[name])


def _break_policy(objects: list[dict], breakage: str) -> list[dict]:
    objects = copy.deepcopy(objects)
    policy = one(objects, "NetworkPolicy", "eg-kv")
    spec = policy["spec"]
    if breakage == "no policy":
        objects.remove(policy)
    elif breakage == "every source":
        del spec["ingress"][0]["from"]
    elif breakage == "every port":
        del spec["ingress"][1]["ports"]
    elif breakage == "every namespace":
        spec["ingress"][0]["from"][1]["namespaceSelector"] = {}
    elif breakage == "another pod selected":
        spec["podSelector"] = {"matchLabels": {"app.kubernetes.io/name": "eg-kv-old"}}
    elif breakage == "egress only":
        spec["policyTypes"] = ["Egress"]
    elif breakage == "prometheus from anywhere":
        del spec["ingress"][1]["from"][0]["namespaceSelector"]
    elif breakage == "an unlabelled client":
        dep = one(objects, "Deployment", "lmcache")
        del dep["spec"]["template"]["metadata"]["labels"]["eg-kv/client"]
    else:
        objects.remove(one(objects, "NetworkPolicy", "lmcache"))
    return objects


@pytest.mark.parametrize(
    "breakage",
    ["no policy", "every source", "every port", "every namespace", "another pod selected",
     "egress only", "prometheus from anywhere", "an unlabelled client", "lmcache open"],
)  # fmt: skip
def test_the_network_policy_checks_catch_a_broken_policy(overlay, breakage):
    with pytest.raises(AssertionError):
        assert_only_the_caches_clients_reach_eg_kv(_break_policy(overlay, breakage))


# ---- TLS


def mounted_file(obj: dict, c: dict, path: str) -> tuple[dict, dict, str]:
    """The mount, the pod volume and the volume's key behind file ``path`` of ``c``."""
    mounts = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"] + "/")]
    assert len(mounts) == 1, f"{c['name']}: {path} is on {len(mounts)} mounts"
    (mount,) = mounts
    (volume,) = [v for v in pod_spec(obj)["volumes"] if v["name"] == mount["name"]]
    name = path[len(mount["mountPath"]) + 1 :]
    items = {i["path"]: i["key"] for i in volume.get("secret", {}).get("items", [])}
    return mount, volume, items.get(name, name)


def dns_name_matches(pattern: str, name: str) -> bool:
    """RFC 6125 matching as Python's ssl does it: a wildcard stands for one left label."""
    if pattern.startswith("*."):
        head, _, rest = name.partition(".")
        return bool(head) and rest == pattern[2:]
    return pattern == name


def certificates(directory: Path = CERT_MANAGER) -> dict[str, dict]:
    objects = build(directory)
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objects}


def assert_served_over_tls(objects: list[dict], issued: dict[str, dict]) -> None:
    """eg-kv serves HTTPS with the key and certificate of the Secret eg-kv-tls; its probes
    use HTTPS; every client uses https and trusts that Secret's ca.crt, and is given
    nothing else of it; the ServiceMonitor checks the certificate; the cert-manager
    example issues that Secret for the names the clients check."""
    from eg_kv.config import ENV_TLS_CERT, ENV_TLS_KEY, ENV_TOKEN, ENV_URL

    sts = one(objects, "StatefulSet", "eg-kv")
    eg = container(sts, "eg-kv")
    env = resolved_env(sts, eg)
    for var, key in ((ENV_TLS_CERT, "tls.crt"), (ENV_TLS_KEY, "tls.key")):
        assert var in env, f"{var} unset: eg-kv serves plain HTTP"
        mount, volume, got = mounted_file(sts, eg, env[var])
        assert mount.get("readOnly"), f"{var}: a writable mount"
        secret = volume["secret"]
        assert (secret["secretName"], got) == ("eg-kv-tls", key), var
        assert not secret.get("optional"), "a pod without its certificate would serve HTTP"
        assert secret["defaultMode"] & 0o007 == 0, "the key is world-readable"
    settings = serve_settings(sts, {ENV_TOKEN: "t", **env})
    assert settings.scheme == "https" and settings.tls_key == env[ENV_TLS_KEY]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert eg[probe]["httpGet"].get("scheme") == "HTTPS", probe
    namespace = sts["metadata"]["namespace"]
    server_names = [f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}.{namespace}"
                    f".svc.cluster.local" for i in range(sts["spec"]["replicas"] + 8)]  # fmt: skip
    # The clients: https, and the CA alone.
    maps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    for client in eg_kv_clients(objects):
        for c in pod_spec(client)["containers"]:
            cenv = {k: v for ref in c.get("envFrom", [])
                    for k, v in maps[ref["configMapRef"]["name"]]["data"].items()}  # fmt: skip
            cenv.update(resolved_env(client, c))
            if ENV_URL not in cenv:
                continue
            assert cenv[ENV_URL].startswith("dnssrv+https://"), cenv[ENV_URL]
            assert "SSL_CERT_FILE" in cenv, "the client does not trust the issuing CA"
            _, volume, key = mounted_file(client, c, cenv["SSL_CERT_FILE"])
            assert (volume["secret"]["secretName"], key) == ("eg-kv-tls", "ca.crt")
            for v in pod_spec(client)["volumes"]:
                if v.get("secret", {}).get("secretName") == "eg-kv-tls":
                    keys = [i["key"] for i in v["secret"].get("items", [{"key": "all"}])]
                    assert keys == ["ca.crt"], f"a client is given {keys} of eg-kv-tls"
    (endpoint,) = one(objects, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "eg-kv-tls", "key": "ca.crt"}
    assert not endpoint["tlsConfig"].get("insecureSkipVerify")
    # The example certificate: the Secret, the names, a CA that signs it.
    cert = issued["Certificate/eg-kv-tls"]
    assert cert["spec"]["secretName"] == "eg-kv-tls"
    assert cert["metadata"]["namespace"] == namespace
    assert "server auth" in cert["spec"]["usages"]
    names = cert["spec"]["dnsNames"]
    for name in [*server_names, endpoint["tlsConfig"]["serverName"]]:
        assert any(dns_name_matches(p, name) for p in names), f"the certificate lacks {name}"
    issuer = issued[f"Issuer/{cert['spec']['issuerRef']['name']}"]
    ca = issued[f"Certificate/{issuer['spec']['ca']['secretName']}"]
    assert ca["spec"]["isCA"] and ca["spec"]["secretName"] == issuer["spec"]["ca"]["secretName"]
    assert "selfSigned" in issued[f"Issuer/{ca['spec']['issuerRef']['name']}"]["spec"]


@pytest.fixture(scope="module")
def tls() -> list[dict]:
    return build(TLS)


def test_the_tls_overlay_serves_https_with_the_secret_and_its_clients_trust_it(tls):
    assert_served_over_tls(tls, certificates())
    # The same objects as the example overlay, patched: nothing added, nothing lost.
    assert sorted(o["kind"] for o in tls) == sorted(o["kind"] for o in build(OVERLAY))
    # Without the component the example overlay serves plain HTTP: the check says so.
    with pytest.raises(AssertionError):
        assert_served_over_tls(build(OVERLAY), certificates())
    # The patched workloads are still valid, offline.
    docs = [one(tls, "StatefulSet", "eg-kv"), one(tls, "Deployment", "lmcache")]
    out = subprocess.run(
        [sys.executable, "-c", _VALIDATE_OFFLINE], input=json.dumps([docs, list(VERSIONS)]),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]


def _break_tls(objects: list[dict], issued: dict, breakage: str) -> tuple[list, dict]:
    objects, issued = copy.deepcopy(objects), copy.deepcopy(issued)
    sts = one(objects, "StatefulSet", "eg-kv")
    tls_volume = next(v for v in pod_spec(sts)["volumes"] if v["name"] == "tls")["secret"]
    if breakage == "no key":
        container(sts, "eg-kv")["env"] = [
            e for e in container(sts, "eg-kv")["env"] if not e["name"].endswith("TLS_KEY")
        ]
    elif breakage == "a world-readable key":
        tls_volume["defaultMode"] = 0o444
    elif breakage == "an optional secret":
        tls_volume["optional"] = True
    elif breakage == "probes over http":
        del container(sts, "eg-kv")["readinessProbe"]["httpGet"]["scheme"]
    elif breakage == "a client over http":
        cm = one(objects, "ConfigMap", "lmcache-eg-kv")
        cm["data"]["EPISTEMIC_GRAPH_KVCACHE_URL"] = cm["data"][
            "EPISTEMIC_GRAPH_KVCACHE_URL"].replace("https", "http")  # fmt: skip
    elif breakage == "a client given the key":
        dep = one(objects, "Deployment", "lmcache")
        del next(v for v in pod_spec(dep)["volumes"] if v["name"] == "eg-kv-ca")["secret"]["items"]
    elif breakage == "a scrape that trusts anything":
        (endpoint,) = one(objects, "ServiceMonitor")["spec"]["endpoints"]
        endpoint["tlsConfig"]["insecureSkipVerify"] = True
    else:
        issued["Certificate/eg-kv-tls"]["spec"]["dnsNames"] = ["eg-kv.kvcache.svc.cluster.local"]
    return objects, issued


@pytest.mark.parametrize(
    "breakage",
    ["no key", "a world-readable key", "an optional secret", "probes over http",
     "a client over http", "a client given the key", "a scrape that trusts anything",
     "a certificate without the members' names"],
)  # fmt: skip
def test_the_tls_checks_catch_a_broken_shape(tls, breakage):
    with pytest.raises(AssertionError):
        assert_served_over_tls(*_break_tls(tls, certificates(), breakage))


_TLS_CLIENT = """
import os, sys
from eg_kv.client.connectors import RemoteKVConnector
from eg_kv.client.settings import KvCacheConfig
port, name = sys.argv[1], sys.argv[2]
config = KvCacheConfig(base_url=f"https://127.0.0.1:{port}", server_name=name,
                       token=os.environ["EPISTEMIC_GRAPH_KVCACHE_TOKEN"], timeout_s=10,
                       local_reads=False)
with RemoteKVConnector(config) as kv:
    data = b"over tls " * 1000
    ok = kv.put("k8s-tls-check", data) and kv.get("k8s-tls-check") == data
print("roundtrip" if ok else "refused")
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_server_started_as_the_tls_component_says_is_trusted_by_a_client_as_configured(
    tls, server_factory, tmp_path
):
    """Real processes: the Secret's files (a CA and a certificate for the example's
    dnsNames, made here) where the manifests mount them, the server started with the
    StatefulSet's environment, and a client with the LMCache container's SSL_CERT_FILE
    that checks the name of a member as the SRV records give it."""
    import trustme

    from eg_kv.config import ENV_TOKEN

    sts, dep = one(tls, "StatefulSet", "eg-kv"), one(tls, "Deployment", "lmcache")
    eg, lm = container(sts, "eg-kv"), container(dep, "lmcache")
    ca = trustme.CA()
    cert = ca.issue_cert(*certificates()["Certificate/eg-kv-tls"]["spec"]["dnsNames"])
    secret = {"tls.crt": b"".join(p.bytes() for p in cert.cert_chain_pems),
              "tls.key": cert.private_key_pem.bytes(), "ca.crt": ca.cert_pem.bytes()}  # fmt: skip

    def local(obj: dict, c: dict, path: str) -> str:
        """Where the kubelet would put file ``path`` of ``c``: here, under tmp_path."""
        mount, _, key = mounted_file(obj, c, path)
        local_path = tmp_path / mount["name"] / path[len(mount["mountPath"]) + 1 :]
        local_path.parent.mkdir(parents=True, exist_ok=True)
        local_path.write_bytes(secret[key])
        return str(local_path)

    env = {k: local(sts, eg, v) if k.endswith(("TLS_CERT", "TLS_KEY")) else v
           for k, v in resolved_env(sts, eg).items()}  # fmt: skip
    token = "k8s-tls-token-0123456789"
    srv = server_factory(workers=1, wait=False, env={**env, ENV_TOKEN: token})
    ctx = ssl_context(secret["ca.crt"])
    wait_for_https(srv, ctx)
    cm = one(tls, "ConfigMap", "lmcache-eg-kv")
    ca_file = local(dep, lm, cm["data"]["SSL_CERT_FILE"])

    def client(name: str, **more: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", _TLS_CLIENT, str(srv.port), name],
            env={**os.environ, ENV_TOKEN: token, **more}, capture_output=True, text=True,
            timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip()

    member = "eg-kv-2.eg-kv.kvcache.svc.cluster.local"
    assert client(member, SSL_CERT_FILE=ca_file) == "roundtrip"
    # The name is checked, and the CA is what makes it trusted.
    assert client("eg-kv-2.eg-kv.other.svc.cluster.local", SSL_CERT_FILE=ca_file) == "refused"
    empty = tmp_path / "empty.pem"
    empty.write_bytes(b"")
    assert client(member, SSL_CERT_FILE=str(empty), SSL_CERT_DIR=str(tmp_path)) == "refused"


def ssl_context(ca_pem: bytes):
    """A context trusting ``ca_pem`` that, like the kubelet's probes, checks no name."""
    import ssl

    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    ctx.check_hostname = False
    return ctx


def wait_for_https(srv, ctx) -> None:
    """Wait until the server answers /healthz over HTTPS (it may exit instead)."""
    import urllib.request

    from helpers.common import wait_for

    def healthy() -> bool:
        if srv.proc.poll() is not None:
            return True
        url = f"https://127.0.0.1:{srv.port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
                return json.loads(r.read()).get("workers_up") == 1
        except OSError:
            return False

    wait_for(healthy, timeout=60, what="the TLS server to answer /healthz")
    assert srv.proc.poll() is None, srv.log()


# ---- LMCache's listeners


def lmcache_containers(objects: list[dict]) -> list[tuple[dict, dict]]:
    return [(o, c) for o in objects for c in (pod_spec(o) or {}).get("containers", [])
            if c.get("command", [])[:2] == ["lmcache", "server"]]  # fmt: skip


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def assert_lmcache_listens_on_loopback(objects: list[dict]) -> None:
    """Each LMCache server binds its ZMQ and HTTP listeners to loopback (they have no
    authentication, and the pod holds eg-kv's token), declares no port for them, and
    opens no other listener (gRPC transport, P2P)."""
    found = lmcache_containers(objects)
    assert found, "no LMCache container"
    for obj, c in found:
        args = c["args"]
        where = f"{obj['metadata']['name']}/{c['name']}"
        # LMCache's defaults are localhost for both, but say it: a default can change.
        assert flag(args, "--host") in LOOPBACK, f"{where}: ZMQ on {flag(args, '--host')}"
        assert flag(args, "--http-host") in LOOPBACK, f"{where}: HTTP on every interface"
        assert not c.get("ports"), f"{where}: declares ports for loopback listeners"
        for other in ("--p2p-listen-url", "--p2p-advertise-url", "--transport"):
            assert other not in args, f"{where}: {other} opens another listener"


@pytest.mark.parametrize("name", [d.name for d in OVERLAYS])
def test_lmcaches_listeners_stay_on_loopback(every_overlay, name):
    assert_lmcache_listens_on_loopback(every_overlay[name])


@pytest.mark.parametrize(
    "breakage", ["zmq on every interface", "http on every interface", "a declared port"]
)
@pytest.mark.parametrize("name", ["example", "local-reads"])
def test_the_loopback_checks_catch_a_listener_beyond_the_pod(every_overlay, name, breakage):
    objects = copy.deepcopy(every_overlay[name])
    _, c = lmcache_containers(objects)[0]
    if breakage == "a declared port":
        c["ports"] = [{"name": "zmq", "containerPort": 5555, "protocol": "TCP"}]
    else:
        f = "--host" if breakage.startswith("zmq") else "--http-host"
        c["args"][c["args"].index(f) + 1] = "0.0.0.0"
    with pytest.raises(AssertionError):
        assert_lmcache_listens_on_loopback(objects)


@pytest.mark.lmcache
@pytest.mark.parametrize("name", ["example", "local-reads"])
def test_lmcaches_own_configuration_binds_loopback(every_overlay, name):
    """LMCache's own parsers turn the manifests' arguments into the bind addresses."""
    import argparse

    pytest.importorskip("lmcache")
    from lmcache.cli.commands.server import ServerCommand
    from lmcache.v1.multiprocess.config import (
        parse_args_to_http_frontend_config,
        parse_args_to_mp_server_config,
    )

    for _, c in lmcache_containers(every_overlay[name]):
        parser = argparse.ArgumentParser(prog="lmcache server")
        ServerCommand().add_arguments(parser)
        args = parser.parse_args(c["args"])
        assert parse_args_to_mp_server_config(args).host == "127.0.0.1"
        assert parse_args_to_http_frontend_config(args).http_host == "127.0.0.1"


# ---- securityContexts


def effective_security(obj: dict, c: dict) -> dict:
    """A container's security settings: its own securityContext over the pod's."""
    pod, own = pod_spec(obj).get("securityContext", {}), c.get("securityContext", {})
    keys = ("runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile")
    return {**{k: pod[k] for k in keys if k in pod}, **own}


def assert_every_container_is_hardened(objects: list[dict]) -> None:
    """Every container: non-root (runAsNonRoot and a uid that is not 0), no privilege
    escalation, not privileged, every capability dropped and none added, a read-only root
    file system, seccomp RuntimeDefault; no pod shares the host's namespaces."""
    pods = [o for o in objects if pod_spec(o)]
    assert pods
    for obj in pods:
        spec = pod_spec(obj)
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(host), f"{obj['metadata']['name']}: {host}"
        assert not spec.get("automountServiceAccountToken", True), "a service account token"
        for c in spec["containers"] + spec.get("initContainers", []):
            where = f"{obj['metadata']['name']}/{c['name']}"
            sec = effective_security(obj, c)
            assert sec.get("runAsNonRoot") is True, f"{where}: runAsNonRoot"
            assert sec.get("runAsUser") and sec.get("runAsGroup"), f"{where}: root uid or gid"
            assert sec.get("allowPrivilegeEscalation") is False, f"{where}: escalation"
            assert not sec.get("privileged"), f"{where}: privileged"
            caps = sec.get("capabilities", {})
            assert caps.get("drop") == ["ALL"] and not caps.get("add"), f"{where}: {caps}"
            assert sec.get("readOnlyRootFilesystem") is True, f"{where}: writable root"
            assert sec.get("seccompProfile") == {"type": "RuntimeDefault"}, f"{where}: seccomp"
            # A read-only root: the temp folder, and a home where one is set, are writable.
            mounted = {m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
            env = resolved_env(obj, c)
            assert "/tmp" in mounted, f"{where}: no writable /tmp"
            assert env.get("HOME", "/tmp") in mounted, f"{where}: HOME is read-only"


@pytest.mark.parametrize("name", [d.name for d in OVERLAYS])
def test_every_container_runs_non_root_without_privileges(every_overlay, name):
    assert_every_container_is_hardened(every_overlay[name])


@pytest.mark.parametrize(
    "breakage",
    ["root", "runAsNonRoot off", "escalation", "privileged", "a capability kept",
     "a capability added", "a writable root", "no seccomp", "host network", "no /tmp"],
)  # fmt: skip
@pytest.mark.parametrize("name", ["example", "local-reads"])
def test_the_security_checks_catch_a_loosened_container(every_overlay, name, breakage):
    objects = copy.deepcopy(every_overlay[name])
    obj, c = lmcache_containers(objects)[0]
    sec, pod = c["securityContext"], pod_spec(obj)["securityContext"]
    if breakage == "root":
        sec["runAsUser"] = 0
    elif breakage == "runAsNonRoot off":
        sec.pop("runAsNonRoot")
        pod.pop("runAsNonRoot")
    elif breakage == "escalation":
        sec["allowPrivilegeEscalation"] = True
    elif breakage == "privileged":
        sec["privileged"] = True
    elif breakage == "a capability kept":
        sec["capabilities"]["drop"] = ["NET_RAW"]
    elif breakage == "a capability added":
        sec["capabilities"]["add"] = ["SYS_ADMIN"]
    elif breakage == "a writable root":
        sec["readOnlyRootFilesystem"] = False
    elif breakage == "no seccomp":
        pod.pop("seccompProfile")
    elif breakage == "host network":
        pod_spec(obj)["hostNetwork"] = True
    else:
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != "/tmp"]
    with pytest.raises(AssertionError):
        assert_every_container_is_hardened(objects)


# ---- the real kustomize, where kubectl is installed


def _order_free(value):
    """``value`` with every list sorted: kustomize's strategic merge puts a patch's list
    items before the base's, this file's build after them; the objects are the same."""
    if isinstance(value, dict):
        return {k: _order_free(v) for k, v in value.items()}
    if isinstance(value, list):
        return sorted((_order_free(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    return value


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl (its kustomize) not installed")
@pytest.mark.parametrize(
    "directory", [BASE, CERT_MANAGER, *OVERLAYS], ids=lambda d: str(d.relative_to(K8S))
)
def test_kubectls_kustomize_builds_the_same_objects(directory):
    out = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    real = {(o["kind"], o["metadata"]["name"]): _order_free(o)
            for o in yaml.safe_load_all(out.stdout) if o}  # fmt: skip
    ours = {(o["kind"], o["metadata"]["name"]): _order_free(o) for o in build(directory)}
    assert real == ours
