"""Started and landed loads as the Scheduler admits them: their queue place, their share
of the step's token budget, and what they leave computed and cached."""

from __future__ import annotations

from jaxkv import Request, RequestStatus, SamplingParams
from tests.host._sched_util import (
    FakeCopier,
    OracleLoadConnector,
    add,
    make_scheduler,
    run_until_idle,
    step,
)

BS = 4


def _queued(sched) -> list[str]:
    return [r.request_id for r in sched.waiting]


def _decoding(sched, n: int) -> list:
    """n requests with 1-token prompts, running (decoding) after one step."""
    reqs = [add(sched, f"d{i}", [100 + i], max_tokens=5) for i in range(n)]
    step(sched)
    return reqs


def test_a_started_load_keeps_its_queue_place_ahead_of_a_request_that_did_not_fit():
    sched = make_scheduler(
        max_num_batched_tokens=8, max_model_len=8, enable_chunked_prefill=False,
        connector=OracleLoadConnector(FakeCopier(64, BS), {"a": 4}),
    )  # fmt: skip
    _decoding(sched, 2)
    add(sched, "a", range(1, 7))  # loads 4 tokens
    add(sched, "b", range(10, 17))  # 7 tokens: the 6 left after 2 decodes do not fit
    out = sched.schedule()
    assert out.request_ids == ["d0", "d1"] and _queued(sched) == ["a", "b"]


def _two_loads_behind_decoders(num_decoders: int):
    """(scheduler, copier) after one step of `num_decoders` 1-token prompts, then l1 (7
    tokens: 3 left after its load) and l2 (5 tokens: 1 left), under a budget of 8 tokens
    with chunked prefill off: the decoders were admitted and both loads started."""
    copier = FakeCopier(64, BS)
    connector = OracleLoadConnector(copier, {"l1": 4, "l2": 4})
    sched = make_scheduler(
        max_num_batched_tokens=8, max_model_len=8, enable_chunked_prefill=False,
        connector=connector,
    )  # fmt: skip
    for i in range(num_decoders):
        add(sched, f"d{i}", [100 + i], max_tokens=5)
    add(sched, "l1", range(1, 8), max_tokens=1)
    add(sched, "l2", range(20, 25), max_tokens=1)
    step(sched, copier)
    return sched, copier


def test_a_landed_load_that_does_not_fit_whole_lets_a_later_landed_one_run():
    sched, copier = _two_loads_behind_decoders(6)
    out, _ = step(sched, copier)  # both land; 2 tokens left after the decodes
    assert out.request_ids == [*(f"d{i}" for i in range(6)), "l2"]
    assert out.num_computed_tokens.tolist()[-1] == 4
    assert set(run_until_idle(sched, copier)) == {*(f"d{i}" for i in range(6)), "l1"}


def test_a_landed_load_enters_its_loaded_and_computed_blocks_into_the_prefix_cache():
    copier = FakeCopier(64, BS)
    sched = make_scheduler(connector=OracleLoadConnector(copier, {"r": 8}))
    r = add(sched, "r", range(1, 14), max_tokens=3)  # 13 tokens: 3 full blocks
    step(sched, copier)  # the load starts
    out, _ = step(sched, copier)  # it lands; r computes tokens 8..12
    assert out.request_ids == ["r"] and out.num_computed_tokens.tolist() == [8]
    probe = Request("probe", list(r.all_token_ids[:13]), SamplingParams())
    assert sched.manager.get_computed_blocks(probe)[1] == 12


def test_a_load_after_a_device_cache_hit_lands_with_both_computed():
    copier = FakeCopier(64, BS)
    connector = OracleLoadConnector(copier, {})
    sched = make_scheduler(connector=connector)
    add(sched, "p", range(1, 6), max_tokens=1)  # caches the block of tokens 1..4
    run_until_idle(sched, copier)
    connector.claims["r"] = 4
    r = add(sched, "r", range(1, 11), max_tokens=2)  # hits 4 tokens, loads the next 4
    step(sched, copier)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KV and r.num_computed_tokens == 4
    out, _ = step(sched, copier)
    assert out.request_ids == ["r"] and out.num_computed_tokens.tolist() == [8]
    assert out.num_scheduled_tokens.tolist() == [2]


