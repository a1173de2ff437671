"""PrefixAwareRouter bookkeeping over fake replicas: queue checkpoints (a rewind that one
replica refuses changes nothing, unless another replica's rewind has run: then the rest
is rewound), aborting several ids, and the count of a request whose samples
(SamplingParams.n > 1) end one by one."""

from __future__ import annotations

import dataclasses

import pytest

from jaxkv import SamplingParams
from jaxkv.request_serials import RequestSerials, rewind_together
from jaxkv.router import PrefixAwareRouter, Route
from tests.sharding._router_util import BLOCK, FakeReplica, OffloadingReplica, make_router


class SamplingReplica(FakeReplica):
    """Serves sample i of a request `rid` of n > 1 as "i_rid" with max_tokens - i tokens (so
    later samples finish first), reported as Engine does: under `rid`, index i, finished
    only on the output after which no sample runs."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.fail = False
        self.live: dict[str, set[int]] = {}  # parent -> indices of running samples

    def add_request(self, prompt_token_ids, sampling_params=None, *, request_id, cache_salt=None):
        if sampling_params is None or sampling_params.n == 1:
            return super().add_request(prompt_token_ids, sampling_params, request_id=request_id)
        for i in range(sampling_params.n):
            params = dataclasses.replace(
                sampling_params, n=1, max_tokens=max(1, sampling_params.max_tokens - i)
            )
            super().add_request(prompt_token_ids, params, request_id=f"{i}_{request_id}")
        self.live[request_id] = set(range(sampling_params.n))
        return request_id

    def step(self):
        if self.fail:
            raise RuntimeError("replica step failed")
        outputs = super().step()
        for j, o in enumerate(outputs):
            index, _, parent = o.request_id.partition("_")
            if parent in self.live:
                if o.finished:
                    self.live[parent].discard(int(index))
                finished = not self.live[parent]
                outputs[j] = o._replace(request_id=parent, index=int(index), finished=finished)
        return outputs

    def abort(self, request_id: str) -> bool:
        if request_id in self.live:
            samples = self.live.pop(request_id)
            return any([FakeReplica.abort(self, f"{i}_{request_id}") for i in sorted(samples)])
        return super().abort(request_id)


def sampling_router() -> tuple[PrefixAwareRouter, list[SamplingReplica]]:
    replicas = [SamplingReplica(i) for i in range(2)]
    return PrefixAwareRouter(replicas, block_size=BLOCK), replicas


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


def test_a_queue_checkpoint_rewound_twice_forgets_the_routes_added_since_each_time():
    """The first rewind made the snapshot the live table, so routes added after it stayed
    in the snapshot: a second rewind gave back the next id but kept those routes."""
    router, _ = make_router(2)
    rewind = router.queue_checkpoint()
    for tokens in ([1] * 2 * BLOCK, [2] * 2 * BLOCK):
        assert router.abort(router.add_request(tokens))
        assert router.route(tokens).matched_blocks == 2
        rewind()
        assert router.route(tokens).matched_blocks == 0
        assert router.add_request([3]) == "dp-0" and router.abort("dp-0")
        rewind()


class SerialReplica(FakeReplica):
    """Numbers the requests it queues, and checkpoints the numbers, as Engine does."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.serials = RequestSerials()

    def add_request(self, prompt_token_ids, sampling_params=None, *, request_id, cache_salt=None):
        super().add_request(
            prompt_token_ids, sampling_params, request_id=request_id, cache_salt=cache_salt
        )
        self.serials.take(self.serials.next)
        return request_id

    def queue_checkpoint(self):
        return self.serials.checkpoint(self.running)


class RefusingRewindReplica(FakeReplica):
    """Its rewind refuses, and has no check() to say so beforehand."""

    def queue_checkpoint(self):
        def rewind() -> None:
            raise RuntimeError("replica 1 still holds one")

        return rewind


def _queue_and_abort_on_replica_0(router: PrefixAwareRouter) -> None:
    rid = router.add_request([1] * 2 * BLOCK)
    assert rid == "dp-0" and router.replica_of(rid) == 0
    assert router.abort(rid)


