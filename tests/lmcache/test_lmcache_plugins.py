"""The in-engine plugin on every path LMCache builds remote connectors, against real
servers and the real ``lmcache`` (0.5.6 or 0.5.7rc2: its RemoteBackend,
CreateStorageBackends, LocalCPUBackend): the legacy ``remote_url``, a stand-in CPU backend,
named instances, the 413 / 409 warnings, the layout in the address, and no write after
``close()``."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import socket
import threading

import pytest

pytest.importorskip("lmcache")
torch = pytest.importorskip("torch")

from helpers.common import wait_for  # noqa: E402
from helpers.lmcache_engine import (  # noqa: E402
    SMALL_CHUNK,
    connector_of,
    engine_config,
    engine_key,
    engine_metadata,
    filled,
    plugin_extra,
)
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.storage_backend import CreateStorageBackends  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

from eg_kv import checksum  # noqa: E402
from eg_kv.kvcache import EgKvRemoteConnector, RemoteKVConnector  # noqa: E402
from eg_kv.lmcache.compat import RemoteMetadata  # noqa: E402

#: LMCache's chunk-header module, wherever this release keeps it (0.5.6: lmcache.v1.protocol,
#: 0.5.7: lmcache.inprocess.v1.protocol): the one our connector's header class comes from.
protocol = importlib.import_module(RemoteMetadata.__module__)

pytestmark = pytest.mark.lmcache


def stats(url: str):
    with RemoteKVConnector(base_url=url) as kv:
        return kv.stats()


# --------------------------------------------------------------------------- 12.1


def test_legacy_remote_url_with_a_stand_in_cpu_backend(server_factory, lmcache_loop):
    """``remote_url: plugin://egkv`` and no CPU backend (LMCache hands its stand-in): the
    connector builds from what LMCache gives the adapter, and lookups reach the server."""
    srv = server_factory(workers=1, capacity="32MiB")
    config = engine_config(plugin_extra("egkv", srv.url), plugins=["egkv"],
                           remote_url="plugin://egkv")  # fmt: skip
    metadata = engine_metadata()
    # The scheduler's backend: legacy URL, no CPU backend.
    lookup = RemoteBackend(config, metadata, lmcache_loop, None, "cpu")
    cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    writer = RemoteBackend(config, metadata, lmcache_loop, cpu, "cpu", plugin_name="egkv")
    try:
        conn = connector_of(lookup)
        assert isinstance(conn, EgKvRemoteConnector), "LMCache failed to build the connector"
        assert conn.plugin_name == "egkv" and conn.kv_config.base_url == srv.url
        key = engine_key(0x12)
        assert lookup.contains(key) is False
        obj = filled(cpu, metadata, 1)
        writer.submit_put_task(key, obj).result(30)
        assert lookup.contains(key) is True  # the same address from both backends
        assert lookup.batched_contains([key]) == 1
        assert lookup.get_blocking(key) is None  # nothing to allocate with: a miss
        obj.ref_count_down()
    finally:
        lookup.close()
        writer.close()
        cpu.memory_allocator.close()


def test_remote_connector_class_without_cpu_backend_refuses_naming_the_fix(
    server_factory, lmcache_loop
):
    """``class_name: EgKvRemoteConnector`` gets no metadata from LMCache without a CPU
    backend: it refuses with the fix in the message (it crashed on ``.config`` before)."""
    srv = server_factory(workers=1, capacity="32MiB")
    config = engine_config(plugin_extra("egkv", srv.url, "EgKvRemoteConnector"),
                           plugins=["egkv"], remote_url="plugin://egkv")  # fmt: skip
    with pytest.raises(Exception, match="EgKvConnectorAdapter"):
        EgKvRemoteConnector(lmcache_loop, _StandIn(), config)
    backend = RemoteBackend(config, engine_metadata(), lmcache_loop, None, "cpu")
    assert backend.connection is None  # LMCache logs our error; lookups are misses
    backend.close()


class _StandIn:
    """What LMCache hands a connector when it has no CPU backend: no config, no metadata."""


# --------------------------------------------------------------------------- 12.2


@pytest.mark.slow
def test_named_instances_each_reach_their_own_server(server_factory, lmcache_loop):
    srv_a = server_factory(workers=1, capacity="32MiB")
    srv_b = server_factory(workers=1, capacity="32MiB")
    extra = {**plugin_extra("egkv.a", srv_a.url), **plugin_extra("egkv.b", srv_b.url)}
    config = engine_config(extra, plugins=["egkv.a", "egkv.b"])
    metadata = engine_metadata()
    backends = CreateStorageBackends(config, metadata, lmcache_loop, "cpu")
    try:
        a, b = backends["RemoteBackend-egkv.a"], backends["RemoteBackend-egkv.b"]
        assert connector_of(a).kv_config.base_url == srv_a.url
        assert connector_of(b).kv_config.base_url == srv_b.url
        cpu = backends["LocalCPUBackend"]
        obj = filled(cpu, metadata, 2)
        a.submit_put_task(engine_key(0xA), obj).result(30)
        b.submit_put_task(engine_key(0xB), obj).result(30)
        b.submit_put_task(engine_key(0xB0), obj).result(30)
        assert stats(srv_a.url).unique_blocks == 1 and stats(srv_b.url).unique_blocks == 2
        assert a.contains(engine_key(0xA)) and not a.contains(engine_key(0xB))
        assert b.contains(engine_key(0xB)) and not b.contains(engine_key(0xA))
        obj.ref_count_down()
    finally:
        for backend in backends.values():
            backend.close()


def test_named_instances_of_the_connector_class_refuse_instead_of_guessing(
    server_factory, lmcache_loop
):
    """LMCache does not tell ``EgKvRemoteConnector`` its instance name: with two of them it
    must refuse (never fall back to the default server silently)."""
    srv = server_factory(workers=1, capacity="32MiB")
    extra = {
        **plugin_extra("egkv.a", srv.url, "EgKvRemoteConnector"),
        **plugin_extra("egkv.b", srv.url, "EgKvRemoteConnector"),
    }
    config = engine_config(extra, plugins=["egkv.a", "egkv.b"])
    backends = CreateStorageBackends(config, engine_metadata(), lmcache_loop, "cpu")
    try:
        for name in ("egkv.a", "egkv.b"):
            assert backends[f"RemoteBackend-{name}"].connection is None
    finally:
        for backend in backends.values():
            backend.close()


# --------------------------------------------------------------------------- 12.3 / 12.4


def warnings_of(caplog, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "eg_kv.kvcache" and r.levelno == logging.WARNING and text in r.getMessage()
    ]


def test_chunk_over_the_max_block_size_is_said_once(server_factory, lmcache_loop, caplog):
    srv = server_factory(workers=1, capacity="32MiB", extra=("--max-block-size", "128KiB"))
    config = engine_config(plugin_extra("egkv", srv.url), plugins=["egkv"])
    metadata = engine_metadata()
    cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    backend = RemoteBackend(config, metadata, lmcache_loop, cpu, "cpu", plugin_name="egkv")
    caplog.set_level(logging.WARNING, logger="eg_kv.kvcache")
    try:
        obj = filled(cpu, metadata, 3)
        for h in (1, 2, 3):  # three chunks of the same size: one warning
            backend.submit_put_task(engine_key(h), obj).result(30)
        size = SMALL_CHUNK + connector_of(backend).remote_metadata_bytes
        said = warnings_of(caplog, "maximum block size")
        assert len(said) == 1, said
        assert f"{size} bytes" in said[0] and "131072 bytes" in said[0]  # chunk, limit
        assert "eg-kv serve --max-block-size 1MiB" in said[0] and "chunk_size" in said[0]  # the fix
        assert stats(srv.url).unique_blocks == 0
        obj.ref_count_down()
    finally:
        backend.close()
        cpu.memory_allocator.close()


def test_layout_is_in_the_address_and_a_409_is_said(server_factory, lmcache_loop, caplog):
    """Two engines that differ in ``save_chunk_meta`` store the same key on one server:
    both keep and load their own chunk (one got 409 and lost it before); an identically
    configured engine shares the first one's; a 409 that still happens is said once."""
    srv = server_factory(workers=1, capacity="64MiB")
    metadata = engine_metadata()
    cfg_meta = engine_config(plugin_extra("egkv", srv.url), plugins=["egkv"])
    cfg_bare = engine_config({**plugin_extra("egkv", srv.url), "save_chunk_meta": False},
                             plugins=["egkv"])  # fmt: skip
    caplog.set_level(logging.WARNING, logger="eg_kv.kvcache")
    cpus, backends = [], []
    try:
        for cfg in (cfg_meta, cfg_bare, cfg_meta):
            cpus.append(LocalCPUBackend(cfg, metadata, dst_device="cpu"))
            backends.append(RemoteBackend(cfg, metadata, lmcache_loop, cpus[-1], "cpu",
                                          plugin_name="egkv"))  # fmt: skip
        with_meta, bare, twin = backends
        key = engine_key(0x409)
        objs = [filled(cpus[0], metadata, 10), filled(cpus[1], metadata, 11)]
        with_meta.submit_put_task(key, objs[0]).result(30)
        bare.submit_put_task(key, objs[1]).result(30)
        assert stats(srv.url).unique_blocks == 2  # two layouts, two addresses
        for backend, obj in ((with_meta, objs[0]), (bare, objs[1]), (twin, objs[0])):
            got = backend.get_blocking(key)
            assert got is not None and torch.equal(got.tensor, obj.tensor)
            got.ref_count_down()
        assert stats(srv.url).unique_blocks == 2  # the twin shared the first copy
        assert not warnings_of(caplog, "409")

        # Someone else holds this engine's address with another length: said once.
        conn = connector_of(with_meta)
        other = engine_key(0x410)
        with RemoteKVConnector(base_url=srv.url) as kv:
            assert kv.put(conn._address(other), b"another writer's bytes")
        with_meta.submit_put_task(other, objs[0]).result(30)
        with_meta.submit_put_task(other, objs[0]).result(30)
        said = warnings_of(caplog, "409")
        assert len(said) == 1 and "first writer wins" in said[0], said
        for obj in objs:
            obj.ref_count_down()
    finally:
        for backend in backends:
            backend.close()
        for cpu in cpus:
            cpu.memory_allocator.close()


