"""PrefixAwareRouter's generated request ids: callers' ids are skipped, a refused request
takes none, and none is given twice."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from tests.sharding._router_util import make_router


def test_generated_ids_skip_ids_callers_chose():
    router, _ = make_router(2)
    ids = [router.add_request([1, 2], request_id="dp-1"), router.add_request([3, 4])]
    ids.append(router.add_request([5, 6]))
    assert ids[0] == "dp-1" and len(set(ids)) == 3 and sum(router.num_outstanding) == 3
    # Two taken ids in a row are both skipped.
    router.add_request([7], request_id="dp-3")
    router.add_request([8], request_id="dp-4")
    assert router.add_request([9]) == "dp-5" and sum(router.num_outstanding) == 6


def test_a_refused_request_takes_no_generated_id():
    # As with Engine.add_request, the ids of later requests are those a run without the
    # refused one gives them.
    router, _ = make_router(2)
    ids = [router.add_request([1, 2])]
    with pytest.raises(ValueError, match="empty prompt"):  # refused by the replica
        router.add_request([])
    ids += [router.add_request([3, 4]), router.add_request([5, 6])]
    assert ids == ["dp-0", "dp-1", "dp-2"]


def test_a_generated_id_is_never_given_again_after_its_request_ends():
    router, _ = make_router(2)
    first = router.add_request([1, 2])
    assert router.abort(first)
    second = router.add_request([1, 2], SamplingParams(max_tokens=1))
    while router.has_unfinished_requests():
        router.step()
    assert (first, second, router.add_request([3])) == ("dp-0", "dp-1", "dp-2")


def test_generated_ids_skip_ids_a_replica_holds_for_a_kv_copy_in_flight():
    # A caller's "dp-0" finished, but its replica held the id until its KV save landed,
    # and router.step() never stepped that idle replica to land it: every generated id
    # was "dp-0", refused by the replica, until drain_transfers.
    from jaxkv import HostOffloadConnector, PrefixAwareRouter
    from tests.engine._util import make_engine

    connectors = [HostOffloadConnector(1 << 24, copy_delay_steps=3) for _ in range(2)]
    engines = [make_engine(connector=c) for c in connectors]
    router = PrefixAwareRouter(engines, block_size=engines[0].config.cache.block_size)
    prompt, params = list(range(1, 14)), SamplingParams(max_tokens=2, ignore_eos=True)
    router.add_request(prompt, params, request_id="dp-0")
    while router.has_unfinished_requests():
        router.step()
    holder = engines[router.route(prompt).replica]
    assert holder.has_pending_transfers() and "dp-0" in holder.ids_in_use
    with pytest.raises(ValueError, match="one a replica holds"):
        router.add_request(prompt, params, request_id="dp-0")
    assert router.add_request(prompt, params) == "dp-1"  # not "dp-0"
    while router.has_unfinished_requests() or router.has_pending_transfers():
        router.step()  # steps the idle replica too, until its copies land
    assert "dp-0" not in holder.ids_in_use
    assert router.add_request(prompt, params, request_id="dp-0") == "dp-0"
    router.close()


def test_an_id_holding_a_lone_surrogate_is_refused_before_any_replica_sees_it():
    """As cache_salt is: ids go into logs, JSON outputs and the router's own maps."""
    router, replicas = make_router(2)
    with pytest.raises(ValueError, match=r"^request_id='a\\ud800' must be None or a non-empty"):
        router.add_request([1, 2], request_id="a\ud800")
    assert not any(r.prompts for r in replicas) and sum(router.num_outstanding) == 0
    held = router.add_request([1, 2], request_id="日本")
    with pytest.raises(ValueError, match=r"request_ids='\\ud800' must be a request id"):
        router.abort("\ud800")
    assert router.add_request([3]) == "dp-0" and router.abort([held, "dp-0"])
    assert not router.has_unfinished_requests()


class _OwnHash(str):
    def __hash__(self) -> int:
        return 12345  # equal to its text, hashed apart from it


def test_an_id_given_as_a_str_subclass_is_the_str_it_holds():
    # A second request "a" was routed while _OwnHash("a") ran, and abort("a") missed it.
    router, replicas = make_router(2)
    rid = router.add_request([1, 2], request_id=_OwnHash("a"))
    assert type(rid) is str and rid == "a"
    assert {type(r) for replica in replicas for r in replica.prompts} == {str}
    with pytest.raises(ValueError, match="'a' is already running"):
        router.add_request([3, 4], request_id="a")
    assert router.replica_of(_OwnHash("a")) == router.replica_of("a")
    assert router.abort(_OwnHash("a")) and not router.has_unfinished_requests()
