"""TierLedger: the bytes and entries of both tiers, and the audit that finds leaked bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import final

from mmcache.core.entry import Entry, State
from mmcache.core.grants import Grant, Grants

__all__ = ["TierLedger"]


@final
class TierLedger:
    """The GPU tier's bytes and both tiers' entry counts, changed only by its methods.

    used = bytes of entries on the device + granted + releasing, and never exceeds
    capacity. Granted bytes are reserved for puts that have not inserted yet, each
    put's in a Grant of its own (mmcache.core.grants), so that the audit sees budget that no
    running put holds; releasing is device memory of entries being offloaded and of
    tensors released after fences, of which released_pending is no entry's any more.
    The host tier's bytes are the host pool's own ledger.
    """

    __slots__ = (
        "capacity",
        "close_grant",
        "cpu_entries",
        "gpu_entries",
        "grants",
        "open_grant",
        "released_pending",
        "releasing",
        "used",
    )

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = self.releasing = self.released_pending = 0
        self.gpu_entries = self.cpu_entries = 0
        #: the budget granted to puts that have not inserted yet, per put
        self.grants = grants = Grants()
        # Every put opens and closes one: bound here, they cost no call of ours.
        #: a grant for a put starting now (close_grant() it when the put ends, however)
        self.open_grant: Callable[[], Grant] = grants.open
        #: a put has ended: what its grant still holds is held by nobody (the audit's)
        self.close_grant: Callable[[Grant], None] = grants.close

    @property
    def granted(self) -> int:
        """GPU bytes granted to puts that have not inserted them (nor given them back)."""
        return self.grants.total

    def free(self) -> int:
        """GPU bytes neither resident, granted nor releasing."""
        return self.capacity - self.used

    def grant(self, grant: Grant, nbytes: int) -> None:
        """Reserve nbytes for grant's put (the caller checked free())."""
        self.used += nbytes
        self.grants.take(grant, nbytes)

    def return_grant(self, grant: Grant) -> None:
        """grant's put will not insert what it holds: give it all back."""
        nbytes = grant.nbytes
        if nbytes:
            self.used -= nbytes
            self.grants.settle(grant, nbytes)

    def take_if_free(self, want: tuple[int, Grant]) -> Grant | None:
        """Grant want's bytes into its grant if they are free now (a FifoBudget's take)."""
        nbytes, grant = want
        if self.capacity - self.used < nbytes:
            return None
        self.used += nbytes
        self.grants.take(grant, nbytes)
        return grant

    def insert(self, grant: Grant, nbytes: int, features: int) -> None:
        """nbytes of grant's budget became entries holding features on the device."""
        self.grants.settle(grant, nbytes)
        self.gpu_entries += features

    def admit(self, nbytes: int) -> None:
        """A new entry of one feature took nbytes that were free, with no grant between
        (a put that found room at once)."""
        self.used += nbytes
        self.gpu_entries += 1

    def promote(self, nbytes: int, entries: int = 1) -> None:
        """Host entries (or group members) came back to the device, each as one entry."""
        self.used += nbytes
        self.gpu_entries += entries

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

    def overdue(self, nbytes: int) -> None:
        """An offload of nbytes is past copy_timeout_s (quarantined): still used, but no
        longer on its way, since its copy may never land (offloaded() once it lands, less
        these bytes)."""
        self.releasing -= nbytes

    def gpu_left(self, features: int) -> None:
        """Features left the GPU tier's count (discarded, or their group shrank)."""
        self.gpu_entries -= features

    def host_entered(self, features: int) -> None:
        """Features entered the host tier's count without an offload (received remotely)."""
        self.cpu_entries += features

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
        # Granted bytes count as owned only while the put they were granted to runs.
        granted = self.grants.held_bytes()
        gpu_owned = granted + self.released_pending
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
