"""The asyncio eg-kv client: :class:`AsyncRemoteKVConnector` on an ``aiohttp`` session.

The same methods as :class:`eg_kv.client.RemoteKVConnector`, as coroutines, with the same
rule: the hot path (``get``, ``put``, ``contains``, ``exists``, ``delete``,
``contains_prefix``, ``exists_many``) turns every transport or protocol error into a miss
and never waits past the timeout; ``stats()`` raises a clear error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp

from .client import (
    BATCH_EXISTS_MAX,
    KvCacheConfig,
    KvCacheStats,
    _Miss,
    batch_answer,
    resolve_config,
    to_address,
)
from .errors import EgKvError, RemoteError, Unauthorized

log = logging.getLogger("eg_kv.kvcache")


class AsyncRemoteKVConnector:
    """Asyncio eg-kv client. An async context manager.

    Pass ``session=`` to share a caller-owned ``aiohttp.ClientSession`` (the caller keeps
    owning it: :meth:`close` leaves it open); otherwise the connector opens its own on
    first use, in the running loop, and closes it in :meth:`close`.
    """

    def __init__(
        self,
        config: KvCacheConfig | None = None,
        *,
        session: aiohttp.ClientSession | None = None,
        **settings: Any,
    ) -> None:
        """Args:
            config: a ready config, or leave it out and pass ``settings``.
            session: a caller-owned session to send requests on.
            **settings: ``base_url``, ``addr``, ``token``, ``timeout_s``,
                ``max_connections``, ``verify_tls`` (others are accepted and unused);
                what is left out comes from the environment.

        Raises:
            ConfigError: a setting cannot be used.
        """
        self.config = resolve_config(config, settings)
        self._session = session
        self._owns_session = session is None
        self._headers: dict[str, str] = {}
        if self.config.token:
            self._headers["Authorization"] = f"Bearer {self.config.token}"
        self._timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        self._base = self.config.base_url
        self._closed = False
        self._warned_401 = False

    @classmethod
    def from_env(
        cls, *, session: aiohttp.ClientSession | None = None, **settings: Any
    ) -> AsyncRemoteKVConnector:
        """A connector configured from ``EPISTEMIC_GRAPH_KVCACHE_*`` (keywords override).

        Raises:
            ConfigError: a setting cannot be used.
        """
        return cls(KvCacheConfig.from_env(**settings), session=session)

    def __repr__(self) -> str:
        return f"AsyncRemoteKVConnector({self._base!r})"

    async def __aenter__(self) -> AsyncRemoteKVConnector:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the session if this connector opened it. Idempotent."""
        self._closed = True
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RemoteError("the connector is closed")
        if self._session is None:
            ssl_arg: Any = None if self.config.verify_tls else False
            connector = aiohttp.TCPConnector(limit=self.config.max_connections, ssl=ssl_arg)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    def _miss(self, what: str, address: str, exc: BaseException) -> None:
        if isinstance(exc, Unauthorized) and not self._warned_401:
            self._warned_401 = True
            log.warning("eg-kv at %s refused the bearer token (401)", self._base)
        log.debug("eg-kv %s %s: miss (%s: %s)", what, address, type(exc).__name__, exc)

    def _url(self, address: str, suffix: str = "") -> str:
        return f"{self._base}/kv/{address}{suffix}"

    async def _request(self, method: str, url: str, **kw: Any) -> tuple[int, bytes, int | None]:
        """One request; returns (status, body, declared length). Raises on any error."""
        session = self._get_session()
        headers = dict(self._headers)
        headers.update(kw.pop("headers", {}))
        for attempt in (0, 1):
            try:
                async with session.request(
                    method, url, headers=headers, timeout=self._timeout, **kw
                ) as resp:
                    if resp.status == 401:
                        raise Unauthorized("the server wants a valid bearer token")
                    body = await resp.read()
                    return resp.status, body, resp.content_length
            except aiohttp.ServerDisconnectedError:
                # A pooled connection the server closed while idle: every request here is
                # idempotent, so one retry on a fresh connection is safe.
                if attempt:
                    raise
        raise RemoteError("unreachable")  # pragma: no cover

    async def _json(self, method: str, url: str, **kw: Any) -> Any:
        status, body, _ = await self._request(method, url, **kw)
        if status != 200:
            raise _Miss(f"HTTP {status}")
        try:
            return json.loads(body)
        except ValueError:
            raise _Miss("the answer is not JSON") from None

    async def get(self, key: str | bytes) -> bytes | None:
        """``GET /kv/<addr>``: the block's bytes, or None on a miss or any error.

        A body shorter than its ``Content-Length`` (block evicted mid-stream) is a miss.
        """
        address = to_address(key)
        try:
            status, body, length = await self._request("GET", self._url(address))
        except Exception as exc:  # asyncio.TimeoutError included
            self._miss("GET", address, exc)
            return None
        if status != 200 or length is None or len(body) != length:
            return None
        return body

    async def put(self, key: str | bytes, data: Any) -> bool:
        """``PUT /kv/<addr>``. True when stored (201) or deduplicated (200); else False."""
        address = to_address(key)
        try:
            payload = memoryview(data).cast("B")
            status, _, _ = await self._request(
                "PUT",
                self._url(address),
                data=payload,
                headers={"Content-Type": "application/octet-stream"},
            )
        except Exception as exc:  # asyncio.TimeoutError included
            self._miss("PUT", address, exc)
            return False
        return status in (200, 201)

    async def _status(self, method: str, address: str) -> int | None:
        try:
            status, _, _ = await self._request(method, self._url(address))
            return status
        except Exception as exc:  # asyncio.TimeoutError included
            self._miss(method, address, exc)
            return None

    async def contains(self, key: str | bytes) -> bool:
        """``HEAD /kv/<addr>``: True when resident; False on a miss or any error."""
        return await self._status("HEAD", to_address(key)) == 200

    async def delete(self, key: str | bytes) -> bool:
        """``DELETE /kv/<addr>``: True on 204; False otherwise."""
        return await self._status("DELETE", to_address(key)) == 204

    async def exists(self, key: str | bytes) -> bool:
        """``GET /kv/<addr>/exists``: True when resident; False on a miss or any error."""
        address = to_address(key)
        try:
            doc = await self._json("GET", self._url(address, "/exists"))
            found = doc.get("exists") if isinstance(doc, dict) else None
            if not isinstance(found, bool):
                raise _Miss("no boolean 'exists' in the answer")
            return found
        except Exception as exc:  # asyncio.TimeoutError included
            self._miss("exists", address, exc)
            return False

    async def _batch(self, addresses: list[str]) -> tuple[list[bool], int]:
        doc = await self._json(
            "POST", f"{self._base}/kv/batch/exists", json={"addresses": addresses}
        )
        return batch_answer(doc, len(addresses))

    async def exists_many(self, keys: Sequence[str | bytes]) -> list[bool]:
        """One bool per key (one batch request per 1024 keys); False where a batch failed."""
        addresses = [to_address(k) for k in keys]
        out: list[bool] = []
        for i in range(0, len(addresses), BATCH_EXISTS_MAX):
            chunk = addresses[i : i + BATCH_EXISTS_MAX]
            try:
                out.extend((await self._batch(chunk))[0])
            except Exception as exc:  # asyncio.TimeoutError included
                self._miss("batch/exists", f"[{len(chunk)} addresses]", exc)
                out.extend([False] * len(chunk))
        return out

    async def contains_prefix(self, keys: Sequence[str | bytes]) -> int:
        """How many keys, from the first, are resident without a gap; 0 on any error."""
        addresses = [to_address(k) for k in keys]
        total = 0
        for i in range(0, len(addresses), BATCH_EXISTS_MAX):
            chunk = addresses[i : i + BATCH_EXISTS_MAX]
            try:
                prefix = (await self._batch(chunk))[1]
            except Exception as exc:  # asyncio.TimeoutError included
                self._miss("batch/exists", f"[{len(chunk)} addresses]", exc)
                return total
            total += prefix
            if prefix < len(chunk):
                break
        return total

    async def stats(self) -> KvCacheStats:
        """``GET /kv/stats``.

        Raises:
            Unauthorized: the server refused the token.
            RemoteError: the server is unreachable or answered something unusable.
        """
        try:
            doc = await self._json("GET", f"{self._base}/kv/stats")
        except EgKvError:
            raise
        except Exception as exc:  # asyncio.TimeoutError included
            raise RemoteError(
                f"cannot read /kv/stats from {self._base}: {type(exc).__name__}: {exc}"
            ) from None
        return KvCacheStats.from_json(doc)
