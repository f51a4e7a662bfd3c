"""LeaseReclaimer: what one recycler sweep does with the leases receivers are done with."""

from __future__ import annotations

import logging
import time
from typing import Final

from mmcache.ipc.control import LIVE
from mmcache.ipc.leases import LeaseLedger
from mmcache.ipc.room import SendRoom
from mmcache.metrics import CacheMetrics, DeferredPush
from mmcache.settings import CacheSettings

__all__ = ["LeaseReclaimer"]

log = logging.getLogger("mmcache.ipc")

# A send that finds no room sweeps first, at most this often.
_MIN_SWEEP_GAP_S: Final = 0.001
# Sweeps in between read only the oldest leases (LeaseLedger.quick_sweep); a full one,
# which reads every lease, runs at most this often unless asked for.
FULL_SWEEP_GAP_S: Final = 0.05


class LeaseReclaimer:
    """Frees the slices of released leases, flags late ones and speaks for lost receivers.

    It owns when the last sweep ran (a send that finds no room sweeps at most so often).
    """

    def __init__(
        self,
        settings: CacheSettings,
        room: SendRoom,
        gauges: DeferredPush,
        metrics: CacheMetrics,
    ) -> None:
        self.settings = settings
        self._metrics = metrics
        self._room = room
        self._gauges = gauges
        self.last_sweep = 0.0
        self.last_full_sweep = 0.0

    def due(self) -> bool:
        """Whether a send that found no room may sweep now."""
        return time.monotonic() - self.last_sweep >= _MIN_SWEEP_GAP_S

    def sweep(self, ledger: LeaseLedger, *, full: bool = True) -> None:
        """Reclaim what receivers released or left behind; flag late leases; wake waiters.

        full=False: a quick sweep, unless the last full one is FULL_SWEEP_GAP_S old.
        """
        now = time.monotonic()
        if full or now - self.last_full_sweep >= FULL_SWEEP_GAP_S:
            result = ledger.sweep(now)
            self.last_full_sweep = now
        else:
            result = ledger.quick_sweep()
        self.last_sweep = now
        timeout_env = self.settings.env_name("ipc_lease_timeout_s")
        for lease in result.recycled:
            if lease.timed_out:
                log.info(
                    "%s was released late, %.1f s after it was sent; its slice is reused",
                    lease.handle.describe(),
                    time.monotonic() - lease.sent_at,
                )
            # After the sender's own copy into it too: a receiver that died may not have waited.
            lease.arena.free(lease.block, [lease.written])
            self._metrics.ipc_recycled(now - lease.sent_at)
            self._room.give_slot(lease.handle.slot)
        for lease in result.timed_out:
            owing = ", ".join(f"pid {i.pid}" for i in ledger.owing(lease)) or "none registered"
            log.warning(
                "%s was not released within %.1f s (%s): counted in "
                'mmcache_leaked_bytes{tier="ipc"} until it is released or its receivers '
                "exit; receivers that have not released it: %s",
                lease.handle.describe(),
                ledger.timeout_s,
                timeout_env,
                owing,
            )
        for info, credited in result.lost:
            closed = info.state != LIVE
            log.log(
                logging.INFO if closed and not credited else logging.WARNING,
                "IPC receiver pid %d (lane %d) %s; %d sends it held or was owed are released "
                "on its behalf",
                info.pid,
                info.lane,
                "closed" if closed else "exited",
                credited,
            )
        self._room.waiters.grant()
        self._gauges.flush()  # a sweep's outcome shows at once (tests and operators read it)