def _landed_behind_a_running_slot(block_size: int):
    """(scheduler, copier, r): r (13 tokens, 8 of them loaded) whose load landed while d
    (one token, 6 to generate) took the one running slot; r waits for it, holding its
    blocks."""
    copier = FakeCopier(64, block_size)
    connector = OracleLoadConnector(copier, {"r": 8})
    sched = make_scheduler(block_size=block_size, max_num_seqs=1, connector=connector)
    r = add(sched, "r", range(1, 14), max_tokens=2)
    connector.hold = True
    step(sched, copier)  # r's load starts
    add(sched, "d", [100], max_tokens=6)
    step(sched, copier)  # d runs and fills the one running slot
    connector.hold = False
    step(sched, copier)  # r's load lands
    return sched, copier, r


def test_an_aborted_landed_load_is_never_admitted():
    sched, copier, r = _landed_behind_a_running_slot(BS)
    assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 8
    assert sched.abort("r") and "r" not in sched.manager.request_ids
    add(sched, "e", [7, 8], max_tokens=2)  # queued behind d's slot, as r was
    assert run_until_idle(sched, copier) == {"d": "length", "e": "length"}
    assert r.status == RequestStatus.FINISHED_ABORTED and r.num_output_tokens == 0
    assert sched.manager.num_free_blocks == sched.manager.pool.num_blocks - 1


def test_a_landed_load_waits_while_running_requests_use_the_whole_budget():
    copier = FakeCopier(64, BS)
    sched = make_scheduler(
        max_num_batched_tokens=4, max_num_seqs=4, connector=OracleLoadConnector(copier, {"l": 4})
    )
    add(sched, "l", range(1, 8), max_tokens=1)
    add(sched, "p", range(50, 66), max_tokens=1)  # 16 tokens: four chunks of the budget
    step(sched, copier)  # the load starts; "p" takes the 4 tokens
    out, _ = step(sched, copier)  # it lands, but "p" runs first and takes them all again
    assert out.request_ids == ["p"] and _queued(sched) == ["l"]


def test_a_landed_load_spends_the_budget_before_the_queue_is_admitted():
    copier = FakeCopier(64, BS)
    connector = OracleLoadConnector(copier, {"l": 4})
    sched = make_scheduler(max_num_batched_tokens=8, connector=connector)
    add(sched, "l", range(1, 8), max_tokens=1)  # 7 tokens: 3 left after its load
    step(sched, copier)  # the load starts
    add(sched, "b", range(20, 28), max_tokens=1)
    out, _ = step(sched, copier)  # it lands: b gets the 5 tokens l leaves
    assert out.request_ids == ["l", "b"] and out.num_scheduled_tokens.tolist() == [3, 5]


def test_a_landed_load_runs_on_the_last_token_of_budget_ahead_of_the_queue():
    # 7 decodes leave 1 token of the 8: l2's last token takes it, though l1 (3 tokens
    # left, chunked prefill off) heads the queue and would stop the queue's admission.
    sched, copier = _two_loads_behind_decoders(7)
    decoders = [f"d{i}" for i in range(7)]
    out, _ = step(sched, copier)
    assert out.request_ids == [*decoders, "l2"] and _queued(sched) == ["l1"]
    assert set(run_until_idle(sched, copier)) == {*decoders, "l1"}


def test_a_landed_load_waiting_for_a_slot_caches_only_its_loaded_blocks():
    # Blocks of one token: the block right after the loaded ones is full with its one
    # token, whose KV is not computed until r is admitted; no other request may hit it.
    sched, copier, r = _landed_behind_a_running_slot(1)
    assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 8
    probe = Request("probe", list(range(1, 14)) + [99], SamplingParams())
    assert sched.manager.get_computed_blocks(probe)[1] == 8
    assert run_until_idle(sched, copier) == {"d": "length", "r": "length"}
