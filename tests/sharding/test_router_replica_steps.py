"""PrefixAwareRouter over a replica whose step() answers what the router cannot deliver: an
output of a request the router sent another replica, one reported twice or after its
request finished, a finish without its reason, a `finished` that is no bool or a
finish_reason that is no str (an array), no list of RequestOutput. Each raises
ValueError naming the replica, step() and the output; the outputs that pass, and those
of the replicas stepped before it, reach the caller once, on the next step(). Outputs
of requests the router does not hold (added to the replica directly, or released) are
dropped."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.outputs import RequestOutput
from jaxkv.router import PrefixAwareRouter
from tests.sharding._router_util import BLOCK, FakeReplica, OffloadingReplica
from tests.sharding.test_router_bookkeeping import SamplingReplica


class Misstepping(FakeReplica):
    """Its next step's outputs go through `bad` (then it steps as FakeReplica does)."""

    def __init__(self, index: int, bad) -> None:
        super().__init__(index)
        self.bad = bad

    def step(self):
        outputs = super().step()
        bad, self.bad = self.bad, None
        return outputs if bad is None else bad(outputs)


def _router(bad, *, tokens: int = 3) -> PrefixAwareRouter:
    """Replica 0 runs "a" (1 token), replica 1 (Misstepping) runs "b" (`tokens` tokens)."""
    router = PrefixAwareRouter([FakeReplica(0), Misstepping(1, bad)], block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(max_tokens=1), request_id="a")
    router.add_request([2] * BLOCK, SamplingParams(max_tokens=tokens), request_id="b")
    assert (router.replica_of("a"), router.replica_of("b")) == (0, 1)
    return router


def _delivered(router: PrefixAwareRouter) -> list[tuple[str, bool]]:
    """(request id, finished) of every output until the router has no work left."""
    seen = []
    while router.has_unfinished_requests():
        seen += [(o.request_id, o.finished) for o in router.step()]
    assert router.num_outstanding == (0, 0)
    return seen


def _output(request_id: str, *, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, (7,), finished, "length" if finished else None)


@pytest.mark.parametrize(
    "stray",
    [_output("a", finished=True), _output("b")._replace(index=1)],
    ids=["another-replicas", "no-such-sample"],
)
def test_an_output_of_a_sequence_the_replica_does_not_run_is_refused(stray):
    # "a" runs on replica 0: replica 1's finish of it used to release "a" there (its id
    # free for a new "a" whose outputs replica 0's old "a" would fill) and reach the caller.
    router = _router(lambda outputs: [*outputs, stray])
    with pytest.raises(
        ValueError, match=rf"replicas\[1\] \(Misstepping\)\.step\(\) .*'{stray[0]}'"
    ):
        router.step()
    assert router.num_outstanding == (1, 1) and router.replica_of("a") == 0
    with pytest.raises(ValueError, match="already running"):
        router.add_request([3] * BLOCK, request_id="a")
    assert _delivered(router) == [("a", True), ("b", False), ("b", False), ("b", True)]


def test_outputs_of_a_request_added_to_a_replica_directly_are_dropped():
    """The router never routed "direct": its outputs used to make every router step()
    raise until it finished, holding back the outputs of the router's own requests
    (generate aborted its prompts). They are dropped; the router's requests go on."""
    router = _router(None)
    router.replicas[1].add_request([5] * BLOCK, SamplingParams(max_tokens=2), request_id="zz")
    assert _delivered(router) == [("a", True), ("b", False), ("b", False), ("b", True)]
    assert router.replicas[1].running == {}  # stepped to its end all the same
    with pytest.raises(KeyError):
        router.replica_of("zz")


@pytest.mark.parametrize("finished", [False, True])
def test_a_stray_output_of_a_request_the_router_never_held_is_dropped(finished):
    router = _router(lambda outputs: [*outputs, _output("zz", finished=finished)])
    assert [(o.request_id, o.finished) for o in router.step()] == [("a", True), ("b", False)]
    assert _delivered(router) == [("b", False), ("b", True)]


def test_an_output_under_a_request_id_that_is_no_str_is_refused():
    # The checks key sample 1 of "x" as ("x", 1): an output under that id (index 0) in a
    # step without one of sample 1 passed for that sample's and reached the caller.
    class TupleId(SamplingReplica):
        def step(self):
            outputs = [o for o in super().step() if o.index == 0]
            stray, self.stray = self.stray, []
            return outputs + stray

    replica = TupleId(0)
    replica.stray = [RequestOutput(("x", 1), (7,), False, None)]
    router = PrefixAwareRouter([replica], block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(n=2, max_tokens=3), request_id="x")
    with pytest.raises(ValueError, match=r"request_id \('x', 1\), not a str"):
        router.step()
    assert [(o.request_id, o.index) for o in router.step()] == [("x", 0), ("x", 0)]
    assert router.num_outstanding == (2,)


