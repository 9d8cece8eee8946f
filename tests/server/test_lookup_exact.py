"""``POST /kv/batch/exists`` stays exact while other processes store, delete and evict.

Churn processes (real ones, over real HTTP) store and delete their own addresses, one
owner per address, and log every operation with CLOCK_MONOTONIC start and end times
(one clock for every process on the host). Meanwhile this process asks, in batches
mixing every kind of address, in both wire formats (compact and JSON), and logs each
answer with its own start and end. Afterwards every answer is checked against the
serialised history:

* an address never stored is never found;
* an address stored before the churn and never deleted is always found (in the phase
  without evictions: an eviction may take any block);
* a churned address found must have had a store start before the lookup ended whose
  delete (if any) had not finished before the lookup started; one not found must not
  have been provably resident throughout the lookup (stored before it began and not
  deleted before it ended) unless evictions run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from eg_kv.address import address_for_key
from eg_kv.client.connectors import RemoteKVConnector

CHURN = r"""
import json, sys, time
from eg_kv.client.connectors import RemoteKVConnector
url, me, n, filler, seconds, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
    int(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
mine = [f"churn-{me}-{i}" for i in range(n)]
log = []  # [address, op, ok, start, end]
kv = RemoteKVConnector(base_url=url, timeout_s=10)
end, k = time.monotonic() + seconds, 0
while time.monotonic() < end and k < 100000:
    a = mine[k % n]
    t0 = time.monotonic(); ok = kv.put(a, b"x" * 1000); t1 = time.monotonic()
    log.append([a, "put", ok, t0, t1])
    for j in range(filler):  # blocks that only push others out
        kv.put(f"filler-{me}-{k}-{j}", bytes(64 * 1024))
    t0 = time.monotonic(); ok = kv.delete(a); t1 = time.monotonic()
    log.append([a, "delete", ok, t0, t1])
    k += 1
kv.close()
json.dump(log, open(out, "w"))
"""

N_CHURNERS, N_CHURNED, SECONDS = 2, 24, 3.0


def _history(logs: list[list]) -> dict[str, list[tuple[float, float, float]]]:
    """Per churned address: (put start, put end, delete end or inf) of each store."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    for log in logs:
        open_put: dict[str, tuple[float, float]] = {}
        for address, op, ok, t0, t1 in log:
            if op == "put" and ok:
                open_put[address] = (t0, t1)
            elif op == "delete" and address in open_put:
                p0, p1 = open_put.pop(address)
                out.setdefault(address, []).append((p0, p1, t1, t0))
        for address, (p0, p1) in open_put.items():
            out.setdefault(address, []).append((p0, p1, float("inf"), float("inf")))
    return out


def _check(answers, history, pinned, never, evictions: bool) -> int:
    """Check every answer; return how many churned answers could be judged."""
    judged = 0
    for batch, found, t0, t1 in answers:
        for address, hit in zip(batch, found, strict=True):
            if address in never:
                assert not hit, f"{address} was never stored but found"
            elif address in pinned:
                if not evictions:
                    assert hit, f"{address} is never deleted but not found"
            else:
                spans = history.get(address, [])
                # (put start, put end, delete end, delete start)
                may_be = any(p0 <= t1 and d1 >= t0 for p0, _p1, d1, _d0 in spans)
                must_be = any(p1 <= t0 and d0 >= t1 for _p0, p1, _d1, d0 in spans)
                if hit:
                    assert may_be, f"{address} found at [{t0}, {t1}] but not stored then"
                elif not evictions:
                    assert not must_be, f"{address} resident over [{t0}, {t1}] but not found"
                judged += 1
    return judged


@pytest.mark.timeout(90)
@pytest.mark.parametrize("evictions", [False, True], ids=["no-evictions", "evictions"])
@pytest.mark.slow
def test_batch_exists_is_exact_under_churn(server_factory, tmp_path, evictions):
    # 64 MiB holds every block of the phase without evictions many times over; in the
    # other, each churn step also stores 64 KiB fillers into 8 MiB, so the slab evicts
    # all the time.
    srv = server_factory(workers=2, capacity="8MiB" if evictions else "64MiB")
    pinned = [f"pinned-{i}" for i in range(16)]
    never = [address_for_key(f"never-{i}") for i in range(16)]
    churned = [f"churn-{c}-{i}" for c in range(N_CHURNERS) for i in range(N_CHURNED)]
    with RemoteKVConnector(base_url=srv.url, timeout_s=10) as kv:
        assert all(kv.put(a, b"p" * 1000) for a in pinned)
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    CHURN,
                    srv.url,
                    str(c),
                    str(N_CHURNED),
                    "4" if evictions else "0",
                    str(SECONDS),
                    str(tmp_path / f"churn-{c}.json"),
                ],
            )
            for c in range(N_CHURNERS)
        ]
        try:
            answers = []
            json_kv = RemoteKVConnector(base_url=srv.url, timeout_s=10)
            json_kv._core.compact_batches = False  # the JSON contract, under the same churn
            everything = pinned + never + churned
            deadline = time.monotonic() + SECONDS + 5
            i = 0
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                client = kv if i % 2 == 0 else json_kv
                batch = everything[i % 7 :] + everything[: i % 7]
                t0 = time.monotonic()
                found = client.try_exists_many(batch)
                t1 = time.monotonic()
                assert found is not None, "a lookup failed"
                answers.append((batch, found, t0, t1))
                i += 1
            json_kv.close()
            for p in procs:
                assert p.wait(30) == 0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        stats = kv.stats()
    logs = [json.loads((tmp_path / f"churn-{c}.json").read_text()) for c in range(N_CHURNERS)]
    history = _history(logs)
    assert len(answers) > 20 and len(history) == N_CHURNERS * N_CHURNED
    judged = _check(answers, history, set(pinned), set(never), evictions)
    assert judged > 0
    hits = sum(hit for batch, found, _, _ in answers for a, hit in zip(batch, found, strict=True)
               if a.startswith("churn-"))  # fmt: skip
    assert hits > 0, "no churned address was ever seen resident: the test judged nothing"
    if evictions:
        assert stats.extra.get("evictions", 0) > 0, "the eviction phase evicted nothing"