# --------------------------------------------------------------------------- 12.5


class StallingServer:
    """A loopback HTTP server that answers a GET with a valid chunk header and half the
    body, then holds the rest until :meth:`release` (as a server on a congested path).

    Args:
        head: the first bytes of the body (LMCache's chunk header).
        body_len: the whole body's length.
    """

    def __init__(self, head: bytes, body_len: int) -> None:
        self.head, self.body_len = head, body_len
        self.sent_rest = threading.Event()
        self.answered = threading.Event()
        self._go = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._sock.accept()
        with conn:
            while b"\r\n\r\n" not in conn.recv(65536):
                pass
            half = self.body_len // 2
            body = self.head + b"\x11" * (self.body_len - len(self.head))
            summed = b"X-Eg-Kv-Checksum: %s\r\n" % checksum.encode(checksum.of(body)).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (
                self.body_len, summed) + body[:half])  # fmt: skip
            self.answered.set()
            self._go.wait(30)
            with contextlib.suppress(OSError):  # the client gave up: nothing can land
                conn.sendall(body[half:])
            self.sent_rest.set()

    def release(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._go.set()
        self._sock.close()
        self._thread.join(10)


@pytest.mark.slow
def test_no_write_into_lmcache_memory_after_close(lmcache_loop):
    """A load in flight when ``close()`` is called never writes into the buffer it took
    from LMCache afterwards, even when the rest of the body arrives later."""
    metadata = engine_metadata()
    protocol.init_remote_metadata_info(metadata.get_num_groups())  # what a connector does first
    header = RemoteMetadata(SMALL_CHUNK, metadata.get_shapes(), metadata.get_dtypes(),
                            MemoryFormat.KV_2LTD).serialize()  # fmt: skip
    srv = StallingServer(header, len(header) + SMALL_CHUNK)
    extra = plugin_extra("egkv", srv.url, timeout_s="3", local_reads="false")  # HTTP's stall
    config = engine_config(extra, plugins=["egkv"])
    cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    handed_out = []
    allocate = cpu.allocate

    def recording_allocate(*args, **kwargs):  # LMCache's allocator, recorded
        obj = allocate(*args, **kwargs)
        handed_out.append(obj.tensor)  # a view of the memory, valid after it is freed
        return obj

    cpu.allocate = recording_allocate
    backend = RemoteBackend(config, metadata, lmcache_loop, cpu, "cpu", plugin_name="egkv")
    try:
        load = asyncio.run_coroutine_threadsafe(
            connector_of(backend).get(engine_key(5)), lmcache_loop
        )
        wait_for(lambda: srv.answered.is_set() and handed_out, what="the load to start")
        backend.close()  # LMCache shuts the engine down; its memory is free from here
        target = handed_out[0]  # given back to LMCache's allocator by now
        target.fill_(7)  # reused by someone else
        sentinel = target.clone()
        srv.release()
        assert srv.sent_rest.wait(20)
        wait_for(load.done, what="the load to end")
        wait_for(lambda: not _pool_threads(), what="the connector's threads to end")
        assert torch.equal(target, sentinel), "a load wrote after close() returned"
    finally:
        srv.stop()
        cpu.memory_allocator.close()


def _pool_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("eg-kv-remote")]


