"""TierLedger: its figures move through its methods, and its audit finds unowned bytes."""

from __future__ import annotations

import torch
from conftest import TimedFence

from mmcache.core.ledger import TierLedger
from mmcache.entry import Entry, State


def _entry(nbytes: int, state: State = State.GPU) -> Entry:
    return Entry("k", (nbytes,), torch.uint8, nbytes, state, None, TimedFence(0))


def test_a_put_is_granted_then_inserted() -> None:
    ledger = TierLedger(100)
    assert ledger.take_if_free(101) is None
    assert ledger.take_if_free(60) == 60
    assert (ledger.used, ledger.granted, ledger.free()) == (60, 60, 40)
    ledger.insert(60, 3)
    assert (ledger.used, ledger.granted, ledger.gpu_entries) == (60, 0, 3)
    ledger.give_back(0)
    assert ledger.leaked([_entry(60)], {}, 0, (0, 0)) == {"gpu": 0, "cpu": 0}


def test_an_offload_moves_entries_and_releases_bytes() -> None:
    ledger = TierLedger(100)
    ledger.grant(50)
    ledger.insert(50, 1)
    entry = _entry(50, State.D2H)
    ledger.offloading(50, 1, charged_gpu=True)
    assert (ledger.releasing, ledger.cpu_entries) == (50, 1)
    assert ledger.leaked([entry], {entry: True}, 0, (0, 0)) == {"gpu": 0, "cpu": 0}
    ledger.offloaded(50, 1, released=50)
    assert (ledger.used, ledger.releasing, ledger.gpu_entries) == (0, 0, 0)


def test_a_release_after_fences_stays_owned_until_done() -> None:
    ledger = TierLedger(100)
    ledger.grant(30)
    ledger.insert(30, 1)
    ledger.gpu_left(1)
    ledger.release_later(30)
    assert ledger.leaked([], {}, 0, (0, 0)) == {"gpu": 0, "cpu": 0}
    ledger.released(30)
    assert (ledger.used, ledger.releasing, ledger.released_pending) == (0, 0, 0)


def test_the_audit_reports_bytes_nothing_owns() -> None:
    ledger = TierLedger(100)
    ledger.grant(40)
    ledger.insert(40, 1)  # an entry of 40 bytes that the index no longer reaches
    assert ledger.leaked([], {}, 0, (0, 0)) == {"gpu": 40, "cpu": 0}
    assert ledger.leaked([], {}, 16, (0, 0)) == {"gpu": 40, "cpu": 16}
    assert ledger.leaked([_entry(40)], {}, 0, (8, 4)) == {"gpu": 8, "cpu": 4}
