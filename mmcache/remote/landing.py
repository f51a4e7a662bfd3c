"""Landing a remote value in the host tier: a block of the arena, then an entry like an
offloaded one's, so a get serves it as a host hit (uploaded, and promoted if it fits)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Hashable
from typing import final

from mmcache.core.entry import Entry, State
from mmcache.core.host import HostTier
from mmcache.core.index import KeyIndex
from mmcache.core.ledger import TierLedger
from mmcache.device import DONE, Device
from mmcache.host_pool import HostBlock
from mmcache.remote.codec import Header

__all__ = ["HostLanding"]


@final
class HostLanding:
    """Puts values received from the remote tier into the host tier, as host entries."""

    def __init__(
        self,
        *,
        device: Device,
        host: HostTier,
        index: KeyIndex,
        ledger: TierLedger,
        changed: Callable[[], None],
    ) -> None:
        self._host = host
        self._index = index
        self._ledger = ledger
        self._changed = changed
        self._done = DONE

    def block_for(self, nbytes: int) -> HostBlock | None:
        """A host block for a value of nbytes (dropping host entries for room), or None when
        the host tier cannot take it now (off, not pinned yet, or too small)."""
        return self._host.allocate(nbytes) if nbytes > 0 else None

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
        if key in self._index:
            self._host.free(block)  # a local put is newer than what the server had
            return False
        done = self._done
        entry = Entry(
            key,
            header.shape,
            header.dtype,
            header.length,
            State.HOST,
            None,
            done,
            block=block,
            copy_fence=done,
        )
        self._index[key] = entry
        self._host.order[key] = entry
        self._ledger.host_entered(1)
        self._changed()
        return True

    def release(self, block: HostBlock) -> None:
        """Give back a block that was not inserted."""
        self._host.free(block)