@pytest.mark.parametrize("declared", ["huge", "other_length"])
def test_a_chunk_whose_header_lies_about_its_size_is_a_miss_at_once(
    server_factory, lmcache_loop, declared
):
    """A stored chunk's header (bit rot, another writer, a forger) declaring shapes the
    body does not hold is a miss before anything is allocated: one declaring 128 GiB held
    the load in LMCache's allocator for good, evicting LMCache's own chunks meanwhile."""
    srv = server_factory(workers=1, capacity="32MiB")
    metadata = engine_metadata()
    config = engine_config(plugin_extra("egkv", srv.url, timeout_s="2"), plugins=["egkv"])
    cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    allocated = []
    allocate = cpu.allocate
    cpu.allocate = lambda *a, **kw: allocated.append(a) or allocate(*a, **kw)  # recorded
    backend = RemoteBackend(config, metadata, lmcache_loop, cpu, "cpu", plugin_name="egkv")
    try:
        conn = connector_of(backend)
        shapes = metadata.get_shapes()
        if declared == "huge":
            shapes = [torch.Size([64, 1024, 1024, 1024])] * len(shapes)
        else:  # as this engine's, but the body is a page short of them
            shapes = [torch.Size([s[0], s[1], s[2] - 1, s[3]]) for s in shapes]
        header = RemoteMetadata(SMALL_CHUNK, shapes, metadata.get_dtypes(),
                                MemoryFormat.KV_2LTD).serialize()  # fmt: skip
        key = engine_key(0x5E7)
        with RemoteKVConnector(base_url=srv.url) as kv:
            assert kv.put(conn._address(key), header + bytes(SMALL_CHUNK))
        load = asyncio.run_coroutine_threadsafe(conn.get(key), lmcache_loop)
        assert load.result(10) is None
        assert allocated == []
    finally:
        backend.close()
        cpu.memory_allocator.close()


