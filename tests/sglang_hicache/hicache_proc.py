"""Run with .venv-vllm's python (SGLang 0.5.23 on CPU torch): EgKvHiCacheStorage built by
SGLang's own ``StorageBackendFactory`` from the ``dynamic`` config, over SGLang's own host
pools (MHA and MLA, each layout), driven by SGLang's own controller functions
(``HiCacheController._page_set_zero_copy`` / ``_page_get_zero_copy`` and the legacy copy
path), against a real eg-kv server. Prints one JSON line of what each check found.

argv: base_url, slab_name (to change a byte of a stored page in /dev/shm), dead_url,
scenarios (names from SCENARIOS, comma-separated, or ``all``), and a server set's members
(comma-separated URLs) for the ``server_set`` scenario.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import no_torchvision  # noqa: F401, I001  (before SGLang's host pools and controller)

import torch
from sglang_pools import EG_KV_BACKEND, mha_pool, mla_pool, storage_config
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

URL, SLAB, DEAD, SCENARIO, MEMBERS = sys.argv[1:6]
LAYERS, HEADS, DIM, PAGE = 4, 2, 64, 16  # an MHA page: 2 x 4 x 16 x 2 x 64 x 2 B = 32 KiB
RANK, ROPE = 512, 64  # an MLA page: 4 x 16 x 576 x 2 B = 72 KiB
MODEL = "Qwen/Qwen3-0.6B"
OP = SimpleNamespace(request_id="r", is_terminated=lambda: False)
torch.manual_seed(int.from_bytes(os.urandom(8), "little"))  # pages unique across runs


def config(mla: bool, tp_rank: int = 0, tp_size: int = 1, url: str = URL, **extra):
    extra = {**EG_KV_BACKEND, "url": url, "timeout_s": 2, **extra}
    return storage_config(mla, extra, model=MODEL, tp_rank=tp_rank, tp_size=tp_size)


class Engine:
    """One rank: a host pool, the backend SGLang's factory builds, and the controller's
    view of both."""

    def __init__(self, mla: bool, layout: str, dtype=torch.bfloat16, **cfg) -> None:
        if mla:
            self.pool = mla_pool(layout, layers=LAYERS, rank=RANK, rope=ROPE, page=PAGE,
                                 pages=128, dtype=dtype)  # fmt: skip
        else:
            self.pool = mha_pool(layout, layers=LAYERS, heads=HEADS, dim=DIM, page=PAGE,
                                 pages=128, dtype=dtype)  # fmt: skip
        self.backend = StorageBackendFactory.create_backend("dynamic", config(mla, **cfg),
                                                            self.pool)  # fmt: skip
        self.backend.register_mem_pool_host(self.pool)
        self.ctrl = SimpleNamespace(storage_backend=self.backend, storage_host_pool=self.pool,
                                    page_size=PAGE)  # fmt: skip

    def slots(self, pages: int) -> torch.Tensor:
        got = self.pool.alloc(pages * PAGE)
        assert got is not None, "host pool full"
        return got

    def fill(self, slots: torch.Tensor) -> list[bytes]:
        """Random bytes in each page of ``slots``; returns each page's flat bytes."""
        buf = self.pool.kv_buffer
        buf.copy_(torch.randn(buf.shape).to(buf.dtype))
        return self.pages(slots)

    def pages(self, slots: torch.Tensor) -> list[bytes]:
        starts = range(0, len(slots), PAGE)
        flat = [self.pool.get_data_page(int(slots[i]), flat=True) for i in starts]
        return [page.contiguous().view(torch.uint8).numpy().tobytes() for page in flat]

    def set(self, keys, slots) -> bool:
        return HiCacheController._page_set_zero_copy(self.ctrl, keys, slots)

    def get(self, keys, slots) -> int:
        return HiCacheController._page_get_zero_copy(self.ctrl, OP, keys, slots)

    def exists(self, keys) -> int:
        return self.backend.batch_exists(keys)

    def close(self) -> None:
        self.backend.close()


RUN = os.urandom(4).hex()  # keys of their own in every run, on a server shared or not


def keys_of(tag: str, n: int) -> list[str]:
    """SGLang-shaped keys (SHA-256 hex), this run's."""
    return [hashlib.sha256(f"{RUN}-{tag}-{i}".encode()).hexdigest() for i in range(n)]


