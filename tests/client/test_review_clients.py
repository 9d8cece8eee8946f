"""Regression tests of a review of the Python clients (its findings 1-6): real processes
(a forked client), real sockets, raw-socket servers for misbehaving ones."""

from __future__ import annotations

import os
import threading
import traceback

import pytest
from helpers.common import wait_for
from helpers.kvcache import RawServer

from eg_kv.client.connectors import RemoteKVConnector


def in_child(work) -> bytes:
    """Fork; run ``work()`` (which returns bytes) in the child and return what it
    returned. The child ends with ``os._exit``: it runs none of the parent's cleanup."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child's coverage is not collected)
        code = 1
        try:
            os.close(r)
            os.write(w, work())
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            out = f.read()
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child failed"
    return out


# -- 1: a forked child never uses its parent's connections, nor waits on its slots


@pytest.mark.timeout(60)
def test_forked_child_opens_its_own_connection():
    # Old code: the child sent its request on the parent's kept-alive socket (the server
    # saw 1 connection, not 2): two processes on one socket read each other's answers.
    with RawServer("early_hints") as srv:
        kv = RemoteKVConnector(base_url=srv.url, timeout_s=5, local_reads=False)
        try:
            assert kv.contains("k1")
            assert srv.accepted == 1
            assert in_child(lambda: b"%d" % kv.contains("k2")) == b"1"
            assert srv.accepted == 2
            assert kv.contains("k3")  # the parent's connection is still whole
            assert srv.accepted == 2
        finally:
            kv.close()


@pytest.mark.timeout(60)
def test_forked_child_gets_the_slots_busy_at_the_fork():
    # Old code: both slots were held by the parent's threads at the fork and never came
    # back in the child: its call failed (PoolWaitTimeout) without connecting.
    with RawServer("silent") as srv:
        kv = RemoteKVConnector(base_url=srv.url, timeout_s=3, local_reads=False, max_connections=2)
        busy = [threading.Thread(target=kv.contains, args=(f"p{i}",)) for i in range(2)]
        try:
            for t in busy:
                t.start()
            wait_for(lambda: len(srv.requests) == 2, timeout=10, what="2 requests in flight")

            in_child(lambda: repr(kv.try_exists_addresses(["c"], timeout_s=0.3)).encode())
            wait_for(lambda: srv.accepted == 3, timeout=10, what="the child's own connection")
        finally:
            for t in busy:
                t.join(timeout=10)
            kv.close()