def test_a_token_in_extra_config_is_refused_and_token_env_names_its_variable(
    server_factory, lmcache_loop, monkeypatch
):
    """LMCache logs extra_config verbatim at start: a token there is refused, naming the
    way that keeps it out of the log; ``token_env`` names the variable holding one
    instance's token, which reaches a server that wants it."""
    srv = server_factory(workers=1, capacity="32MiB",
                         env={"EPISTEMIC_GRAPH_KVCACHE_TOKEN": "t0ken-of-the-server"})  # fmt: skip
    monkeypatch.delenv("EPISTEMIC_GRAPH_KVCACHE_TOKEN", raising=False)
    metadata = engine_metadata()
    cpu = LocalCPUBackend(engine_config({}, plugins=[]), metadata, dst_device="cpu")
    try:
        leaked = engine_config(plugin_extra("egkv", srv.url, token="t0ken-of-the-server"),
                               plugins=["egkv"])  # fmt: skip
        with pytest.raises(Exception, match="token_env") as refused:
            EgKvRemoteConnector(lmcache_loop, cpu, leaked, plugin_name="egkv")
        assert "t0ken-of-the-server" not in str(refused.value)
        monkeypatch.setenv("EGKV_TOKEN_A", "t0ken-of-the-server")
        named = engine_config(plugin_extra("egkv", srv.url, token_env="EGKV_TOKEN_A"),
                              plugins=["egkv"])  # fmt: skip
        conn = EgKvRemoteConnector(lmcache_loop, cpu, named, plugin_name="egkv")
        try:
            key = engine_key(0x70C)
            obj = filled(cpu, metadata, 3)
            assert conn._put_sync(key, obj)  # a 401 without the token
            obj.ref_count_down()
            assert conn.exists_sync(key)
        finally:
            asyncio.run_coroutine_threadsafe(conn.close(), lmcache_loop).result(30)
    finally:
        cpu.memory_allocator.close()


