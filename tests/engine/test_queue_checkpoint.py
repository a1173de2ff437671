"""A generate call that refuses a prompt part-way gives back the default ids and seeds
(and, on a router, the prefix routes) its queued prompts took."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from jaxkv.request_serials import RequestSerials
from jaxkv.router import PrefixAwareRouter
from tests.engine._util import BLOCK_SIZE, make_engine
from tests.sharding._router_util import make_router

SAMPLED = SamplingParams(temperature=1.0, max_tokens=6)  # unseeded: the serial's seed
PROMPT = [5, 6, 7, 8, 9]
REFUSED_THIRD = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], []]  # the empty one is refused


def _tokens(driver) -> tuple[str, tuple[int, ...]]:
    out = driver.generate([PROMPT], SAMPLED, progress=False)[0]
    return out.request_id, out.output_token_ids


def test_an_engine_generate_refused_at_its_third_prompt_leaves_ids_and_seeds_as_they_were():
    fresh = _tokens(make_engine())
    engine = make_engine()
    with pytest.raises(ValueError, match="non-empty"):
        engine.generate(REFUSED_THIRD, SAMPLED, progress=False)
    assert _tokens(engine) == fresh
    assert fresh[0] == "0"
    # The check can tell: two serials taken and not given back change the id and tokens.
    shifted = make_engine()
    for _ in range(2):
        assert shifted.abort(shifted.add_request([1, 2]))
    rid, tokens = _tokens(shifted)
    assert rid == "2" and tokens != fresh[1]
    assert not engine.has_unfinished_requests()
    engine.manager.check_integrity()


def test_a_router_generate_refused_part_way_rewinds_its_ids_routes_and_engine_replicas():
    def router() -> PrefixAwareRouter:
        return PrefixAwareRouter([make_engine(), make_engine()], block_size=BLOCK_SIZE)

    fresh = router()
    want = _tokens(fresh)
    r = router()
    with pytest.raises(ValueError, match="non-empty"):
        r.generate(REFUSED_THIRD, SAMPLED, progress=False)
    assert r.num_outstanding == (0, 0)
    assert r.route(REFUSED_THIRD[0]).matched_blocks == 0  # its route was given back
    assert _tokens(r) == want == ("dp-0", want[1])
    # Replica 0 took the refused call's two prompts: its serials were given back too.
    assert [e.add_request([3]) for e in r.replicas] == ["1", "0"]
    assert [e.add_request([3]) for e in fresh.replicas] == ["1", "0"]


def test_a_router_over_replicas_without_checkpoints_still_rewinds_its_own_state():
    router, replicas = make_router(2)
    with pytest.raises(ValueError, match="empty prompt"):
        router.generate([[1] * 8, [2] * 8, []], progress=False)
    assert router.route([1] * 8).matched_blocks == 0
    assert router.add_request([3]) == "dp-0"
    assert sorted(r for rep in replicas for r in rep.running) == ["dp-0"]


def test_rewinding_while_a_request_queued_since_is_held_is_refused_and_changes_nothing():
    engine = make_engine()
    rewind = engine.queue_checkpoint()
    first = engine.add_request([1, 2])
    with pytest.raises(RuntimeError, match=r"\['0'\] queued since the checkpoint"):
        rewind()
    assert engine.add_request([3, 4]) == "1"
    assert engine.abort(first) and engine.abort("1")
    rewind()
    assert engine.add_request([3, 4]) == "0"

    router, _ = make_router(2)
    rewind = router.queue_checkpoint()
    rid = router.add_request([1] * 8)
    with pytest.raises(RuntimeError, match="queued since the checkpoint"):
        rewind()
    assert router.route([1] * 8).matched_blocks == 2  # its route stays
    assert router.abort(rid)
    rewind()
    assert router.route([1] * 8).matched_blocks == 0 and router.add_request([1]) == "dp-0"


def test_a_router_rewind_an_engine_replica_refuses_leaves_ids_seeds_and_routes_as_they_were():
    # Replica 1 holds a request added to it directly since the checkpoint. The rewind used
    # to rewind the router's ids and replica 0's ids and seeds before replica 1 refused.
    r = PrefixAwareRouter([make_engine(), make_engine()], block_size=BLOCK_SIZE)
    rewind = r.queue_checkpoint()
    queued = r.add_request(PROMPT)
    assert r.replica_of(queued) == 0 and r.abort(queued)
    r.replicas[1].add_request([3], request_id="direct")
    with pytest.raises(RuntimeError, match=r"\['direct'\] queued since the checkpoint"):
        rewind()
    assert r.route(PROMPT).matched_blocks == 1
    assert r.replicas[0].add_request([3]) == "1"  # serial 1: the id and seed after PROMPT's
    assert r.add_request([4]) == "dp-1"
    assert r.replicas[0].abort("1") and r.abort("dp-1") and r.replicas[1].abort("direct")
    rewind()
    assert r.route(PROMPT).matched_blocks == 0
    assert [e.add_request([3]) for e in r.replicas] == ["0", "0"]
    assert r.add_request([4]) == "dp-0"


def test_request_serials_skip_taken_ids_and_take_a_serial_only_when_told():
    serials = RequestSerials("x-")
    assert serials.peek(None, {"x-0", "x-1"}) == (2, "x-2")
    assert serials.peek(None, {"x-0", "x-2"}) == (1, "x-1")  # the first free one, not skipped
    assert serials.peek("mine", {"x-0"}) == (0, "mine") and serials.next == 0
    serials.take(2)
    live = {"a": object()}
    rewind = serials.checkpoint(live)
    serials.take(5)
    live["b"] = object()
    for refused in (rewind.check, rewind):
        with pytest.raises(RuntimeError, match=r"\['b'\]"):
            refused()
    assert serials.next == 6
    del live["b"]
    live["a"] = object()  # "a" released and queued again since: a new request
    with pytest.raises(RuntimeError, match=r"\['a'\]"):
        rewind()
    live.pop("a")
    rewind.check()
    assert serials.next == 6  # checked, not rewound
    rewind()
    assert serials.next == 3


def test_an_engine_rewind_refuses_while_an_id_held_at_the_checkpoint_is_queued_again():
    # "a" aborted and queued again under its id took serial 1; the rewind used to pass,
    # and the next unseeded request took serial 1 again: the same draws as the new "a".
    engine = make_engine()
    engine.add_request([7, 7, 7], SamplingParams(max_tokens=2), request_id="a")
    rewind = engine.queue_checkpoint()
    assert engine.abort("a")
    engine.add_request(PROMPT, SAMPLED, request_id="a")
    with pytest.raises(RuntimeError, match=r"\['a'\] queued since the checkpoint"):
        rewind()
    assert engine.add_request(PROMPT, SAMPLED) == "2"  # serial 1 stays the new a's


def test_a_refused_prompt_is_named_by_its_index_in_prompts():
    # add_request's message names the prompt's own fields ("prompt_token_ids must lie in
    # [0, 259)"), not which of generate's prompts it was: in a list of many, unfindable.
    engine = make_engine()
    router, _ = make_router(2)
    for driver in (engine, router):
        with pytest.raises(ValueError, match="prompt_token_ids must lie in") as raised:
            driver.generate([[1, 2], [3], [4, -5], [6]], progress=False)
        assert raised.value.__notes__ == ["raised queueing prompts[2] of 4; none runs"]
    assert engine.add_request([1, 2]) == "0" and router.num_outstanding == (0, 0)
