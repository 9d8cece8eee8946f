"""Where an address lives in a set of servers: weighted rendezvous (HRW) hashing.

Every client (sync, async, the LMCache adapters) places an address with this one module,
so every process on every host sends it to the same member: a block's one home holds its
only copy and its exact refcount, with no coordinator.

For each member the score of an address is ``-weight / ln(u)``, where ``u`` in (0, 1) is
drawn from BLAKE2b of ``member_id NUL address`` (never ``hash()``, which changes with
PYTHONHASHSEED). The highest score wins. This is the weighted rendezvous hash of Schindelhauer
and Schomaker: a member of weight ``w`` wins a share ``w / sum(weights)`` of the addresses,
removing a member moves only the addresses it held, and adding one moves only the addresses
it now wins (about ``1/K`` of them for equal weights). The ranking of the members for one
address is also its fallback order: while an address's home is down it goes to the
next-ranked member, and right after a member is added the next-ranked member is where the
address lived before.

Standard library only: the sync client imports it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TypeVar

from ..errors import ConfigError

T = TypeVar("T")
K = TypeVar("K")

#: ``u`` takes 52 bits of the digest so that ``(x + 0.5) / 2**52`` is exact in a double and
#: lies strictly inside (0, 1): ``ln(u)`` is never 0 and never ``-inf``.
_U_BITS = 52
_U_SHIFT = 64 - _U_BITS
_U_SCALE = float(1 << _U_BITS)

#: No member's weight counts for more than this many times the (lower) median weight of
#: the set: a member that reports ``capacity_bytes = 2**62`` (a bug or a lie) takes at most
#: ``4 / (4 + K - 1)`` of the addresses among K-1 equal others, not all of them. Real
#: fleets mix hosts a few times apart; a larger host beyond 4x is under-used, not wrong.
WEIGHT_CAP_FACTOR = 4.0


def unit_hash(member_id: str, address: str) -> float:
    """The uniform draw ``u`` in (0, 1) of one (member, address) pair.

    BLAKE2b-64 of the UTF-8 of ``member_id``, a NUL byte and ``address``: the same in every
    process, on every host and in every Python version.
    """
    digest = hashlib.blake2b(member_id.encode() + b"\0" + address.encode(), digest_size=8).digest()
    return ((int.from_bytes(digest, "big") >> _U_SHIFT) + 0.5) / _U_SCALE


def score(member_id: str, weight: float, address: str) -> float:
    """The HRW score of ``address`` on a member: ``-weight / ln(u)`` (positive)."""
    return -weight / math.log(unit_hash(member_id, address))


class Placement:
    """A fixed member set with weights; places addresses on members. Immutable.

    Args:
        members: ``{member_id: weight}`` or ``(member_id, weight)`` pairs. Ids must be
            stable across restarts (``host:port`` or an SRV target and port, never a pod
            IP); weights are positive and finite, and only their ratios matter (a member
            with twice the weight gets twice the addresses).

    Raises:
        ConfigError: an empty id, an id given twice, or a weight that is not a positive
            finite number.

    A placement with no members is allowed (a DNS set not yet resolved): it places
    nothing, so every address is a miss.
    """

    __slots__ = ("_hashers", "_ids", "_weights")

    def __init__(self, members: Mapping[str, float] | Iterable[tuple[str, float]]) -> None:
        pairs = list(members.items() if isinstance(members, Mapping) else members)
        ids: list[str] = []
        weights: dict[str, float] = {}
        for member_id, weight in pairs:
            if not isinstance(member_id, str) or not member_id:
                raise ConfigError(f"a member id must be a non-empty string, not {member_id!r}")
            if member_id in weights:
                raise ConfigError(f"member {member_id!r} is listed twice")
            w = float(weight)
            if not (w > 0 and math.isfinite(w)):
                raise ConfigError(
                    f"member {member_id!r} has weight {weight!r}: want a positive finite number"
                )
            ids.append(member_id)
            weights[member_id] = w
        # Sorted so that equal scores (probability ~2**-52) break the same way everywhere.
        self._ids: tuple[str, ...] = tuple(sorted(ids))
        self._weights = weights
        # BLAKE2b state after ``member_id NUL``: copying it is cheaper than rehashing the id.
        self._hashers = tuple(
            (m, weights[m], hashlib.blake2b(m.encode() + b"\0", digest_size=8)) for m in self._ids
        )

    def __repr__(self) -> str:
        inner = ", ".join(f"{m!r}: {self._weights[m]:g}" for m in self._ids)
        return f"Placement({{{inner}}})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placement) and self._weights == other._weights

    def __hash__(self) -> int:
        return hash(frozenset(self._weights.items()))

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def members(self) -> tuple[str, ...]:
        """The member ids, sorted."""
        return self._ids

    @property
    def weights(self) -> dict[str, float]:
        """A copy of ``{member_id: weight}``."""
        return dict(self._weights)

    def _scores(self, address: str) -> list[tuple[float, str]]:
        raw = address.encode()
        out = []
        for member_id, weight, base in self._hashers:
            h = base.copy()
            h.update(raw)
            u = ((int.from_bytes(h.digest(), "big") >> _U_SHIFT) + 0.5) / _U_SCALE
            out.append((-weight / math.log(u), member_id))
        return out

    def ranking(self, address: str) -> list[str]:
        """Every member id, best first: the home, then where the address goes while the
        home is down (and where it lived before the home was added), and so on."""
        return [m for _, m in sorted(self._scores(address), key=_rank_key)]

    def home(self, address: str, skip: Collection[str] = ()) -> str | None:
        """The member that holds ``address``: the best-ranked one not in ``skip``.

        Args:
            address: the block address (as the clients send it).
            skip: member ids to pass over (those known to be down).

        Returns:
            A member id, or None when every member is skipped or there is none.
        """
        if len(self._ids) == 1:  # a set of one costs no hashing
            only = self._ids[0]
            return None if only in skip else only
        best: tuple[float, str] | None = None
        for entry in self._scores(address):
            if entry[1] in skip:
                continue
            if best is None or _rank_key(entry) < _rank_key(best):
                best = entry
        return None if best is None else best[1]

    def group(self, addresses: Sequence[str], skip: Collection[str] = ()) -> dict[str, list[int]]:
        """Split a batch by member, keeping each address's index in ``addresses``.

        Args:
            addresses: the batch, in the caller's order.
            skip: member ids to pass over (down); their addresses go to their next-ranked
                member.

        Returns:
            ``{member_id: [index, ...]}`` with indices ascending within each group. An
            address with no member left (all skipped, or an empty set) is in no group:
            :func:`merge` answers it with the default (a miss).
        """
        groups: dict[str, list[int]] = {}
        for i, address in enumerate(addresses):
            member = self.home(address, skip)
            if member is not None:
                groups.setdefault(member, []).append(i)
        return groups


def cap_weights(weights: Mapping[K, float], factor: float = WEIGHT_CAP_FACTOR) -> dict[K, float]:
    """Each weight, held to at most ``factor`` times the lower median of them all.

    The lower median (not the mean, which one huge value drags along) is taken, so that
    in a set of two an outlier is held by the other member, not by itself.

    Args:
        weights: ``{member: weight}``, positive and finite.
        factor: the cap, a multiple of the median (>= 1).

    Returns:
        A new dict with the same keys; weights at or under the cap unchanged.

    Raises:
        ConfigError: ``factor`` below 1.
    """
    if not factor >= 1:
        raise ConfigError(f"the weight cap factor must be at least 1, not {factor!r}")
    if not weights:
        return {}
    ordered = sorted(weights.values())
    cap = factor * ordered[(len(ordered) - 1) // 2]
    return {m: min(w, cap) for m, w in weights.items()}


def _rank_key(entry: tuple[float, str]) -> tuple[float, str]:
    # Highest score first; on an exact tie the smaller id, the same in every process.
    return (-entry[0], entry[1])


def merge(
    n: int,
    groups: Mapping[K, Sequence[int]],
    answers: Mapping[K, Sequence[T]],
    default: T,
) -> list[T]:
    """Put per-member answers back into the caller's order.

    Args:
        n: the length of the original batch.
        groups: what :meth:`Placement.group` returned (member -> indices).
        answers: member -> its answers, in the order of that member's indices. A member
            missing here (it failed or timed out) leaves its positions at ``default``.
        default: the answer where no member answered (a miss: False, None, 0).

    Returns:
        A list of ``n`` answers in the order of the original batch.

    Raises:
        ValueError: an answer list whose length differs from its group's, an answer for a
            member that has no group, or an index outside ``range(n)``.
    """
    out = [default] * n
    for member, values in answers.items():
        if member not in groups:
            raise ValueError(f"an answer from {member!r}, which was sent no addresses")
        indices = groups[member]
        if len(values) != len(indices):
            raise ValueError(
                f"{member!r} answered {len(values)} values for {len(indices)} addresses"
            )
        for i, value in zip(indices, values, strict=True):
            if not 0 <= i < n:
                raise ValueError(f"index {i} outside a batch of {n}")
            out[i] = value
    return out


def prefix_hits(found: Iterable[bool]) -> int:
    """How many leading entries of a merged answer are hits: a prefix counts only up to its
    first miss, whichever member held each chunk."""
    count = 0
    for hit in found:
        if not hit:
            break
        count += 1
    return count
