"""Eviction policies: the order in which a tier gives up its entries."""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Hashable
from typing import Final, Literal, Protocol, final

import cachetools

from mmcache.core.cost_policy import CostPolicy
from mmcache.core.entry import Entry

__all__ = [
    "POLICY_NAMES",
    "CachetoolsPolicy",
    "EvictionPolicy",
    "LruPolicy",
    "PolicyName",
    "make_policy",
]

PolicyName = Literal["lru", "lfu", "fifo", "cost"]
#: the values of the eviction_policy setting
POLICY_NAMES: Final[tuple[PolicyName, ...]] = ("lru", "lfu", "fifo", "cost")


class EvictionPolicy(Protocol):
    """A tier's order of victims; the tier's byte ledger is not its business.

    The cache inserts each entry that becomes resident, touches it on every hit,
    removes it when it leaves by other ways (discard, replacement, promotion) and
    asks for a victim when it needs room.
    """

    def __setitem__(self, key: Hashable, entry: Entry, /) -> None:
        """Add entry, resident from now on, under key (a new key)."""

    def touch(self, key: Hashable, /) -> None:
        """Record a hit on key's entry."""

    def pop(self, key: Hashable, default: None, /) -> Entry | None:
        """Remove key's entry if present; return it (None if absent)."""

    def evict(self) -> Entry:
        """Remove and return the next victim; KeyError when empty."""

    def next_victim(self) -> Entry | None:
        """The entry evict() would return, where the policy can tell without removing it."""

    def peek(self, n: int, /) -> list[Entry]:
        """Up to n of the next victims, in the order evict() would return them, left in
        place (fewer where the policy cannot tell further without evicting)."""

    def __len__(self) -> int:
        """How many entries the policy orders."""


@final
class LruPolicy(OrderedDict[Hashable, Entry]):
    """Least recently used first: an OrderedDict, so a hit costs no Python call of ours."""

    touch = OrderedDict.move_to_end

    def evict(self) -> Entry:
        """Remove and return the least recently used entry."""
        return self.popitem(last=False)[1]

    def next_victim(self) -> Entry | None:
        """The least recently used entry, left in place."""
        return self[next(iter(self))] if self else None

    def peek(self, n: int, /) -> list[Entry]:
        """The n least recently used entries, least recent first, left in place."""
        return list(itertools.islice(self.values(), n))


@final
class CachetoolsPolicy:
    """A policy kept by a cachetools cache: its popitem() chooses the victim.

    The cache is unbounded: the tier's byte ledger decides when to evict, since a
    cachetools cache evicts by itself inside __setitem__ and cannot see bytes in flight.
    """

    __slots__ = ("_order",)

    def __init__(self, order: cachetools.Cache[Hashable, Entry]) -> None:
        self._order = order

    def __setitem__(self, key: Hashable, entry: Entry, /) -> None:
        self._order[key] = entry

    def touch(self, key: Hashable, /) -> None:
        """A lookup: LFU counts a use, FIFO ignores it."""
        self._order[key]

    def pop(self, key: Hashable, default: None, /) -> Entry | None:
        return self._order.pop(key, default)

    def evict(self) -> Entry:
        return self._order.popitem()[1]

    def next_victim(self) -> Entry | None:
        """Not known without evicting (cachetools keeps its order private)."""
        return None

    def peek(self, n: int, /) -> list[Entry]:
        """None known without evicting (cachetools keeps its order private)."""
        return []

    def __len__(self) -> int:
        return len(self._order)


def make_policy(name: str) -> EvictionPolicy:
    """A new, empty policy of the eviction_policy setting's name."""
    if name == "lru":
        return LruPolicy()
    if name == "lfu":
        return CachetoolsPolicy(cachetools.LFUCache(math.inf))
    if name == "fifo":
        return CachetoolsPolicy(cachetools.FIFOCache(math.inf))
    if name == "cost":
        return CostPolicy()
    raise ValueError(f"unknown eviction policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
