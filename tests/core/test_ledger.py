"""TierLedger: its figures move through its methods, and its audit finds unowned bytes."""

from __future__ import annotations

import torch
from conftest import TimedFence

from mmcache.core.entry import Entry, State
from mmcache.core.ledger import TierLedger


def _entry(nbytes: int, state: State = State.GPU) -> Entry:
    return Entry("k", (nbytes,), torch.uint8, nbytes, state, None, TimedFence(0))


def _inserted(ledger: TierLedger, nbytes: int, features: int = 1) -> None:
    """A put of nbytes that took its room at once and inserted it."""
    grant = ledger.open_grant()
    ledger.grant(grant, nbytes)
    ledger.insert(grant, nbytes, features)
    ledger.close_grant(grant)


def test_a_put_is_granted_then_inserted() -> None:
    ledger = TierLedger(100)
    grant = ledger.open_grant()
    assert ledger.take_if_free((101, grant)) is None
    assert ledger.take_if_free((60, grant)) is grant
    assert (ledger.used, ledger.granted, ledger.free()) == (60, 60, 40)
    assert ledger.leaked([], {}, 0, (0, 0)) == {"gpu": 0, "cpu": 0}  # a running put's
    ledger.insert(grant, 60, 3)
    ledger.close_grant(grant)
    assert (ledger.used, ledger.granted, ledger.gpu_entries) == (60, 0, 3)
    assert ledger.leaked([_entry(60)], {}, 0, (0, 0)) == {"gpu": 0, "cpu": 0}


def test_a_grant_no_running_put_holds_is_leaked_until_returned() -> None:
    ledger = TierLedger(100)
    grant = ledger.open_grant()
    ledger.grant(grant, 40)
    ledger.close_grant(grant)  # the put ended without inserting or giving it back
    assert ledger.leaked([], {}, 0, (0, 0)) == {"gpu": 40, "cpu": 0}
    ledger.return_grant(grant)
    assert (ledger.used, ledger.granted) == (0, 0)
    assert ledger.leaked([], {}, 0, (0, 0)) == {"gpu": 0, "cpu": 0}


def test_an_admitted_entry_owns_its_bytes_and_nothing_else_does() -> None:
    ledger = TierLedger(100)
    ledger.admit(30)  # a put that found room at once: no grant in between
    assert (ledger.used, ledger.gpu_entries, ledger.granted) == (30, 1, 0)
    assert ledger.leaked([_entry(30)], {}, 0, (0, 0)) == {"gpu": 0, "cpu": 0}
    assert ledger.leaked([], {}, 0, (0, 0)) == {"gpu": 30, "cpu": 0}  # no entry holds them


def test_an_offload_moves_entries_and_releases_bytes() -> None:
    ledger = TierLedger(100)
    _inserted(ledger, 50)
    entry = _entry(50, State.D2H)
    ledger.offloading(50, 1, charged_gpu=True)
    assert (ledger.releasing, ledger.cpu_entries) == (50, 1)
    assert ledger.leaked([entry], {entry: True}, 0, (0, 0)) == {"gpu": 0, "cpu": 0}
    ledger.offloaded(50, 1, released=50)
    assert (ledger.used, ledger.releasing, ledger.gpu_entries) == (0, 0, 0)


def test_a_release_after_fences_stays_owned_until_done() -> None:
    ledger = TierLedger(100)
    _inserted(ledger, 30)
    ledger.gpu_left(1)
    ledger.release_later(30)
    assert ledger.leaked([], {}, 0, (0, 0)) == {"gpu": 0, "cpu": 0}
    ledger.released(30)
    assert (ledger.used, ledger.releasing, ledger.released_pending) == (0, 0, 0)


def test_the_audit_reports_bytes_nothing_owns() -> None:
    ledger = TierLedger(100)
    _inserted(ledger, 40)  # an entry of 40 bytes that the index no longer reaches
    assert ledger.leaked([], {}, 0, (0, 0)) == {"gpu": 40, "cpu": 0}
    assert ledger.leaked([], {}, 16, (0, 0)) == {"gpu": 40, "cpu": 16}
    assert ledger.leaked([_entry(40)], {}, 0, (8, 4)) == {"gpu": 8, "cpu": 4}
