"""The server's removals of blocks :class:`~eg_kv.vllm.tier.EgKvTier` knows, for vLLM's
KV-events stream (no vLLM import).

eg-kv keeps an exact, ordered log of the blocks it stores and removes (evicted, deleted
to zero references, dropped by a repair, evicted for a quota: ``GET /kv/events``,
:mod:`eg_kv.client.events`). :class:`RemovalRelay` follows that log on a thread of its own
and turns each removal of a block the tier stored or loaded (the addresses it was told
to :meth:`~RemovalRelay.watch`, at most ``max_watched``, oldest forgotten first) into its
vLLM key, for :meth:`~RemovalRelay.take`. After a gap (the log lapped the reader) or a
reconnection it starts again from a snapshot of the blocks held: a block watched before
the snapshot was asked for and absent from it was removed meanwhile (one watched later may
have been stored after the snapshot was taken; its removal, if any, comes as an event).
So a router that scores instances by what they offloaded hears of the removals too, not
only of the stores.

Bounds: one long-poll at a time (``wait_s``, plus the client's timeout); after an error
it waits ``retry_s`` before asking again; :meth:`~RemovalRelay.close` returns within
``wait_s`` + the client's timeout at worst (the thread is a daemon). A snapshot holds
every address of the namespace: tens of MiB for a million blocks.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["RemovalRelay"]

log = logging.getLogger("eg_kv.vllm.tier")


class _Stopped(Exception):
    """Internal: :meth:`RemovalRelay.close` ended the follower's wait."""


class RemovalRelay:
    """Follows a server's event log for the removals of watched addresses.

    Args:
        source: makes the client the thread reads the log with (a single-server sync
            client: ``events`` and ``snapshot``); closed when the thread ends.
        wait_s: seconds one request waits for new events.
        retry_s: pause after an error (an unreachable server, no log there).
        max_watched: addresses remembered (oldest forgotten first).
    """

    def __init__(
        self,
        source: Callable[[], Any],
        *,
        wait_s: float = 1.0,
        retry_s: float = 1.0,
        max_watched: int = 65536,
    ) -> None:
        if wait_s <= 0 or retry_s <= 0 or max_watched < 1:
            raise ValueError("wait_s > 0, retry_s > 0, max_watched >= 1")
        self._source = source
        self.wait_s = wait_s
        self.retry_s = retry_s
        self.max_watched = max_watched
        # address -> (key, the watch's tick): a snapshot judges only what was watched
        # before it was asked for.
        self._watched: OrderedDict[str, tuple[Hashable, int]] = OrderedDict()
        self._ticks = 0
        self._removed: list[Hashable] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.following = threading.Event()  # set once the first snapshot was read
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="eg-kv-tier-events", daemon=True)
        self._thread.start()

    def watch(self, address: str, key: Hashable) -> None:
        """Report ``key`` when the block at ``address`` is removed."""
        with self._lock:
            self._ticks += 1
            self._watched[address] = (key, self._ticks)
            self._watched.move_to_end(address)
            while len(self._watched) > self.max_watched:
                self._watched.popitem(last=False)

    def take(self) -> list[Hashable]:
        """The keys whose blocks were removed since the last call."""
        with self._lock:
            out, self._removed = self._removed, []
        return out

    def _gone(self, addresses: list[str]) -> None:
        with self._lock:
            for address in addresses:
                entry = self._watched.pop(address, None)
                if entry is not None:
                    self._removed.append(entry[0])

    def _run(self) -> None:
        from ..client.events import Pacer, Snapshot, follow

        pacer = Pacer()  # across reconnections: at most 20 requests/s, a snapshot per 5 s
        while not self._stop.is_set():
            client = None
            try:
                client = self._source()
                log_source = _TickedSnapshots(client, self)
                for item in follow(log_source, wait=self.wait_s, pacer=pacer, sleep=self._pause):
                    if self._stop.is_set():
                        break
                    if isinstance(item, Snapshot):
                        held = {b.hash for b in item.blocks}
                        asked = log_source.asked_at
                        with self._lock:
                            missing = [
                                a
                                for a, (_, tick) in self._watched.items()
                                if tick <= asked and a not in held
                            ]
                        self._gone(missing)
                        self.following.set()
                    elif item.kind == "removed":
                        self._gone([item.hash])
            except _Stopped:
                break
            except Exception as exc:  # the next attempt starts from a snapshot
                self.errors += 1
                log.debug("EgKvTier: following the event log failed: %s", exc)
                pacer.trouble()
                self._stop.wait(self.retry_s)
            finally:
                if client is not None:
                    client.close()

    def _tick(self) -> int:
        with self._lock:
            return self._ticks

    def _pause(self, seconds: float) -> None:
        """The follower's wait for its turn; raises :class:`_Stopped` once closed (a
        follower that gets no events never yields, so it is stopped here)."""
        if self._stop.wait(seconds):
            raise _Stopped

    def close(self, timeout_s: float | None = None) -> None:
        """Stop following (waits up to ``timeout_s`` for the thread; a daemon otherwise)."""
        self._stop.set()
        self._thread.join(timeout_s)


class _TickedSnapshots:
    """The follower's client, noting the watch tick each snapshot was asked at: a block
    watched after that may have been stored after the server took the snapshot, so its
    absence from the snapshot says nothing (a removal after it comes as an event)."""

    def __init__(self, client: Any, relay: RemovalRelay) -> None:
        self._client = client
        self._relay = relay
        self.asked_at = 0

    def snapshot(self) -> Any:
        self.asked_at = self._relay._tick()
        return self._client.snapshot()

    def events(self, *args: Any) -> Any:
        return self._client.events(*args)