def round_trip(mla: bool, layout: str, reader_layout: str | None = None) -> dict:
    """Set pages from one engine, find and load them from a fresh one: equal bytes."""
    tag = f"{'mla' if mla else 'mha'}-{layout}-{reader_layout}"
    keys = keys_of(tag, 6)
    writer = Engine(mla, layout)
    src = writer.slots(len(keys))
    want = writer.fill(src)
    stored = writer.set(keys, src)
    reader = Engine(mla, reader_layout or layout)
    dst = reader.slots(len(keys))
    found = reader.exists(keys + keys_of(tag + "-absent", 2))
    got = reader.get(keys, dst)
    out = {"stored": stored, "found": found, "loaded": got, "equal": reader.pages(dst) == want,
           "page_bytes": writer.backend.format.page_bytes}  # fmt: skip
    writer.close()
    reader.close()
    return out


def scenario_layouts() -> dict:
    out = {}
    for mla in (False, True):
        for layout in ("page_first", "layer_first", "page_first_direct"):
            out[f"{'mla' if mla else 'mha'}:{layout}"] = round_trip(mla, layout)
        for writer, reader in (("page_first", "layer_first"), ("layer_first", "page_first_direct")):
            out[f"{'mla' if mla else 'mha'}:{writer}->{reader}"] = round_trip(mla, writer, reader)
    return out


def scenario_legacy() -> dict:
    """The legacy copy path (no interface_v1): its pages are the zero-copy path's."""
    keys = keys_of("legacy", 4)
    writer = Engine(False, "layer_first")
    src = writer.slots(4)
    want = writer.fill(src)
    stored = HiCacheController._generic_page_set(writer.ctrl, keys[:2], src[: 2 * PAGE])
    stored_v1 = writer.set(keys[2:], src[2 * PAGE :])
    reader = Engine(False, "page_first_direct")  # another layout of the same byte order
    dst = reader.slots(4)
    legacy_got = HiCacheController._generic_page_get(reader.ctrl, OP, keys, dst)
    legacy_equal = reader.pages(dst) == want
    reader.pool.kv_buffer.zero_()
    v1_got = reader.get(keys, dst)
    out = {"stored": [stored, stored_v1], "legacy_loaded": legacy_got,
           "legacy_equal": legacy_equal, "v1_loaded": v1_got,
           "v1_equal": reader.pages(dst) == want}  # fmt: skip
    writer.close()
    reader.close()
    return out


def scenario_ranks() -> dict:
    """MHA: each tensor rank its own pages; MLA: one copy for every rank, stored by the
    writer rank only."""
    out = {}
    for mla in (False, True):
        keys = keys_of(f"ranks-{mla}", 4)
        rank0 = Engine(mla, "page_first", tp_rank=0, tp_size=2)
        rank1 = Engine(mla, "page_first", tp_rank=1, tp_size=2)
        src = rank0.slots(4)
        want = rank0.fill(src)
        stored = rank0.set(keys, src)
        found1 = rank1.exists(keys)
        dst = rank1.slots(4)
        got1 = rank1.get(keys, dst)
        equal1 = rank1.pages(dst) == want
        other = keys_of(f"ranks-nonwriter-{mla}", 2)
        src1 = rank1.slots(2)
        rank1.fill(src1)
        nonwriter_set = rank1.set(other, src1)
        out["mla" if mla else "mha"] = {
            "stored": stored, "rank1_found": found1, "rank1_loaded": got1,
            "rank1_equal": equal1,
            "nonwriter_set": nonwriter_set, "nonwriter_stored": rank0.exists(other),
        }  # fmt: skip
        rank0.close()
        rank1.close()
    return out


def scenario_binding() -> dict:
    """Engines whose pages mean other bytes share no page."""
    keys = keys_of("binding", 4)
    base = Engine(False, "page_first", revision="r1")
    src = base.slots(4)
    base.fill(src)
    assert base.set(keys, src)
    others = {
        "fp16": Engine(False, "page_first", dtype=torch.float16, revision="r1"),
        "revision": Engine(False, "page_first", revision="r2"),
        "same": Engine(False, "page_first", revision="r1"),
    }
    out = {name: engine.exists(keys) for name, engine in others.items()}
    for engine in (base, *others.values()):
        engine.close()
    return out


