"""CacheStats: a consistent snapshot of a cache's ledger and counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["CacheStats"]


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of a FeatureCache; bytes are resident plus in flight."""

    gpu_bytes: int
    cpu_bytes: int
    gpu_capacity_bytes: int
    cpu_capacity_bytes: int
    gpu_entries: int
    cpu_entries: int
    pending_copies: int
    hits_gpu: int
    hits_cpu: int
    misses: int
    evictions_gpu: int
    evictions_cpu: int
    dropped: int
    d2h_bytes: int
    h2d_bytes: int
    leaked_bytes: int
    #: puts refused because wait=False and the tier had no room now
    rejected: int = 0
    #: promotions of host-tier hits back to the GPU tier
    promotions: int = 0
    #: False while the pinned host arena is still being allocated
    host_ready: bool = True
    #: bytes of the host arena pinned and in use by the host tier so far (chunk by chunk)
    host_ready_bytes: int = 0
    #: device copies that failed (their entries were dropped)
    copy_failures: int = 0
    #: device allocations that failed (DeviceOutOfMemoryError raised to a caller)
    alloc_failures: int = 0
    #: bytes held by copies that did not complete within copy_timeout_s (part of leaked_bytes)
    quarantined_bytes: int = 0
    #: local misses served by the remote tier (also counted in hits_cpu: they land there)
    remote_hits: int = 0
    #: local misses the remote tier had no value for (also counted in misses)
    remote_misses: int = 0
    #: remote values that failed a header or checksum check (deleted, served as misses)
    remote_rejected: int = 0
    #: remote operations that failed (timeouts, connection and server errors)
    remote_errors: int = 0
    #: payload bytes received from the remote tier
    remote_read_bytes: int = 0
    #: payload bytes written to the remote tier
    remote_written_bytes: int = 0
    #: bytes of remote writes queued and not yet sent
    remote_queued_bytes: int = 0
    #: remote writes dropped (queue full, too large, server unavailable, closed)
    remote_dropped_writes: int = 0
    #: local hits served as misses because another rank of the group missed them (also
    #: counted in hits_gpu or hits_cpu, where this rank found them)
    group_misses: int = 0
    #: bytes the node's shared host tier holds (host_share="node"), each feature once
    #: whichever ranks hold it; cpu_bytes is this rank's share of them (0: not shared)
    node_host_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The snapshot as a plain dict (for logs and JSON)."""
        return asdict(self)

    @property
    def hit_ratio(self) -> float:
        """Hits over lookups (0 when nothing was looked up)."""
        lookups = self.hits_gpu + self.hits_cpu + self.misses
        return (self.hits_gpu + self.hits_cpu) / lookups if lookups else 0.0
