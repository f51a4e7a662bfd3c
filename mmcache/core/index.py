"""KeyIndex: which entry holds each key's feature, and the members of groups."""

from __future__ import annotations

import itertools
from collections.abc import Hashable

import torch

from mmcache.core.entry import Entry, GroupKey, Member, State
from mmcache.device.base import Fence

__all__ = ["KeyIndex", "holder"]


def holder(found: Entry | Member) -> Entry:
    """The entry that holds a key's feature: its own, or its group's."""
    return found.group if isinstance(found, Member) else found


class KeyIndex(dict[Hashable, Entry | Member]):
    """Key -> its entry, or its place in a put_many/put_split group's entry.

    A dict, so a lookup on the read path costs no Python call of ours; keys are added
    by put and removed only through forget() and leave().
    """

    def add_group(
        self, keys: list[Hashable], rows: list[int], packed: torch.Tensor, ready: Fence, nbytes: int
    ) -> Entry:
        """Index a packed group: one entry for the tiers, one member per key (keys absent)."""
        group = Entry(
            GroupKey(keys[0], len(keys)),
            tuple(packed.shape),
            packed.dtype,
            nbytes,
            State.GPU,
            packed,
            ready,
            count=len(keys),
        )
        stops = list(itertools.accumulate(rows))
        members = list(map(Member, zip(keys, itertools.repeat(group), [0, *stops], stops)))
        self.update(zip(keys, members, strict=True))
        group.add_members(members)
        return group

    def leave(self, member: Member) -> bool:
        """Remove a member's key, if it still names this member; True if it did.

        The group keeps the member's rows (a group is one block of memory on either side);
        its count of features goes down by one.
        """
        if self.get(member.key) is not member:
            return False
        del self[member.key]
        member.group.member_left()
        return True

    def forget(self, entry: Entry) -> int:
        """Remove entry's keys (a group's: its members') from the index; how many there were."""
        if entry.members is None:
            if self.get(entry.key) is entry:
                del self[entry.key]
                return 1
            return 0
        forgotten = 0
        for member in entry.drop_members():
            if self.get(member.key) is member:
                del self[member.key]
                forgotten += 1
        return forgotten

    def holder(self, key: Hashable) -> Entry:
        """The entry that holds key's feature (its group's, for a member); KeyError if none."""
        return holder(self[key])

    def held(self) -> list[Entry]:
        """Every entry the index reaches, once each (a group once for all its members)."""
        found = {}
        for value in self.values():
            entry = holder(value)
            found[id(entry)] = entry
        return list(found.values())