@pytest.mark.parametrize("reads", ["local", "http"])
def test_a_load_that_fails_its_checks_gives_lmcache_its_buffer_back(
    server_factory, lmcache_loop, reads
):
    """A chunk whose bytes changed in the slab fails its checksum after the buffer was
    filled: the buffer goes back to LMCache at once (it was left to LMCache's garbage
    collection, which warns, holding the L1 space meanwhile)."""
    import mmap
    from pathlib import Path

    srv = server_factory(workers=1, capacity="32MiB")
    metadata = engine_metadata()
    config = engine_config(plugin_extra("egkv", srv.url, local_reads=str(reads == "local")),
                           plugins=["egkv"])  # fmt: skip
    cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    backend = RemoteBackend(config, metadata, lmcache_loop, cpu, "cpu", plugin_name="egkv")
    try:
        conn = connector_of(backend)
        key = engine_key(0xBAD)
        obj = filled(cpu, metadata, 21)
        stored = obj.byte_array[:4096]
        backend.submit_put_task(key, obj).result(30)
        obj.ref_count_down()
        with (
            open(Path("/dev/shm") / srv.slab_name.lstrip("/"), "r+b") as f,
            mmap.mmap(f.fileno(), 0) as mm,
        ):
            pos = mm.find(stored)
            assert pos >= 0 and mm.find(stored, pos + 1) == -1
            mm[pos + 100] ^= 0xFF
        allocated = []
        allocate = cpu.allocate
        cpu.allocate = lambda *a, **kw: allocated.append(allocate(*a, **kw)) or allocated[-1]
        load = asyncio.run_coroutine_threadsafe(conn.get(key), lmcache_loop)
        assert load.result(30) is None
        assert len(allocated) == 1 and allocated[0].get_ref_count() == 0
    finally:
        backend.close()
        cpu.memory_allocator.close()


