"""Tenants: who a bearer token is, what it may do, and which namespace it works in.

The tokens file is TOML, one ``[[tenant]]`` table per token::

    [[tenant]]
    name = "team-a"             # shown in logs, stats and metrics (never the token)
    token_sha256 = "9f86d0..."  # sha256 hex of the bearer token
    role = "readwrite"          # "readwrite" | "readonly" | "admin"
    namespace = "team-a"        # optional, defaults to name; tokens may share one
    quota = "32GiB"             # optional: the most the namespace may hold, in whole
                                # pages, uploads in flight included (Slab._room)
    model = "Qwen/Qwen3-8B"     # optional: the model the namespace's KV events name
                                # (their topic's), instead of --kv-events-model

A presented token is found by its sha256 digest in a dict: the lookup compares digests,
never the token, so it tells nothing about any token whatever the number of tenants.
The namespace names are turned into the slab's namespace ids by
:meth:`eg_kv.slab.store.Slab.bind_namespaces` (ids live in the slab, stable across restarts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import sys
from collections.abc import Mapping

from ..config import TOPIC_PART_RULE, topic_part
from ..errors import ConfigError
from ..units import format_size, parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

READONLY, READWRITE, ADMIN = "readonly", "readwrite", "admin"
ROLES = (READONLY, READWRITE, ADMIN)
#: The namespace of the single token and of anonymous access (namespace id 0).
DEFAULT_NAMESPACE = ""
#: A namespace name is stored in the slab's namespace table (layout.NS_NAME_MAX bytes).
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,63}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_EMPTY_DIGEST = hashlib.sha256(b"").digest()
#: The name the unnamed default namespace goes by in /kv/stats and /metrics: no tenant's.
RESERVED_NAMESPACE = "default"
_KEYS = {"name", "token_sha256", "role", "namespace", "quota", "model"}


@dataclasses.dataclass(frozen=True)
class Tenant:
    """One token's identity: ``ns`` is the slab's namespace id (0: the default one)."""

    name: str
    role: str
    namespace: str = DEFAULT_NAMESPACE
    quota: int = 0  #: bytes; 0 = no quota
    ns: int = 0

    @property
    def can_write(self) -> bool:
        return self.role != READONLY

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN


#: Anonymous access (no token configured): full rights in the default namespace.
ANONYMOUS = Tenant("anonymous", ADMIN)


@dataclasses.dataclass(frozen=True)
class TenantTable:
    """Tenants by the sha256 digest of their token, and each namespace's quota."""

    by_digest: Mapping[bytes, Tenant]
    quotas: Mapping[str, int]  #: namespace name -> quota in bytes (0: none)
    #: namespace name -> the model its KV events name (absent: ``--kv-events-model``)
    models: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def find(self, token: bytes) -> Tenant | None:
        """The tenant whose token is ``token``, or None."""
        return self.by_digest.get(hashlib.sha256(token).digest())

    def namespaces(self) -> list[str]:
        return sorted(self.quotas)

    def with_ids(self, ids: Mapping[str, int]) -> TenantTable:
        """The same table with each tenant's namespace id from ``ids`` (name -> id)."""
        return TenantTable(
            {d: dataclasses.replace(t, ns=ids[t.namespace]) for d, t in self.by_digest.items()},
            self.quotas,
            self.models,
        )


def single_token(token: str) -> TenantTable:
    """The table of the one ``EPISTEMIC_GRAPH_KVCACHE_TOKEN``: an admin, default namespace."""
    digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
    return TenantTable({digest: Tenant("admin", ADMIN)}, {DEFAULT_NAMESPACE: 0})


def _line_of(text: str, index: int) -> int:
    """The line of the ``index``-th (0-based) ``[[tenant]]`` header in ``text``."""
    seen = -1
    for n, line in enumerate(text.splitlines(), 1):
        if re.match(r"\s*\[\[\s*tenant\s*\]\]", line):
            seen += 1
            if seen == index:
                return n
    return 0


def _field_line(text: str, index: int, key: str) -> int:
    """The line of ``key = ...`` inside the ``index``-th tenant table (else its header's)."""
    header = _line_of(text, index)
    lines = text.splitlines()
    for n in range(header, len(lines)):  # lines[header] is the line after the header
        if lines[n].lstrip().startswith("["):
            break
        if re.match(rf"\s*{key}\s*=", lines[n]):
            return n + 1
    return header