def change_one_byte(page: bytes) -> bool:
    path = Path("/dev/shm") / SLAB.lstrip("/")
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        pos = mm.find(page[:4096])
        if pos < 0:
            return False
        assert mm.find(page[:4096], pos + 1) == -1, "the page's bytes are not unique"
        mm[pos + 100] ^= 0xFF
        return True


def scenario_corrupt() -> dict:
    """A byte changed in the slab: the page is a miss (False), counted, never loaded."""
    keys = keys_of("corrupt", 2)
    engine = Engine(False, "page_first")
    src = engine.slots(2)
    want = engine.fill(src)
    assert engine.set(keys, src)
    changed = change_one_byte(want[0])
    reader = Engine(False, "page_first")
    dst = reader.slots(2)
    loaded = reader.backend.batch_get_v1(keys, dst)
    stats = reader.backend.get_stats()
    out = {"changed": changed, "loaded": loaded,
           "checksum_failures": stats.eg_kv["checksum_failures"],
           "second_equal": reader.pages(dst)[1] == want[1]}  # fmt: skip
    engine.close()
    reader.close()
    return out


def scenario_block_key() -> dict:
    """With a block key, pages another token holder stored first (of the right length,
    with a tag made up) are misses, counted; pages a keyed engine stored load."""
    from eg_kv.blockkey import OVERHEAD
    from eg_kv.kvcache import RemoteKVConnector

    keys = keys_of("forged", 3)
    forger = Engine(False, "page_first")  # no key: it knows the addresses, not the key
    fmt = forger.backend.format
    with RemoteKVConnector(base_url=URL) as kv:
        for key in keys[:2]:
            assert kv.put(fmt.address(key), os.urandom(fmt.page_bytes + OVERHEAD))
    os.environ["EPISTEMIC_GRAPH_KVCACHE_BLOCK_KEY"] = "k" * 32
    try:
        keyed = Engine(False, "page_first")
        reader = Engine(False, "page_first")
    finally:
        del os.environ["EPISTEMIC_GRAPH_KVCACHE_BLOCK_KEY"]
    ksrc = keyed.slots(1)
    want = keyed.fill(ksrc)
    keyed_set = keyed.set(keys[2:], ksrc)
    dst = reader.slots(3)
    loaded = reader.backend.batch_get_v1(keys, dst)
    out = {"loaded": loaded, "keyed_set": keyed_set,
           "keyed_equal": reader.pages(dst[2 * PAGE :]) == want,
           "forged_blocks": reader.backend.get_stats().eg_kv["forged_blocks"]}  # fmt: skip
    for engine in (forger, keyed, reader):
        engine.close()
    return out


def scenario_dead() -> dict:
    """A server that is gone: misses within the client's timeout, no exception."""
    t0 = time.monotonic()
    engine = Engine(False, "page_first", url=DEAD)
    keys = keys_of("dead", 8)
    src = engine.slots(8)
    engine.fill(src)
    out = {"set": engine.backend.batch_set_v1(keys, src),
           "exists": engine.exists(keys),
           "get": engine.backend.batch_get_v1(keys, src),
           "legacy_get": engine.backend.batch_get(keys[:1]),
           "stats": type(engine.backend.get_stats()).__name__}  # fmt: skip
    engine.close()
    out["seconds"] = time.monotonic() - t0
    return out


