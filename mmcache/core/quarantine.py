"""Quarantine: offloads past copy_timeout_s and the bytes they still pin."""

from __future__ import annotations

from typing import final

from mmcache.core.entry import Entry

__all__ = ["Quarantine"]


@final
class Quarantine:
    """Entries whose offload copy did not complete in time, with the bytes it may still use.

    The copy may still run, reading the device tensor and writing the host block, so
    neither can be reused: their bytes count as leaked until the copy's fence completes.
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[Entry, tuple[int, int]] = {}

    def __contains__(self, entry: Entry) -> bool:
        return entry in self._held

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, entry: Entry, device_bytes: int, host_bytes: int) -> None:
        """Keep entry's device and host bytes reserved until release(entry)."""
        self._held[entry] = (device_bytes, host_bytes)

    def release(self, entry: Entry) -> int:
        """Entry's copy completed at last: its bytes come back; the device bytes it held
        (0 if not held)."""
        held = self._held.pop(entry, None)
        return 0 if held is None else held[0]

    def device_bytes(self) -> int:
        """Device bytes held by quarantined copies."""
        return sum(d for d, _ in self._held.values())

    def host_bytes(self) -> int:
        """Host bytes held by quarantined copies."""
        return sum(h for _, h in self._held.values())
