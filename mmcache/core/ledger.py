"""TierLedger: the bytes and entries of both tiers, and the audit that finds leaked bytes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import final

from mmcache.entry import Entry, State

__all__ = ["TierLedger"]


@final
class TierLedger:
    """The GPU tier's bytes and both tiers' entry counts, changed only by its methods.

    used = bytes of entries on the device + granted + releasing, and never exceeds
    capacity. granted is reserved for puts that have not inserted yet; releasing is
    device memory of entries being offloaded and of tensors released after fences,
    of which released_pending is no entry's any more. The host tier's bytes are the
    host pool's own ledger.
    """

    __slots__ = (
        "capacity",
        "cpu_entries",
        "gpu_entries",
        "granted",
        "released_pending",
        "releasing",
        "used",
    )

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = self.granted = self.releasing = self.released_pending = 0
        self.gpu_entries = self.cpu_entries = 0

    def free(self) -> int:
        """GPU bytes neither resident, granted nor releasing."""
        return self.capacity - self.used

    def grant(self, nbytes: int) -> None:
        """Reserve nbytes for a put (the caller checked free())."""
        self.used += nbytes
        self.granted += nbytes

    def give_back(self, nbytes: int) -> None:
        """A put will not insert what it was granted."""
        self.used -= nbytes
        self.granted -= nbytes

    def take_if_free(self, nbytes: int) -> int | None:
        """Grant nbytes if they are free now (a FifoBudget's take); None if not."""
        if self.capacity - self.used < nbytes:
            return None
        self.used += nbytes
        self.granted += nbytes
        return nbytes

    def insert(self, nbytes: int, features: int) -> None:
        """A put's granted bytes became entries holding features on the device."""
        self.granted -= nbytes
        self.gpu_entries += features

    def promote(self, nbytes: int) -> None:
        """A host entry (or group member) came back to the device as one entry."""
        self.used += nbytes
        self.gpu_entries += 1

    def release(self, nbytes: int) -> None:
        """Device bytes released now (their fences are done)."""
        self.used -= nbytes

    def release_later(self, nbytes: int) -> None:
        """Device bytes no entry owns, released once their fences are done (released())."""
        self.releasing += nbytes
        self.released_pending += nbytes

    def released(self, nbytes: int) -> None:
        """Bytes of release_later() whose fences are done."""
        self.releasing -= nbytes
        self.released_pending -= nbytes
        self.used -= nbytes

    def offloading(self, nbytes: int, features: int, charged_gpu: bool) -> None:
        """An offload copy of features (nbytes) queued: counted in the host tier from now."""
        self.cpu_entries += features
        if charged_gpu:
            self.releasing += nbytes

    def offloaded(self, moved: int, features: int, released: int) -> None:
        """A GPU-charged offload of features (moved bytes) landed; released freed now."""
        self.releasing -= moved
        self.gpu_entries -= features
        self.used -= released

    def gpu_left(self, features: int) -> None:
        """Features left the GPU tier's count (discarded, or their group shrank)."""
        self.gpu_entries -= features

    def host_left(self, features: int) -> None:
        """Features left the host tier's count."""
        self.cpu_entries -= features

    def leaked(
        self,
        held: Iterable[Entry],
        offloading: Mapping[Entry, bool],
        host_used: int,
        quarantined: tuple[int, int],
    ) -> dict[str, int]:
        """Bytes that no entry, copy or pending release owns, per tier (should be 0).

        held: the entries the index reaches; offloading: every entry with an offload in
        flight -> whether it is GPU-charged; host_used: the host pool's bytes in use and
        not being freed; quarantined: the (device, host) bytes overdue copies still pin,
        which count as leaked since they may never come back.
        """
        gpu_owned = self.granted + self.released_pending
        holders = {id(e): e for e in held}
        for e, charged in offloading.items():
            holders[id(e)] = e  # discarded while offloading: still holds both sides
            if charged:
                gpu_owned += e.nbytes
        cpu_owned = 0
        for e in holders.values():
            if e.state is State.GPU:
                gpu_owned += e.nbytes
            if e.block is not None:
                cpu_owned += e.block.nbytes
        return {
            "gpu": self.used - gpu_owned + quarantined[0],
            "cpu": host_used - cpu_owned + quarantined[1],
        }
