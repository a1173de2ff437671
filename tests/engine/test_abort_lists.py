"""Engine.abort and PrefixAwareRouter.abort take one id or an iterable of ids (as vLLM's
abort_request does), and refuse a list holding a non-str whole, aborting none of it."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from tests.engine._util import assert_all_blocks_free, make_engine
from tests.sharding._router_util import make_router


def test_engine_aborts_each_listed_request_and_refuses_a_bad_list_whole():
    engine = make_engine()
    params = SamplingParams(max_tokens=6)
    a, b, c = (engine.add_request([3 + i, 4, 5, 6], params) for i in range(3))
    pair = engine.add_request([9, 9, 9], SamplingParams(max_tokens=6, n=2))
    engine.step()
    for bad, message in (
        (5, "request_ids=5 must be a request id"),
        (b"ab", "request_ids=b'ab' must be a request id"),
        ([a, 7], r"request_ids holds 7 \(int\): each must be a request id"),
    ):
        with pytest.raises(ValueError, match=message):
            engine.abort(bad)
    assert all(rid in engine.ids_in_use for rid in (a, b, c, pair))  # none was aborted
    assert engine.abort([a, "unknown", f"1_{pair}"])
    assert not engine.abort([a, "unknown"]) and not engine.abort([])
    assert engine.abort(rid for rid in (b, pair))  # an iterator: the other sample too
    left = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            left.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert list(left) == [c] and len(left[c]) == 5  # one token came before the aborts
    assert not engine.abort((c,))  # finished
    assert_all_blocks_free(engine)


def test_router_aborts_each_listed_request_on_its_replica():
    router, replicas = make_router(2)
    ids = [router.add_request([i, i + 1, i + 2], request_id=f"r{i}") for i in range(3)]
    before = router.num_outstanding
    with pytest.raises(ValueError, match="holds None .* none was aborted"):
        router.abort([ids[0], None])
    assert router.num_outstanding == before
    assert router.abort([ids[0], ids[1], "unknown"])
    assert sum(router.num_outstanding) == 1 and not router.abort(ids[:2])
    assert router.abort(iter(ids[2:])) and router.num_outstanding == (0, 0)
