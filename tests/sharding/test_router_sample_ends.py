"""PrefixAwareRouter and the end of one sample of a request of SamplingParams.n > 1, by
its finish or by an abort of its own id: that sample's sequence is over for the router,
while its request runs on with the others. Over fake replicas, without engines or jax."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from jaxkv.outputs import RequestOutput
from jaxkv.router import PrefixAwareRouter
from tests.sharding._router_util import BLOCK
from tests.sharding.test_router_bookkeeping import SamplingReplica, sampling_router


def test_aborting_one_sample_drops_the_outputs_a_failed_step_kept_of_it():
    """A failed step kept a token of each of x's samples: aborting sample 1 by its own id
    drops its kept token, so no output of it reaches the caller after the abort, while
    sample 0's kept token is still delivered."""
    router, replicas = sampling_router()
    router.add_request([1] * BLOCK, SamplingParams(n=2, max_tokens=4), request_id="x")
    router.add_request([2] * BLOCK, request_id="y")
    assert (router.replica_of("x"), router.replica_of("y")) == (0, 1)
    replicas[1].fail = True
    with pytest.raises(RuntimeError, match="replica step failed"):
        router.step()  # kept: replica 0's outputs, a token of each of x's samples
    assert router.abort("1_x") and router.num_outstanding == (1, 1)
    replicas[1].fail = False
    outputs = [(o.index, o.finish_reason) for o in router.step() if o.request_id == "x"]
    assert outputs == [(0, None), (0, None)]  # the kept token, then this step's


class _ReportsAnEndedSample(SamplingReplica):
    """Reports one more token of sample 2 of "x" in the step after it finished."""

    ended = False

    def step(self):
        outputs = super().step()
        if self.ended:
            outputs.append(RequestOutput("x", (7,), False, None, index=2))
        self.ended = any((o.request_id, o.index) == ("x", 2) and o.finish_reason for o in outputs)
        return outputs


def test_a_finished_sample_reported_again_is_refused_as_a_sequence_that_ended():
    """Sample 2 finishes first; a later output of it is of a sequence the replica no
    longer runs for the router: refused by name, not delivered as a token of a finished
    sample. The other samples' outputs of that step are delivered by the next step()."""
    router = PrefixAwareRouter([_ReportsAnEndedSample(0)], block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(n=3, max_tokens=4), request_id="x")
    assert [o.finish_reason for o in router.step()] == [None, None, None]
    assert [(o.index, o.finish_reason) for o in router.step()][2] == (2, "length")
    assert router.num_outstanding == (2,)
    with pytest.raises(ValueError, match=r"request 'x' \(index 2.*a sequence it does not run"):
        router.step()
    outputs = [(o.index, o.finish_reason, o.finished) for o in router.step()]
    assert outputs == [(0, None, False), (1, "length", False), (0, "length", True)]
    assert router.num_outstanding == (0,)
