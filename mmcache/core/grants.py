"""Grants: GPU budget granted to puts that have not inserted yet, and which put holds it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Grant", "Grants"]


@dataclass(slots=True, eq=False)
class Grant:
    """The GPU budget one put holds: granted, and neither inserted nor given back yet."""

    nbytes: int = 0


class Grants:
    """Granted bytes in all, and the grants of the puts still running.

    A put opens a grant, takes budget into it, settles it (its entries inserted, or the
    budget given back) and closes it, also when it fails. Bytes left in a closed grant
    are held by no live put: the audit counts them as leaked.
    """

    def __init__(self) -> None:
        self.total = 0
        self._open: dict[Grant, None] = {}

    def open(self) -> Grant:
        """A new grant for a put starting now."""
        grant = Grant()
        self._open[grant] = None
        return grant

    def take(self, grant: Grant, nbytes: int) -> None:
        """Record nbytes of budget granted to grant's put."""
        grant.nbytes += nbytes
        self.total += nbytes

    def settle(self, grant: Grant, nbytes: int) -> None:
        """Record nbytes of grant's budget inserted as entries or given back."""
        grant.nbytes -= nbytes
        self.total -= nbytes

    def close(self, grant: Grant) -> None:
        """The put of grant has ended; what it still holds is held by nobody."""
        self._open.pop(grant, None)

    def held_bytes(self) -> int:
        """Granted bytes that a put still running holds."""
        return sum(grant.nbytes for grant in self._open)
