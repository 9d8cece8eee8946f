"""Opening a TCP connection within one deadline: the sync client's connect.

``socket.create_connection`` bounds neither the name lookup (``getaddrinfo`` waits for the
resolver's own timeouts: 6 s with a silent DNS server and ``timeout_s=1``) nor the whole
connect (each address the name resolves to gets the full timeout: 3 s for three
addresses that drop SYNs). Here the lookup runs on a thread of its own and is waited for
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

__all__ = ["MAX_LOOKUPS", "open_tcp"]

#: Name lookups under way at once, per process (each on a daemon thread of its own: one
#: a silent DNS server holds never holds up the process's exit).
MAX_LOOKUPS = 16

_Addresses = list[tuple[Any, ...]]
_lock = threading.Lock()
_pending: dict[tuple[str, int], concurrent.futures.Future[_Addresses]] = {}
_pending_pid = 0


def _lookup(host: str, port: int) -> concurrent.futures.Future[_Addresses]:
    """The lookup of ``host`` under way, or a new one (a forked child forgets its
    parent's: their threads are not its own).

    Raises:
        OSError: :data:`MAX_LOOKUPS` lookups are under way.
    """
    global _pending_pid
    key = (host, port)
    with _lock:
        if _pending_pid != os.getpid():
            _pending.clear()
            _pending_pid = os.getpid()
        future = _pending.get(key)
        if future is None:
            if len(_pending) >= MAX_LOOKUPS:
                raise OSError(f"{MAX_LOOKUPS} name lookups are under way; {host} waits")
            future = _pending[key] = concurrent.futures.Future()
            threading.Thread(target=_run, args=(key, future), name="eg-kv-lookup",
                             daemon=True).start()  # fmt: skip
        return future


def _run(key: tuple[str, int], future: concurrent.futures.Future[_Addresses]) -> None:
    try:
        future.set_result(socket.getaddrinfo(key[0], key[1], 0, socket.SOCK_STREAM))
    except BaseException as e:
        future.set_exception(e)
    finally:
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