def test_a_step_with_several_bad_outputs_is_refused_naming_the_first():
    strays = [_output("a", finished=True), _output("b")._replace(index=1)]
    router = _router(lambda outputs: [*outputs, *strays])
    with pytest.raises(ValueError, match=r"request 'a' \(index 0.*\(2 of its 3 outputs dropped"):
        router.step()
    assert _delivered(router) == [("a", True), ("b", False), ("b", False), ("b", True)]


def test_an_output_finished_by_a_numpy_bool_is_delivered():
    router = _router(lambda outputs: [o._replace(finished=np.bool_(o.finished)) for o in outputs])
    assert [(o.request_id, bool(o.finished)) for o in router.step()] == [("a", True), ("b", False)]
    assert _delivered(router) == [("b", False), ("b", True)]


def test_a_finish_reported_twice_in_one_step_reaches_the_caller_once():
    # The second finish used to reach generate, which counted the request done twice and
    # returned with another prompt still running ("abort", its id held for good).
    router = _router(lambda outputs: outputs + outputs, tokens=1)
    with pytest.raises(ValueError, match=r"request 'b' .* after the output that finished"):
        router.step()
    assert _delivered(router) == [("a", True), ("b", True)]


class _ReportsAgain(FakeReplica):
    """Reports the first request it finishes once more, in the next step."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.finished: list[RequestOutput] | None = []

    def step(self):
        outputs = super().step()
        again = self.finished or []
        if self.finished is not None:
            self.finished = [o for o in outputs if o.finished][:1] or None
        return outputs + again


def test_an_output_after_its_request_was_released_is_dropped():
    # "a" is released once its finish is delivered: reported again, it reaches no caller
    # (generate counted such a finish twice), as an output of a request never routed.
    router = PrefixAwareRouter([_ReportsAgain(0)], block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(max_tokens=1), request_id="a")
    router.add_request([2] * BLOCK, SamplingParams(max_tokens=3), request_id="b")
    assert [(o.request_id, o.finished) for o in router.step()] == [("a", True), ("b", False)]
    assert [(o.request_id, o.finished) for o in router.step()] == [("b", False)]
    assert [(o.request_id, o.finished) for o in router.step()] == [("b", True)]


def test_an_output_kept_by_a_failed_step_is_not_taken_again_from_its_replica():
    # "a" finished on replica 0 in a step() that replica 1 failed; replica 0 then reports
    # it again: refused, though the kept finish has not reached the caller yet.
    replicas = [_ReportsAgain(0), Misstepping(1, None)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(max_tokens=1), request_id="a")
    router.add_request([2] * BLOCK, SamplingParams(max_tokens=3), request_id="b")
    router.add_request([3] * BLOCK, SamplingParams(max_tokens=3), request_id="c")
    assert [router.replica_of(rid) for rid in "abc"] == [0, 1, 0]

    def lost(outputs):
        raise RuntimeError("device lost")

    replicas[1].bad = lost
    with pytest.raises(RuntimeError, match="device lost"):
        router.step()
    with pytest.raises(ValueError, match=r"replicas\[0\].* request 'a' .* does not run"):
        router.step()
    assert _delivered(router) == [
        ("a", True),
        ("c", False),
        ("c", False),
        ("c", True),
        ("b", False),
        ("b", True),
    ]


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        (lambda outputs: None, "returned None; expected a list"),
        (lambda outputs: "ab", "returned 'ab'; expected a list"),
        (lambda outputs: iter(outputs), "returned <list_iterator object"),
        (lambda outputs: [o._asdict() for o in outputs], "returned {.*}, not a RequestOutput"),
        (lambda outputs: [tuple(o) for o in outputs], r"returned \('b', .*\), not a Request"),
    ],
    ids=["None", "str", "iterator", "dicts", "tuples"],
)
def test_a_step_answer_that_is_no_list_of_outputs_loses_no_other_replicas_output(bad, named):
    # None raised a TypeError naming nothing; "ab", dicts or tuples raised AttributeError
    # after replica 0's finished "a" had been released, its output lost.
    router = _router(bad)
    with pytest.raises(ValueError, match=rf"replicas\[1\] \(Misstepping\)\.step\(\) {named}"):
        router.step()
    assert router.num_outstanding == (1, 1)
    assert _delivered(router)[0] == ("a", True)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"finish_reason": None}, "finished without a finish_reason"),
        ({"finished": False}, "a finish_reason on a request of one sample that is not"),
        *(
            ({"index": index}, rf"replicas\[1\].*'b' with index {index!r}, not an int")
            for index in [False, 0.0, 1.0, True, "0"]
        ),
        # An array was read by its truth: a ValueError naming neither replica nor output.
        (
            {"finished": np.array([True, False])},
            r"'b' with finished=array\(\[ True, False\]\), no bool",
        ),
        ({"finished": 1}, "'b' with finished=1, no bool"),
        (
            {"finish_reason": np.array(["length", "stop"])},
            r"'b' with finish_reason=array\(.*, no str",
        ),
        ({"finish_reason": 5}, "'b' with finish_reason=5, no str"),
    ],
)
def test_a_finish_without_its_reason_a_reason_without_finish_or_odd_fields_are_refused(
    change, named
):
    # A reason without finished left "b" counted and its id held after its replica
    # dropped it; finished without a reason reached generate as an unexplained end.
    # False and 0.0 equal 0 and hash alike: such an index passed as sample 0's and reached
    # the caller with that index (True and 1.0 likewise as sample 1's of an n > 1 request).
    router = _router(lambda outputs: [o._replace(**change) for o in outputs], tokens=1)
    with pytest.raises(ValueError, match=named):
        router.step()
    # Its replica runs nothing after the step that raised: "b" is released at once.
    assert router.num_outstanding == (1, 0) and router.replicas[1].running == {}
    assert router.abort("b") is False
    assert _delivered(router) == [("a", True)]


def test_a_samples_output_after_the_one_that_finished_its_request_is_refused():
    # Sample 0's output says "x" finished (no sample runs), then sample 1's token comes:
    # it used to reach the caller after the request's end.
    class FinishedFirst(SamplingReplica):
        def step(self):
            self.running.clear()
            return [
                RequestOutput("x", (1,), True, "length", index=0),
                RequestOutput("x", (2,), False, None, index=1),
            ]

    router = PrefixAwareRouter([FinishedFirst(0)], block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(n=2, max_tokens=2), request_id="x")
    with pytest.raises(ValueError, match=r"request 'x' \(index 1.* after the output that fin"):
        router.step()
    assert [(o.index, o.finished) for o in router.step()] == [(0, True)]
    assert router.num_outstanding == (0,)


def test_drain_transfers_counts_the_finish_in_a_refused_step_answer():
    # "b" finishes in a step drain_transfers takes for "a"'s copy, and is reported twice:
    # refused, but b's finish still counts, so b is released.
    class Strays(OffloadingReplica):
        def step(self):
            outputs = super().step()
            if [(o.request_id, o.finished) for o in outputs] == [("b", True)]:
                outputs.append(outputs[0])
            return outputs

    router = PrefixAwareRouter([Strays(0, copy_steps=2)], block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(max_tokens=1), request_id="a")
    router.add_request([2] * BLOCK, SamplingParams(max_tokens=2), request_id="b")
    assert [o.request_id for o in router.step()] == ["a", "b"]
    with pytest.raises(ValueError, match=r"replicas\[0\] \(Strays\)\.step\(\) .*'b'.* after"):
        router.drain_transfers()
    assert router.num_outstanding == (0,)
    with pytest.raises(KeyError):
        router.replica_of("b")
    router.drain_transfers()
    assert not router.has_pending_transfers()


def test_a_tuple_of_outputs_and_subclasses_of_request_output_are_delivered():
    class Output(RequestOutput):
        pass

    router = _router(lambda outputs: tuple(Output(*o) for o in outputs), tokens=1)
    assert [(o.request_id, o.finished) for o in router.step()] == [("a", True), ("b", True)]
    assert router.num_outstanding == (0, 0)


def test_a_samples_output_whose_index_is_a_bool_is_refused():
    class BoolIndex(SamplingReplica):
        def step(self):
            return [o._replace(index=True) if o.index == 1 else o for o in super().step()]

    router = PrefixAwareRouter([BoolIndex(0)], block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(n=2, max_tokens=2), request_id="x")
    with pytest.raises(ValueError, match=r"request 'x' with index True, not an int"):
        router.step()
    # Sample 0's output passed and is delivered first; its finish ends the request.
    assert [(o.index, o.finished) for o in router.step()] == [(0, False), (0, True)]
    assert router.num_outstanding == (0,) and not router.has_unfinished_requests()


def test_drain_transfers_counts_a_refused_answers_finish_while_the_replica_runs_on():
    """Request "b" finishes in a step drain_transfers takes for "a"'s copy, reported twice,
    while "c" still runs there: the step is refused, but b's finish, which passed, counts,
    so b is released though its replica is not idle."""

    class Strays(OffloadingReplica):
        def step(self):
            outputs = super().step()
            return outputs + [o for o in outputs if o.request_id == "b" and o.finished]

    router = PrefixAwareRouter([Strays(0, copy_steps=2)], block_size=BLOCK)
    for rid, tokens in (("a", 1), ("b", 2), ("c", 5)):
        router.add_request([1] * BLOCK, SamplingParams(max_tokens=tokens), request_id=rid)
    assert [o.request_id for o in router.step()] == ["a", "b", "c"]
    with pytest.raises(ValueError, match=r"\(Strays\)\.step\(\) .*'b'.* after the output that fin"):
        router.drain_transfers()
    assert router.num_outstanding == (1,) and router.replica_of("c") == 0
    with pytest.raises(KeyError):
        router.replica_of("b")