def scenario_asymmetric() -> dict:
    """A pool whose K and V have other head dims (MiMo-V2's, SGLang's own class for it):
    the backend starts (it stopped SGLang: it sized pages by the flat page, which such
    a pool refuses), and pages round-trip K and V equal; the legacy path is a miss."""
    keys = keys_of("asym", 4)

    def engine() -> SimpleNamespace:
        pool = mha_pool("page_first", layers=LAYERS, heads=HEADS, dim=DIM, v_dim=DIM // 2,
                        page=PAGE, pages=128)  # fmt: skip
        backend = StorageBackendFactory.create_backend("dynamic", config(False), pool)
        backend.register_mem_pool_host(pool)
        ctrl = SimpleNamespace(storage_backend=backend, storage_host_pool=pool, page_size=PAGE)
        return SimpleNamespace(pool=pool, backend=backend, ctrl=ctrl)

    writer, reader = engine(), engine()
    src, dst = writer.pool.alloc(4 * PAGE), reader.pool.alloc(4 * PAGE)
    for buf in (writer.pool.k_buffer, writer.pool.v_buffer):
        buf.copy_(torch.randn(buf.shape).to(buf.dtype))
    stored = HiCacheController._page_set_zero_copy(writer.ctrl, keys, src)
    got = HiCacheController._page_get_zero_copy(reader.ctrl, OP, keys, dst)
    equal = all(torch.equal(r[dst], w[src]) for r, w in (
        (reader.pool.k_buffer, writer.pool.k_buffer),
        (reader.pool.v_buffer, writer.pool.v_buffer)))  # fmt: skip
    out = {"stored": stored, "loaded": got, "equal": equal,
           "page_bytes": writer.backend.format.page_bytes,
           "legacy_get": reader.backend.batch_get(keys[:1])}  # fmt: skip
    writer.backend.close()
    reader.backend.close()
    return out


def scenario_silent() -> dict:
    """A server that takes the connection and never answers: a store is misses within
    one timeout for the whole batch (it waited one per page, on SGLang's backup thread,
    whose detach gives up after 10 s)."""
    import socket

    with socket.create_server(("127.0.0.1", 0), backlog=64) as silent:  # never accepts
        engine = Engine(False, "page_first", url=f"http://127.0.0.1:{silent.getsockname()[1]}",
                        timeout_s=0.5, io_threads=1)  # fmt: skip
        keys = keys_of("silent", 8)
        src = engine.slots(8)
        engine.fill(src)
        t0 = time.monotonic()
        stored = engine.backend.batch_set_v1(keys, src)
        out = {"set": stored, "seconds": time.monotonic() - t0}
        engine.close()
    return out


def scenario_stalled() -> dict:
    """A server that answered the lookups and then stalls (it accepts and never answers):
    each call ends within its one timeout_s (1 s). A GET started late ran its own whole
    timeout past the batch's, a PUT too, and the lease releases were sent on SGLang's
    thread with a timeout of their own: a get took 2.0 s, a set 1.8 s, an exists 1.0 s."""
    import socket

    with socket.create_server(("127.0.0.1", 0), backlog=64) as silent:  # never accepts
        engine = Engine(False, "page_first", url=f"http://127.0.0.1:{silent.getsockname()[1]}",
                        timeout_s=1, io_threads=1, lease_ms=60000)  # fmt: skip
        backend, keys = engine.backend, keys_of("stalled", 8)
        slots = engine.slots(8)

        def answered(found, pause=0.0):  # the lookup the server answered before it stalled
            def lookup(addresses, *args, **kw):
                time.sleep(pause)
                return found[: len(addresses)]

            backend.client.try_exists_addresses = lookup

        def timed(call) -> tuple[object, float]:
            t0 = time.monotonic()
            return call(), round(time.monotonic() - t0, 2)

        answered([True] * 8)
        out = {"exists": backend.batch_exists(keys)}  # 8 leased
        out["get"], out["get_s"] = timed(lambda: backend.batch_get_v1(keys, slots))
        answered([True, True, False] + [True] * 5)  # hits after the gap: released
        out["gap"], out["gap_s"] = timed(lambda: backend.batch_exists(keys))
        answered([False] * 8, pause=0.8)  # the held check answered late
        out["set"], out["set_s"] = timed(lambda: backend.batch_set_v1(keys, slots))
        engine.close()
    return out


def scenario_strided() -> dict:
    """The legacy get into a target whose elements are not contiguous: a miss, and not a
    byte written (a flat view of it covered whatever lay after its first element)."""
    keys = keys_of("strided", 1)
    writer = Engine(False, "page_first")
    src = writer.slots(1)
    writer.fill(src)
    stored = writer.set(keys, src)
    page = writer.pool.get_dummy_flat_data_page()
    buf = torch.zeros(2 * page.numel(), dtype=page.dtype)
    got = writer.backend.batch_get(keys, [buf[::2]])
    out = {"stored": stored, "got": [g is not None for g in got], "untouched": not buf.any().item()}
    writer.close()
    return out