def parse(text: str, capacity: int, where: str = "tokens file") -> TenantTable:
    """Parse and validate a tokens file.

    Args:
        text: the file's TOML.
        capacity: the slab's capacity in bytes (no quota may exceed it).
        where: how messages name the file.

    Returns:
        The table (namespace ids all 0 until bound to a slab).

    Raises:
        ConfigError: a message naming the line: malformed TOML, a missing or unknown
            key, a duplicate token, an unknown role, a bad quota or one over capacity.
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: {e}") from None
    unknown = set(doc) - {"tenant"}
    if unknown:
        raise ConfigError(f"{where}: unknown top-level key(s) {sorted(unknown)}: use [[tenant]]")
    entries = doc.get("tenant", [])
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: no [[tenant]] tables: add one per token")
    by_digest: dict[bytes, Tenant] = {}
    quotas: dict[str, int] = {}
    models: dict[str, str] = {}
    names: set[str] = set()
    for k, entry in enumerate(entries):

        def fail(key: str, why: str, k: int = k) -> ConfigError:
            return ConfigError(f"{where} line {_field_line(text, k, key)}: {why}")

        extra = set(entry) - _KEYS
        if extra:
            raise fail(
                sorted(extra)[0], f"unknown key(s) {sorted(extra)}; allowed: {sorted(_KEYS)}"
            )
        name = entry.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise fail("name", "name must be 1-64 characters of [A-Za-z0-9._:@+=-]")
        if name in names:
            raise fail("name", f"tenant name {name!r} is used twice: names must be unique")
        names.add(name)
        digest_hex = entry.get("token_sha256")
        if not isinstance(digest_hex, str) or not _HEX64.fullmatch(digest_hex.lower()):
            raise fail(
                "token_sha256",
                f"tenant {name}: token_sha256 must be 64 hex digits (sha256sum of the token)",
            )
        digest = bytes.fromhex(digest_hex)
        if digest == _EMPTY_DIGEST:  # `printf %s "$TOKEN" | sha256sum` with TOKEN unset
            raise fail(
                "token_sha256",
                f"tenant {name}: token_sha256 is the digest of an empty token (was $TOKEN "
                "set when you ran sha256sum?): a bare 'Bearer' would be this tenant",
            )
        if digest in by_digest:
            raise fail(
                "token_sha256", f"tenant {name}: duplicate token (also {by_digest[digest].name})"
            )
        role = entry.get("role")
        if role not in ROLES:
            raise fail("role", f"tenant {name}: unknown role {role!r}; one of {', '.join(ROLES)}")
        namespace = entry.get("namespace", name)
        if not isinstance(namespace, str) or not NAME_RE.fullmatch(namespace):
            raise fail("namespace", f"tenant {name}: namespace must be 1-64 of [A-Za-z0-9._:+=-]")
        if "@" in namespace:
            raise fail("namespace", f"tenant {name}: the namespace {namespace!r} has '@', which "
                       "ends the namespace in its KV-events topic (kv@pool:<pool>/<namespace>@"
                       "<model>, which ZMQ matches by prefix): choose one without '@' (set "
                       "namespace = ... when the tenant is named so)")  # fmt: skip
        if namespace.lower() == RESERVED_NAMESPACE:
            raise fail("namespace", f"tenant {name}: the namespace {namespace!r} is the "
                       "unnamed default one's name in /kv/stats and /metrics: choose another "
                       "(set namespace = ... when the tenant is named so)")  # fmt: skip
        quota = 0
        if "quota" in entry:
            try:
                quota = parse_size(entry["quota"])
            except (ConfigError, ValueError, TypeError):
                raise fail(
                    "quota", f'tenant {name}: bad quota {entry["quota"]!r}, e.g. "32GiB"'
                ) from None
            if quota < 1:
                raise fail("quota", f"tenant {name}: quota must be at least 1 byte")
            if quota > capacity:
                raise fail(
                    "quota",
                    f"tenant {name}: quota {format_size(quota)} is over the slab's capacity "
                    f"{format_size(capacity)}: lower it or raise --capacity",
                )
        if quotas.get(namespace, 0) and quota and quotas[namespace] != quota:
            raise fail("quota", f"tenant {name}: namespace {namespace} has two different quotas")
        quotas[namespace] = quota or quotas.get(namespace, 0)
        if "model" in entry:
            model = entry["model"]
            if not topic_part(model):
                raise fail("model", f"tenant {name}: model must be {TOPIC_PART_RULE} (a "
                                    "topic's part)")  # fmt: skip
            if models.setdefault(namespace, model) != model:
                raise fail("model", f"tenant {name}: namespace {namespace} has two models "
                                    f"({models[namespace]!r} and {model!r})")  # fmt: skip
        by_digest[digest] = Tenant(name, role, namespace, quota)
    return TenantTable(by_digest, quotas, models)


def load(path: str, capacity: int) -> TenantTable:
    """Read and :func:`parse` the tokens file at ``path``.

    Raises:
        ConfigError: it cannot be read, or see :func:`parse`.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read tokens file {path}: {e}") from None
    return parse(text, capacity, f"tokens file {path}")
