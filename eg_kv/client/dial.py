"""Opening a TCP connection within one deadline: the sync client's connect.

``socket.create_connection`` bounds neither the name lookup (``getaddrinfo`` waits for the
resolver's own timeouts: 6 s with a silent DNS server and ``timeout_s=1``) nor the whole
connect (each address the name resolves to gets the full timeout: 3 s for three
addresses that drop SYNs). Here the lookup runs on a small thread pool and is waited for
only while the deadline lasts (a name looked up by several callers at once is looked up
once), and each address gets what is left of the deadline. A literal IP address needs no
lookup.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LOOKUP_THREADS", "open_tcp"]

#: Name lookups run at once, per process.
LOOKUP_THREADS = 4

_Addresses = list[tuple[Any, ...]]
_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_pid = 0
_pending: dict[tuple[str, int], concurrent.futures.Future[_Addresses]] = {}


def _lookup(host: str, port: int) -> concurrent.futures.Future[_Addresses]:
    """The lookup of ``host`` under way, or a new one (a forked child starts its own
    pool: its parent's threads are not its own)."""
    global _pool, _pool_pid
    key = (host, port)
    with _lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = concurrent.futures.ThreadPoolExecutor(
                LOOKUP_THREADS, thread_name_prefix="eg-kv-lookup"
            )
            _pool_pid = os.getpid()
            _pending.clear()
        future = _pending.get(key)
        if future is None:
            future = _pool.submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
            _pending[key] = future
            future.add_done_callback(lambda f: _done(key, f))
        return future


def _done(key: tuple[str, int], future: concurrent.futures.Future[_Addresses]) -> None:
    with _lock:
        if _pending.get(key) is future:
            del _pending[key]


def _addresses(host: str, port: int, left: Callable[[], float]) -> _Addresses:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:  # a literal: nothing to look up
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    try:
        return _lookup(host, port).result(timeout=left())
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"looking up {host} took longer than the timeout") from None


def open_tcp(host: str, port: int, left: Callable[[], float]) -> socket.socket:
    """A connected TCP socket to ``host``:``port``, the lookup and every address tried
    within ``left()`` (the seconds left of the caller's deadline; it raises
    ``TimeoutError`` once they are spent).

    Raises:
        OSError: the name does not resolve (``socket.gaierror``), every address refused
            or timed out, or the deadline passed (``TimeoutError``).
    """
    error: OSError | None = None
    for family, kind, proto, _name, address in _addresses(host, port, left):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left())
            sock.connect(address)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise error if error is not None else OSError(f"{host} resolves to no address")