def test_a_rewind_one_replica_refuses_changes_nothing_until_every_one_can_rewind():
    """Replica 1 holds a request added to it directly since the checkpoint, so its rewind
    refuses. The rewind used to rewind the router's ids and replica 0's before replica 1
    raised: half done, the next generated id "dp-0" again and replica 0's next serial 0."""
    replicas = [SerialReplica(i) for i in range(2)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    rewind = router.queue_checkpoint()
    _queue_and_abort_on_replica_0(router)
    replicas[1].add_request([2], request_id="direct")
    with pytest.raises(RuntimeError, match=r"\['direct'\] queued since the checkpoint"):
        rewind()
    assert [r.serials.next for r in replicas] == [1, 1]
    assert router.route([1] * 2 * BLOCK) == Route(0, 2)
    assert router.add_request([3]) == "dp-1"
    assert router.abort("dp-1") and replicas[1].abort("direct")
    rewind()
    assert [r.serials.next for r in replicas] == [0, 0]
    assert router.route([1] * 2 * BLOCK).matched_blocks == 0
    assert router.add_request([3]) == "dp-0"


def test_a_replica_rewind_without_a_check_is_called_before_anything_is_rewound():
    """One that refuses changes nothing: rewound in replica order, it used to raise after
    the router's ids and replica 0 had been rewound."""
    replicas = [SerialReplica(0), RefusingRewindReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    rewind = router.queue_checkpoint()
    _queue_and_abort_on_replica_0(router)
    with pytest.raises(RuntimeError, match="replica 1 still holds one"):
        rewind()
    assert replicas[0].serials.next == 1
    assert router.route([1] * 2 * BLOCK) == Route(0, 2)
    assert router.add_request([3]) == "dp-1"


def test_a_later_replica_rewind_without_a_check_that_refuses_leaves_the_rest_rewound():
    """Replica 0's rewind (no check()) has run when replica 1's refuses: it can no longer
    change nothing, so replica 2, the router's ids and its routes are rewound too before
    the refusal is raised. It used to stop there, half done: replica 0 rewound, replica 2,
    the next generated id and the routes not."""
    replicas = [CheckpointedReplica(0), RefusingRewindReplica(1), CheckpointedReplica(2)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    rewind = router.queue_checkpoint()
    _queue_and_abort_on_replica_0(router)
    with pytest.raises(RuntimeError, match="replica 1 still holds one"):
        rewind()
    assert [replicas[0].rewinds, replicas[2].rewinds] == [1, 1]
    assert router.route([1] * 2 * BLOCK).matched_blocks == 0
    assert router.add_request([3]) == "dp-0"


def test_rewind_together_raises_the_first_later_refusal_noting_the_others():
    done = []

    def ok():
        done.append("ok")

    def refuses(name):
        def rewind():
            raise RuntimeError(name)

        return rewind

    rewind = rewind_together([ok, refuses("a"), refuses("b"), ok], then=lambda: done.append(0))
    with pytest.raises(RuntimeError) as refused:
        rewind()
    assert str(refused.value) == "a" and done == ["ok", "ok", 0]
    assert refused.value.__notes__ == ["a later replica rewind also refused: RuntimeError('b')"]
    done.clear()
    with pytest.raises(RuntimeError, match="^b$"):  # the first refusing: nothing rewound
        rewind_together([refuses("b"), ok], then=lambda: done.append(0))()
    assert done == []


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


def test_a_sample_that_finishes_first_leaves_its_request_running_with_one_sequence_fewer():
    router, _ = sampling_router()
    rid = router.add_request([1] * BLOCK, SamplingParams(n=2, max_tokens=2))
    replica = router.replica_of(rid)
    outs = router.step()
    assert [(o.index, o.finish_reason, o.finished) for o in outs] == [
        (0, None, False),
        (1, "length", False),
    ]
    assert router.num_outstanding[replica] == 1 and router.replica_of(rid) == replica
    with pytest.raises(ValueError, match="already running"):
        router.add_request([2] * BLOCK, request_id=rid)
    assert [(o.index, o.finished) for o in router.step()] == [(0, True)]
    assert router.num_outstanding == (0, 0)


def test_aborting_a_request_drops_a_kept_sample_finish_and_releases_every_sample():
    router, replicas = sampling_router()
    rid = router.add_request([1] * BLOCK, SamplingParams(n=2, max_tokens=2))
    other = 1 - router.replica_of(rid)
    router.add_request([2] * BLOCK, request_id="y", cache_salt="s")
    assert router.replica_of("y") == other
    replicas[other].fail = True
    with pytest.raises(RuntimeError):
        router.step()  # kept: sample 0's token, and sample 1's finish
    # The replica still runs sample 0, so the abort succeeds; sample 1's kept finish must
    # not keep the request counted, nor reach the caller afterwards.
    assert router.abort(rid)
    assert router.num_outstanding[1 - other] == 0
    with pytest.raises(KeyError):
        router.replica_of(rid)
    replicas[other].fail = False
    assert [o.request_id for o in router.step()] == ["y"]


def test_a_step_steps_an_idle_replica_until_its_copies_land():
    # Its copies end only in its own steps: a step() skipping an idle replica would leave
    # them in flight for good.
    replicas = [OffloadingReplica(0, copy_steps=2), OffloadingReplica(1, copy_steps=2)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(max_tokens=1))
    assert [o.finished for o in router.step()] == [True]
    assert router.has_pending_transfers() and not router.has_unfinished_requests()
    assert router.step() == [] and router.has_pending_transfers()
    assert router.step() == [] and not router.has_pending_transfers()


def test_a_rewind_refuses_while_an_id_held_at_the_checkpoint_is_queued_again_on_its_replica():
    """An id aborted and queued again since the checkpoint is a request queued since, even
    on the replica it ran on before: the rewind refuses, its route kept (the router told
    them apart by replica index, so the same replica passed and the route was dropped)."""
    router, _ = make_router(2)
    router.add_request([7] * BLOCK, SamplingParams(max_tokens=3), request_id="a")
    rewind = router.queue_checkpoint()
    assert router.abort("a")
    router.add_request([7] * 2 * BLOCK, SamplingParams(max_tokens=3), request_id="a")
    assert router.replica_of("a") == 0  # where "a" ran at the checkpoint
    with pytest.raises(RuntimeError, match=r"\['a'\] queued since the checkpoint"):
        rewind()
    assert router.route([7] * 2 * BLOCK).matched_blocks == 2
    assert router.abort("a")
    rewind()
    assert router.route([7] * 2 * BLOCK).matched_blocks == 1  # routed before the checkpoint


class _LosesAStepsOutputs(SamplingReplica):
    """Its first step steps its samples, then raises: their outputs are lost."""

    def step(self):
        outputs = super().step()
        if not hasattr(self, "raised"):
            self.raised = True
            raise RuntimeError(f"device lost with {len(outputs)} outputs")
        return outputs


def test_the_finished_output_of_a_request_releases_samples_whose_finishes_were_lost():
    # Sample 1 finished in the step that raised; sample 0's finish then says the whole
    # request finished: the router must release it, lost sample included.
    router = PrefixAwareRouter([_LosesAStepsOutputs(0)], block_size=BLOCK)
    rid = router.add_request([1] * BLOCK, SamplingParams(n=2, max_tokens=2))
    with pytest.raises(RuntimeError, match="device lost"):
        router.step()
    assert router.num_outstanding == (2,)
    assert [(o.index, o.finished) for o in router.step()] == [(0, True)]
    assert router.num_outstanding == (0,) and not router.has_unfinished_requests()
    with pytest.raises(KeyError):
        router.replica_of(rid)
    assert router.add_request([2] * BLOCK, request_id=rid) == rid  # its id is free again


def test_an_aborted_request_whose_sample_finish_is_kept_is_held_until_it_is_delivered():
    """Sample 1's finish sits in a failed step's outputs and sample 0's was lost in a
    later one: abort releases sample 0 only, the request keeps its id (a new "x" would
    receive the old finish) until the next step delivers sample 1's finish."""
    replicas = [_LosesAStepsOutputs(0), SamplingReplica(1)]
    replicas[0].raised = True  # raises only when told to
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(n=2, max_tokens=2), request_id="x")
    router.add_request([2] * BLOCK, SamplingParams(max_tokens=9), request_id="y")
    replicas[1].fail = True
    with pytest.raises(RuntimeError):
        router.step()  # kept: sample 0's first token, sample 1's finish
    replicas[1].fail = False
    del replicas[0].raised
    with pytest.raises(RuntimeError, match="device lost"):
        router.step()  # sample 0 finished, its output lost
    assert router.abort("x") is False  # its replica runs no sample of it now
    assert router.replica_of("x") == 0 and router.num_outstanding == (1, 1)
    with pytest.raises(ValueError, match="already running"):
        router.add_request([3] * BLOCK, request_id="x")
    kept = [(o.request_id, o.index, o.finish_reason) for o in router.step()]
    assert ("x", 1, "length") in kept and router.num_outstanding == (0, 1)
    with pytest.raises(KeyError):
        router.replica_of("x")
