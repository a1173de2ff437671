"""PrefixAwareRouter bookkeeping beyond the plain "length" finish: a request that stops on a
stop token releases its replica's load, and a route that leaves its prefix's replica
claims no matched blocks there; max_imbalance set after construction is checked as the
constructor checks it."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.router import PrefixAwareRouter, Route
from tests.sharding._router_util import BLOCK, FakeReplica, make_router


class StoppingReplica(FakeReplica):
    """Finishes each request as an engine does on a stop token: finish_reason "stop"."""

    def step(self):
        return [o._replace(finish_reason="stop") if o.finished else o for o in super().step()]


def test_a_request_that_stops_on_a_stop_token_releases_its_replica():
    replicas = [StoppingReplica(0), StoppingReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    prompts = [[1] * BLOCK, [2] * BLOCK, [3] * BLOCK]
    outs = router.generate(prompts, SamplingParams(max_tokens=2), progress=False)
    assert [o.finish_reason for o in outs] == ["stop"] * 3  # passed through, not "length"
    assert [len(o.output_token_ids) for o in outs] == [2, 2, 2]
    # A stopped request no longer counts as load: a loner goes to replica 0 again.
    assert router.num_outstanding == (0, 0) and not router.has_unfinished_requests()
    assert router.route([4] * BLOCK) == Route(0, 0)


def test_a_route_that_spills_over_matches_no_blocks_on_the_idle_replica():
    router, _ = make_router(2, max_imbalance=1)
    prompt = list(range(2 * BLOCK))
    router.add_request(prompt)
    assert router.route(prompt) == Route(0, 2)  # one beyond the idle replica: stays
    router.add_request(prompt)
    assert router.num_outstanding == (2, 0)
    # Two beyond: the request would leave for replica 1, where no block of it was routed.
    assert router.route(prompt) == Route(1, 0)


@pytest.mark.parametrize("value", [-1, True, 2.5, "4", [1]])
def test_setting_max_imbalance_refuses_what_the_constructor_refuses(value):
    # It is set after construction to tune the balance; an unchecked "4" raised TypeError
    # from the next add_request, and -1 sent every request to the least loaded replica.
    router, _ = make_router(2, max_imbalance=3)
    with pytest.raises(ValueError, match="max_imbalance"):
        router.max_imbalance = value
    assert router.max_imbalance == 3
    router.max_imbalance = np.int64(0)
    assert router.max_imbalance == 0 and type(router.max_imbalance) is int
    router.max_imbalance = None
    prefix = [7] * BLOCK
    a = router.add_request(prefix + [1], SamplingParams(max_tokens=5))
    b = router.add_request(prefix + [2], SamplingParams(max_tokens=5))
    assert router.replica_of(a) == router.replica_of(b)  # None: strict affinity
