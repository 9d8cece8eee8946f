"""The sync client's connections: a bounded LIFO pool of kept-alive HTTP/1.1 connections
(:mod:`eg_kv.client.http11`) to one server, shared by the threads of a
:class:`~eg_kv.client.sync.ServerConnector`."""

from __future__ import annotations

import ssl
import threading
import urllib.parse

from ..config import DEFAULT_HOST
from ..procs import after_fork_in_child
from .http11 import Connection, Deadline, host_header
from .rules import PoolWaitTimeout
from .settings import KvCacheConfig


class Pool:
    """A LIFO pool of kept-alive connections, bounded by ``max_connections``.

    Thread-safe: a connection is used by one thread at a time. At most ``max_connections``
    exist at once; a caller beyond that waits for one (within its deadline). An idle
    connection is checked before reuse (:meth:`Connection.dropped`), so a request goes
    out on one the server closed only when it closed in the last microseconds.

    Fork-safe: a forked child starts with no connections (:meth:`after_fork_in_child`).
    """

    def __init__(self, config: KvCacheConfig) -> None:
        parts = urllib.parse.urlsplit(config.base_url)
        self.host = parts.hostname or DEFAULT_HOST
        self.https = parts.scheme == "https"
        self.port = parts.port or (443 if self.https else 80)
        # A member found through DNS is connected at its address but named (Host, TLS
        # name and SNI) by its server_name.
        self.server_name = config.server_name or self.host
        self.host_header = host_header(self.server_name, self.port, self.https)
        self.ssl_context: ssl.SSLContext | None = None
        if self.https:
            self.ssl_context = ssl.create_default_context()
            if not config.verify_tls:
                self.ssl_context.check_hostname = False
                self.ssl_context.verify_mode = ssl.CERT_NONE
        self._idle: list[Connection] = []
        self._busy: set[Connection] = set()  # in use by a request now
        self._lock = threading.Lock()
        self._max = config.max_connections
        self._slots = threading.BoundedSemaphore(self._max)
        self._closed = False
        after_fork_in_child(self)

    def after_fork_in_child(self) -> None:
        """In a forked child, none of the parent's connections: on a socket both processes
        hold, each read the other's answers (a lookup took another's flags), and the slots
        that the parent's threads held at the fork never came back (every call then waited
        its whole timeout). Only the child's copies of the sockets are closed (``close``,
        never ``shutdown``, which would end the parent's connection too); the lock and the
        slots are new (a parent's thread may have held them at the fork)."""
        conns = [*self._idle, *self._busy]
        self._idle, self._busy = [], set()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self._max)
        for conn in conns:
            conn.close()

    def acquire(self, deadline: Deadline) -> Connection:
        if not self._slots.acquire(timeout=deadline.left()):
            raise PoolWaitTimeout(
                "no free eg-kv connection within the timeout: raise max_connections"
            )
        while True:
            with self._lock:  # one hold on the usual path: an idle connection, reused
                conn = self._idle.pop() if self._idle else None
                if conn is not None:
                    self._busy.add(conn)
            if conn is None:
                conn = Connection(
                    self.host, self.port, self.host_header, self.ssl_context, self.server_name
                )
                with self._lock:
                    self._busy.add(conn)
                return conn
            if not conn.dropped():
                return conn
            with self._lock:
                self._busy.discard(conn)
            conn.close()

    def release(self, conn: Connection, reusable: bool) -> None:
        with self._lock:
            self._busy.discard(conn)
            keep = reusable and not self._closed and not conn.will_close  # (not aborted)
            if keep:
                self._idle.append(conn)
        if not keep:
            conn.close()
        self._slots.release()

    def abort_busy(self) -> int:
        """End every request in flight on this pool's connections (:meth:`Connection.abort`):
        a server set cut this member as a straggler, and each request still waiting on it
        held one of the set's shared threads for a whole ``timeout_s``. Returns how many."""
        with self._lock:  # (a shutdown does not block; under the lock, no request that
            for conn in self._busy:  # began after this call is ended by it)
                conn.abort()
            return len(self._busy)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
