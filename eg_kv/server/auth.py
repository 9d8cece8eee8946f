"""Who a request is and what it may do: tokens, tenants and roles, for one worker.

:class:`Auth` finds a request's tenant from its ``Authorization`` header (remembering the
spellings that authenticated, so the token is not hashed per request), :func:`authorize`
says whether the tenant's role allows the method on the route, and :func:`auth_from`
reads the tenants a worker starts with (a tokens file, the single token, or nobody).
Reloads (SIGHUP) swap the table whole.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Protocol

from ..config import Settings
from ..errors import ConfigError, EgKvError, Forbidden
from ..slab.store import Slab
from ..wire import AUTHORIZATION
from . import runstate
from .tenants import ANONYMOUS, ROLES, Tenant, TenantTable, single_token
from .tenants import load as load_tenants

log = logging.getLogger("eg_kv.server.auth")

#: The one spelling of an Authorization header a worker remembers (Auth.authenticate):
#: any other (padding, a lowercase scheme) takes the digest every time, so no client can
#: fill the memo with paddings of its own token (8 KiB each).
CANONICAL_SCHEME = "Bearer "


class Headed(Protocol):
    """What authentication reads of a request: its headers (a request, or a parsed
    message)."""

    @property
    def headers(self) -> Mapping[str, str]: ...


class Auth:
    """Who may do what. ``table`` None: no token configured, anyone is an admin of the
    default namespace (as before tenants). Swapped whole on a reload (SIGHUP).

    Args:
        table: the tenants (namespace ids not yet bound to the slab).
        tokens_file: where the table came from; None for the single token or none.
    """

    def __init__(self, table: TenantTable | None, tokens_file: str | None = None) -> None:
        self.tokens_file = tokens_file
        #: Whether a tokens file is in use (per-namespace stats, admin-only metrics).
        self.tenants_mode = tokens_file is not None
        self.table = table

    @property
    def table(self) -> TenantTable | None:
        return self._table

    @table.setter
    def table(self, table: TenantTable | None) -> None:
        # A new table (bound to the slab, or reloaded) forgets every header it had seen,
        # so a token the reload removed is refused from the next request on.
        self._table = table
        self._seen: dict[str, Tenant] = {}
        self._seen_max = len(table.by_digest) if table else 0  # one spelling per token

    def authenticate(self, request: Headed) -> Tenant | str:
        """The request's tenant, or why there is none (never the token).

        ``request``: a request, or a parsed message (the fast lane's): only its headers
        are read.

        A token is found by its sha256 digest: the lookup compares digests, so how long
        it takes tells nothing about any token. An ``Authorization`` header that has
        found its tenant once is remembered, if it is spelt ``Bearer <token>`` exactly
        (:data:`CANONICAL_SCHEME`: one entry per token), and found again without the
        digest: hashing the token was
        a tenth of a small GET's CPU in a busy worker. That dict holds only headers that
        authenticated; Python's string hash is keyed per process, so a lookup of any other
        header compares no bytes with a stored one and takes the digest path as before.
        """
        if self._table is None:
            return ANONYMOUS
        header = request.headers.get(AUTHORIZATION)
        if header is not None and (known := self._seen.get(header)) is not None:
            return known
        found = _authenticate(header, self._table)
        if isinstance(found, Tenant) and header is not None and _canonical(header):
            if len(self._seen) >= self._seen_max:
                self._seen.clear()  # never with one spelling per token (a safety net)
            self._seen[header] = found
        return found

    def bind(self, slab: Slab, table: TenantTable) -> TenantTable:
        """``table`` with its namespaces' ids from the slab (quotas set there too).

        The handle's per-namespace address memos are sized for these namespaces and
        emptied (:meth:`eg_kv.slab.view.SlabView.share_key_cache`).
        """
        ids = slab.bind_namespaces(table.quotas)
        slab.share_key_cache(len(ids))
        return table.with_ids(ids)

    def reload(self, slab: Slab, path: str, capacity: int) -> bool:
        """Load the tokens file at ``path`` again; keep the old tenants if it is bad.

        Returns:
            Whether the new tenants are in force. Logs tenant counts and reasons, never
            a token (the file holds none).
        """
        try:
            table = self.bind(slab, load_tenants(path, capacity))
        except (ConfigError, EgKvError) as e:
            log.error("tokens file not reloaded, the old tenants stay: %s", e)
            return False
        self.table = table
        log.info("tokens file %s reloaded: %d tenants in %d namespaces", path,
                 len(table.by_digest), len(table.quotas))  # fmt: skip
        return True


def _canonical(header: str) -> bool:
    """Whether ``header`` is spelt ``Bearer <token>``, with no other whitespace around."""
    if not header.startswith(CANONICAL_SCHEME):
        return False
    cred = header[len(CANONICAL_SCHEME) :]
    return cred == cred.strip()


def _authenticate(header: str | None, table: TenantTable) -> Tenant | str:
    """The tenant whose token ``header`` (an ``Authorization`` value) carries, or why
    there is none (never the token)."""
    if header is None:
        return "authorization required: send Authorization: Bearer <token>"
    scheme, _, cred = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return "authorization required: use the Bearer scheme"
    cred = cred.strip()
    if not cred:
        return "authorization required: the bearer token is empty"
    tenant = table.find(cred.encode("utf-8", "surrogateescape"))
    if tenant is None:
        return "wrong bearer token"
    return tenant


def authorize(route: str, method: str, tenant: Tenant, tenants_mode: bool) -> None:
    """Raise :class:`Forbidden` unless ``tenant``'s role allows ``method`` on ``route``."""
    if route == "block" and method in ("PUT", "DELETE") and not tenant.can_write:
        raise Forbidden(f"tenant {tenant.name} is readonly: {method} needs role readwrite")
    if route == "metrics" and tenants_mode and not tenant.is_admin:
        raise Forbidden(f"tenant {tenant.name} may not read /metrics: it needs role admin")
    if route == "local" and not tenant.is_admin:
        # A local reader maps the whole slab and no token check stands between it and any
        # namespace's blocks: only a tenant the server would let read everything.
        raise Forbidden(f"tenant {tenant.name} may not read the slab locally: it needs role admin")


def roles_refused(route: str, tenants_mode: bool) -> frozenset[str]:
    """The roles :func:`authorize` refuses some method on ``route`` (asked of it)."""
    refused = set()
    for role in ROLES:
        for method in ("GET", "HEAD", "PUT", "DELETE", "POST"):
            try:
                authorize(route, method, Tenant("-", role), tenants_mode)
            except Forbidden:
                refused.add(role)
    return frozenset(refused)


def tokens_path(settings: Settings, run_dir: str | None) -> str | None:
    """The tokens file a worker reads: under a supervisor (``run_dir``), the copy it
    validated and bound in the slab; alone, the configured file (None without one).

    Never the configured file under a supervisor: it may hold edits not yet reloaded
    (SIGHUP), whose namespaces the slab has not bound. The supervisor writes the copy
    again before each fork if it went (a /tmp cleaner).

    Raises:
        ConfigError: under a supervisor, its copy is gone.
    """
    if not settings.tokens_file:
        return None
    if run_dir is None:
        return settings.tokens_file
    copy = runstate.tokens_copy(run_dir)
    if not os.path.exists(copy):
        raise ConfigError(f"the supervisor's copy of the tokens file ({copy}) is gone: "
                          "restart the server (its run directory was removed)")  # fmt: skip
    return copy


def auth_from(settings: Settings, run_dir: str | None) -> Auth:
    """The tenants at start-up: a tokens file, the single token, or nobody (anonymous).

    Raises:
        ConfigError: the tokens file is bad (the message names the line).
    """
    path = tokens_path(settings, run_dir)
    if path is not None:
        return Auth(load_tenants(path, settings.capacity), path)
    if settings.token:
        return Auth(single_token(settings.token))
    return Auth(None)
