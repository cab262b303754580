from tokenspeed.sched.config import AdmissionPolicy
from tokenspeed.sched.pd import TransferGate


def test_independent_prefill_first_waits_pinned_for_decode():
    gate = TransferGate(AdmissionPolicy.INDEPENDENT)
    assert gate.on_route("r") is True  # prefill queued at once
    assert gate.on_prefill_done("r") is False  # decode not ready: result stays pinned
    assert gate.waiting_for_decode() == 1
    assert gate.on_decode_admitted("r") == (False, True)  # transfer starts now
    assert gate.waiting_for_decode() == 0


def test_independent_decode_first_transfers_when_prefill_ends():
    gate = TransferGate()
    assert gate.on_route("r")
    assert gate.on_decode_admitted("r") == (False, False)
    assert gate.on_prefill_done("r") is True


def test_coupled_prefill_starts_only_after_decode_admission():
    gate = TransferGate(AdmissionPolicy.COUPLED)
    assert gate.on_route("r") is False
    assert gate.on_decode_admitted("r") == (True, False)  # now queue the prefill
    assert gate.on_prefill_done("r") is True
    assert gate.waiting_for_decode() == 0


def test_forget_drops_half_joined_requests():
    gate = TransferGate()
    gate.on_prefill_done("a")
    gate.forget("a")
    assert gate.waiting_for_decode() == 0
    assert gate.on_decode_admitted("a") == (False, False)
