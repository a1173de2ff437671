"""PrefixAwareRouter bookkeeping over fake replicas: queue checkpoints, aborting several
ids, and the count of a request whose samples (SamplingParams.n > 1) end one by one."""

from __future__ import annotations

from jaxkv import SamplingParams
from jaxkv.router import PrefixAwareRouter
from tests.sharding.test_router import BLOCK, FakeReplica, make_router


class CheckpointedReplica(FakeReplica):
    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.rewinds = 0

    def queue_checkpoint(self):
        def rewind() -> None:
            self.rewinds += 1

        return rewind


def test_rewinding_a_queue_checkpoint_forgets_the_routes_added_since_and_rewinds_each_replica():
    replicas = [CheckpointedReplica(i) for i in range(2)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    before = router.add_request([7] * BLOCK)
    rewind = router.queue_checkpoint()
    router.abort(router.add_request([1] * 2 * BLOCK, SamplingParams(max_tokens=4)))
    assert router.route([1] * 2 * BLOCK).matched_blocks == 2
    rewind()
    assert router.route([1] * 2 * BLOCK).matched_blocks == 0
    assert router.route([7] * BLOCK).matched_blocks == 1  # routed before the checkpoint
    assert [r.rewinds for r in replicas] == [1, 1]
    assert router.replica_of(before) in (0, 1)


def test_aborting_several_ids_aborts_every_one_after_the_first_that_was_aborted():
    router, replicas = make_router(2)
    ids = [router.add_request([i] * BLOCK, SamplingParams(max_tokens=5)) for i in range(4)]
    assert router.abort(ids)
    assert router.num_outstanding == (0, 0)
    assert not any(r.running for r in replicas)


def test_a_request_of_one_sample_leaves_the_ids_its_samples_would_have_free():
    router, _ = make_router(2)
    router.add_request([1] * BLOCK, SamplingParams(n=1, max_tokens=3), request_id="x")
    assert router.add_request([2] * BLOCK, request_id="0_x") == "0_x"
    assert sorted(router.num_outstanding) == [1, 1]