@pytest.mark.slow
def test_a_load_lmcache_stopped_waiting_for_gives_its_buffer_back(lmcache_loop):
    """LMCache's blocking get cancels a load past its timeout; the load's thread goes on
    and fills a buffer nobody will take: it goes back to LMCache when the load ends."""
    metadata = engine_metadata()
    protocol.init_remote_metadata_info(metadata.get_num_groups())
    header = RemoteMetadata(SMALL_CHUNK, metadata.get_shapes(), metadata.get_dtypes(),
                            MemoryFormat.KV_2LTD).serialize()  # fmt: skip
    srv = StallingServer(header, len(header) + SMALL_CHUNK)
    extra = plugin_extra("egkv", srv.url, timeout_s="10", local_reads="false")
    config = engine_config(extra, plugins=["egkv"])
    cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    allocated = []
    allocate = cpu.allocate
    cpu.allocate = lambda *a, **kw: allocated.append(allocate(*a, **kw)) or allocated[-1]
    backend = RemoteBackend(config, metadata, lmcache_loop, cpu, "cpu", plugin_name="egkv")
    try:
        load = asyncio.run_coroutine_threadsafe(
            connector_of(backend).get(engine_key(6)), lmcache_loop
        )
        wait_for(lambda: srv.answered.is_set() and allocated, what="the load to start")
        load.cancel()  # as LMCache's blocking_timeout_secs does
        srv.release()
        assert srv.sent_rest.wait(20)
        wait_for(lambda: allocated[0].get_ref_count() == 0, what="the buffer to go back")
    finally:
        srv.stop()
        backend.close()
        cpu.memory_allocator.close()


def test_a_sink_run_again_at_a_previous_home_leaks_no_buffer(server_factory, lmcache_loop):
    """A server set asks the previous home with the same sink after the home's body failed
    its check (right after a membership change, eg_kv.client.sets): the first buffer
    was never given back, and each such load held one chunk of LMCache's L1 for good.
    Two real servers; the set's two asks are written out (the window needs a change)."""
    import mmap
    from pathlib import Path

    from eg_kv.client.connectors import connect
    from eg_kv.client.settings import KvCacheConfig

    home, previous = (server_factory(workers=1, capacity="32MiB") for _ in range(2))
    metadata = engine_metadata()
    config = engine_config(plugin_extra("egkv", previous.url, local_reads="false"),
                           plugins=["egkv"])  # fmt: skip
    cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    backend = RemoteBackend(config, metadata, lmcache_loop, cpu, "cpu", plugin_name="egkv")
    at_home = connect(KvCacheConfig(base_url=home.url, local_reads=False))
    try:
        conn = connector_of(backend)
        key = engine_key(0xB0B)
        obj = filled(cpu, metadata, 22)
        backend.submit_put_task(key, obj).result(30)
        obj.ref_count_down()
        address = conn._address(key)
        stored = conn.client.get(address)
        assert at_home.put(address, stored)  # the home's copy: a byte changes in its slab
        with (
            open(Path("/dev/shm") / home.slab_name.lstrip("/"), "r+b") as f,
            mmap.mmap(f.fileno(), 0) as mm,
        ):
            pos = mm.find(stored[-4096:])
            assert pos >= 0
            mm[pos + 100] ^= 0xFF
        first_ask, then_ask = at_home, conn.client

        class HomeThenPrevious:  # eg_kv.client.sets.SetConnector._one, its two asks
            def fetch(self, address, sink, may_start=None, release_lease=False):
                got = first_ask.fetch(address, sink)
                return got if got is not None else then_ask.fetch(address, sink)

        conn.client = HomeThenPrevious()
        allocated = []
        allocate = cpu.allocate
        cpu.allocate = lambda *a, **kw: allocated.append(allocate(*a, **kw)) or allocated[-1]
        got = asyncio.run_coroutine_threadsafe(conn.get(key), lmcache_loop).result(30)
        conn.client = then_ask
        assert got is not None and len(allocated) == 2 and got is allocated[1]
        assert allocated[0].get_ref_count() == 0  # the home's failed fill went back
        got.ref_count_down()
    finally:
        at_home.close()
        backend.close()
        cpu.memory_allocator.close()
