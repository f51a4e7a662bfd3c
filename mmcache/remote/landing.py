"""Landing a remote value in the host tier: a block of the arena, then an entry like an
offloaded one's, so a get serves it as a host hit (uploaded, and promoted if it fits)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Hashable, Sequence
from typing import final

from mmcache.core.state import Release, TierState
from mmcache.host_pool import HostBlock
from mmcache.remote.codec import Header

__all__ = ["HostLanding"]


@final
class HostLanding:
    """Puts values received from the remote tier into the host tier, as host entries."""

    def __init__(
        self,
        *,
        state: TierState,
        carry_out: Callable[[Sequence[Release]], None],
        changed: Callable[[], None],
    ) -> None:
        self._state = state  # the tier state changes only through its verbs
        self._carry_out = carry_out
        self._changed = changed

    def block_for(self, nbytes: int) -> HostBlock | None:
        """A host block for a value of nbytes (dropping host entries for room), or None when
        the host tier cannot take it now (off, not pinned yet, or too small)."""
        if nbytes <= 0:
            return None
        releases: list[Release] = []
        block = self._state.allocate_host(nbytes, releases)
        if releases:
            self._carry_out(releases)
        return block

    def fill(self, block: HostBlock, value: bytes, header: Header) -> None:
        """Copy the payload of value (a received bytes object) into block."""
        dst = block.bytes(0, header.length)
        # The one host copy of a remote hit: straight from the client's bytes into the
        # arena (torch.frombuffer would warn that bytes are read-only).
        src = ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p).value
        assert src is not None
        ctypes.memmove(dst.data_ptr(), src + header.size, header.length)

    def insert(self, key: Hashable, block: HostBlock, header: Header) -> bool:
        """Index block as key's host entry; False (block freed) if key was put meanwhile."""
        if not self._state.index_host(key, block, header.shape, header.dtype, header.length):
            return False
        self._changed()
        return True

    def release(self, block: HostBlock) -> None:
        """Give back a block that was not inserted."""
        self._state.free_block(block)
