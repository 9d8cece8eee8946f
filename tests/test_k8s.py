"""The Kubernetes deployment: services/k8s (a kustomize base, a ServiceMonitor component,
the LMCache side as an example, and an overlay putting them together).

No cluster runs here and kustomize is neither on PyPI nor in Debian, so the files are
checked directly: every manifest against the Kubernetes OpenAPI schemas shipped inside
kubernetes-validate (offline: the check runs with sockets forbidden), and the manifests
against each other (selectors, port names, the Secret), against our CLI parser, against
eg_kv/config.py's environment names, and against the README's sizing rule. The overlay is
built by a small re-implementation of the kustomize features the files use (resources,
components, namespace, images), which refuses any other feature so it cannot silently
build something kustomize would not.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

K8S = ROOT / "services" / "k8s"
BASE = K8S / "base"
OVERLAY = K8S / "overlays" / "example"
LOCAL_READS = K8S / "overlays" / "local-reads"
DOCKERFILE = ROOT / "services" / "vllm" / "Dockerfile"

kubernetes_validate = pytest.importorskip("kubernetes_validate")

#: The oldest Kubernetes the manifests are meant for, and the newest schemas shipped.
VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
#: Kinds whose schemas are CRDs, not in Kubernetes' OpenAPI: checked structurally below.
CRD_KINDS = {"ServiceMonitor"}
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
         "Deployment"]
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
    assert len(docs) == 5
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


def test_the_service_monitor_has_the_shape_the_operator_wants(overlay):
    sm = one(overlay, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm["spec"]) == {"selector", "endpoints"}
    (endpoint,) = sm["spec"]["endpoints"]
    assert set(endpoint) <= {"port", "path", "scheme", "interval", "scrapeTimeout",
                             "authorization"}  # fmt: skip
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
    from eg_kv.config import ENV_URL
    from eg_kv.members import parse_server_set

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
    from eg_kv.client import CONFIG_KEYWORDS

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
    assert args.port == 5555 and c["ports"][0]["containerPort"] == 5555


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
    assert used - ours <= {"LMCACHE_TRACK_USAGE"}, used - ours


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
    from eg_kv.layout import Geometry

    sts = one(base, "StatefulSet", "eg-kv")
    s = serve_settings(sts)
    c = container(sts, "eg-kv")
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    shm = quantity({v["name"]: v for v in pod_spec(sts)["volumes"]}[mounts["/dev/shm"]][
        "emptyDir"]["sizeLimit"])  # fmt: skip
    # The README's rule, and the slab the server really lays out, with room to spare.
    assert shm >= s.capacity * 1.02 + (64 << 20)
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
    from eg_kv.config import ENV_TOKEN, ENV_URL
    from eg_kv.layout import Geometry
    from eg_kv.members import parse_server_set

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
        ["Service", "StatefulSet", "PodDisruptionBudget", "ServiceMonitor"]
    )
    assert {o["metadata"]["namespace"] for o in local_reads} == {"kvcache"}
    import eg_kv.config as config

    known = {v for k, v in vars(config).items() if k.startswith("ENV_")} | {LOCAL_READS_VAR}
    names = {e["name"] for e in lm["env"]}
    ours = {n for n in names if n.startswith("EPISTEMIC_GRAPH_KVCACHE_")}
    assert ours <= known and names - ours <= {"POD_NAMESPACE", "LMCACHE_TRACK_USAGE"}
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