def scenario_injector() -> dict:
    """SGLang's own failure injector around the backend (random delays and failures):
    every page a get reports loaded holds the bytes stored; the answers stay misses."""
    os.environ["SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"] = "0.3"
    os.environ["SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY"] = "0.002"
    try:
        engine = Engine(False, "page_first")
    finally:
        del os.environ["SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"]
        del os.environ["SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY"]
    wrapped = type(engine.backend).__name__
    rounds, wrong, partial, full = 30, 0, 0, 0
    for r in range(rounds):
        keys = keys_of(f"inject-{r}", 4)
        src = engine.slots(4)
        want = engine.fill(src)
        engine.set(keys, src)  # may fail: then some pages are not there
        engine.pool.kv_buffer.zero_()
        engine.exists(keys)
        got = engine.get(keys, src)
        if got and engine.pages(src)[:got] != want[:got]:
            wrong += 1
        partial += 0 < got < 4
        full += got == 4
        engine.pool.free(src)
    engine.close()
    return {"wrapped": wrapped, "rounds": rounds, "wrong": wrong, "full": full,
            "partial": partial}  # fmt: skip


def scenario_leases() -> dict:
    """A lookup leases its run; the get ends those leases (the server's counters)."""
    import urllib.request

    def counters() -> dict:
        with urllib.request.urlopen(URL + "/kv/stats", timeout=10) as r:
            stats = json.loads(r.read())
        return {k: stats.get(k, 0) for k in ("leases_taken", "leases_released")}

    keys = keys_of("leases", 4)
    engine = Engine(False, "page_first", local_reads=False)
    src = engine.slots(4)
    engine.fill(src)
    assert engine.set(keys, src)
    before = counters()
    found = engine.exists(keys + keys_of("leases-absent", 1) + keys[:1])
    looked = counters()
    got = engine.get(keys, src)
    # The releases go out on the backend's release queue (a thread of its own): wait for
    # them, bounded (read at once, a loaded box's queue had sent 1 of 5).
    deadline = time.monotonic() + 20
    while (after := counters())["leases_released"] - before["leases_released"] < 5:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    engine.close()
    return {"found": found, "before": before, "looked": looked, "after": after, "loaded": got}


def scenario_server_set() -> dict:
    """Through a set of two servers (eg_kv.client.sets): pages spread over both, found
    and loaded whole."""
    import urllib.request

    keys = keys_of("set", 16)
    writer = Engine(False, "page_first", url=MEMBERS)
    src = writer.slots(16)
    want = writer.fill(src)
    stored = writer.set(keys, src)
    reader = Engine(False, "page_first", url=MEMBERS)
    dst = reader.slots(16)
    found = reader.exists(keys)
    got = reader.get(keys, dst)
    held = []
    for member in MEMBERS.split(","):
        with urllib.request.urlopen(member + "/kv/stats", timeout=10) as r:
            held.append(json.loads(r.read())["unique_blocks"])
    out = {"stored": stored, "found": found, "loaded": got, "equal": reader.pages(dst) == want,
           "held": held}  # fmt: skip
    writer.close()
    reader.close()
    return out


def scenario_engine_names() -> dict:
    """Each page's PUT names it as SGLang does (its key, the key before it as parent): the
    server's event log shows the key as the block's engine hash."""
    import urllib.request

    keys = keys_of("engine-names", 5)
    writer = Engine(False, "page_first")
    writer.fill(src := writer.slots(len(keys)))
    stored = writer.set(keys, src)
    want = {writer.backend.format.address(k): k for k in keys}
    seen, since = {}, 0
    for _ in range(100):  # the log holds every scenario's events: read it to its end
        with urllib.request.urlopen(f"{URL}/kv/events?since={since}&limit=1000") as r:
            got = json.loads(r.read())
        for ev in got["events"]:
            if ev["hash"] in want and ev["kind"] == "stored":
                seen[ev["hash"]] = ev.get("engine_hash")
        if got["next"] == since:
            break
        since = got["next"]
    writer.close()
    return {"stored": stored, "named": sum(seen.get(a) == k for a, k in want.items())}


SCENARIOS = {name.removeprefix("scenario_"): fn for name, fn in globals().items()
             if name.startswith("scenario_")}  # fmt: skip

if __name__ == "__main__":
    names = list(SCENARIOS) if SCENARIO == "all" else SCENARIO.split(",")
    print(json.dumps({name: SCENARIOS[name]() for name in names}))
