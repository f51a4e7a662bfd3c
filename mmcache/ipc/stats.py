"""TransportStats: a snapshot of one FeatureSender's pool, fallback, leases and receivers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TransportStats:
    """Bytes are slice bytes (rounded to the alignment); leases are sends not yet released.

    sends and fallbacks count sends that succeeded (fallbacks: those through host memory);
    receivers_lost counts receivers that left since start, by close() or by dying.
    """

    pool_used_bytes: int
    pool_capacity_bytes: int
    fallback_used_bytes: int
    fallback_capacity_bytes: int
    sends: int
    fallbacks: int
    live_leases: int
    open_leases: int
    leaked_bytes: int
    receivers: int
    receivers_lost: int
    waiting_sends: int
    fallbacks_by_reason: dict[str, int] = field(default_factory=dict)
