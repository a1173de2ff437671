"""run_to_completion: the progress bar, refused prompts and what is rolled back."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.completion import checked_drivers, run_to_completion
from jaxkv.outputs import CompletionOutput, RequestOutput
from jaxkv.router import PrefixAwareRouter
from tests.engine._util import make_engine
from tests.sharding._router_util import FakeReplica, make_router


class Bar:
    def __init__(self) -> None:
        self.n, self.closed = 0, False

    def update(self, k: int) -> None:
        assert not self.closed
        self.n += k

    def close(self) -> None:
        self.closed = True


def test_the_bar_counts_finished_prompts_and_is_closed():
    router, _ = make_router(2)
    bar = Bar()
    params = [SamplingParams(max_tokens=k) for k in (1, 3, 2)]
    outs = run_to_completion(router, [[1, 2], [3], [4, 5, 6]], params, progress_bar=bar)
    assert [len(o.output_token_ids) for o in outs] == [1, 3, 2]
    assert bar.n == 3 and bar.closed


def test_the_bar_is_closed_when_a_prompt_is_refused():
    router, _ = make_router(2)
    bar = Bar()
    with pytest.raises(ValueError, match="empty prompt"):
        run_to_completion(router, [[1, 2], []], progress_bar=bar)
    assert bar.n == 0 and bar.closed and router.num_outstanding == (0, 0)
    bar = Bar()  # refused before any prompt is queued: it used to stay open
    with pytest.raises(ValueError, match="sampling_params: 1 for 2 prompts; pass one"):
        run_to_completion(router, [[1, 2], [3]], [SamplingParams()], progress_bar=bar)
    assert bar.closed


def test_generate_draws_no_bar_before_refusing_a_prompt(capsys):
    """The bar is made once every prompt is queued: it used to be drawn (a 0% line on
    stderr) before the refusal."""
    engine = make_engine()
    router = PrefixAwareRouter([FakeReplica(0), FakeReplica(1)], block_size=4)
    for driver, bad in ((engine, [-5]), (router, [])):
        with pytest.raises(ValueError, match=r"prompts\[1\] of 2"):
            driver.generate([[1, 2], bad], SamplingParams(max_tokens=1), progress=True)
        with pytest.raises(ValueError, match="sampling_params: 1 for 2 prompts"):
            driver.generate([[1, 2], [3]], [SamplingParams()], progress=True)
        with pytest.raises(ValueError, match="progress='yes' must be a bool"):
            driver.generate([[1, 2]], progress="yes")
    assert capsys.readouterr().err == ""
    outs = engine.generate([[1, 2]], SamplingParams(max_tokens=1), progress=True)
    assert len(outs) == 1 and "generate" in capsys.readouterr().err  # drawn when it runs


def test_generate_with_a_wrong_number_of_params_queues_nothing():
    # Refused before any prompt is queued: no default id or seed is used up.
    engine = make_engine()
    with pytest.raises(ValueError, match="sampling_params: .* for .* prompts"):
        engine.generate([[1, 2], [3, 4]], [SamplingParams()], progress=False)
    # A str is named as what it is, not counted as a list of 6 params.
    with pytest.raises(ValueError, match="sampling_params='greedy' must be None or a Sampl"):
        engine.generate([[1, 2]], "greedy", progress=False)
    assert engine.add_request([1, 2]) == "0"


def test_completion_output_is_frozen_and_hashable():
    import dataclasses

    from jaxkv.outputs import CompletionOutput

    c = CompletionOutput("0", (1, 2), (3,), "length")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.finish_reason = "stop"
    assert len({c, CompletionOutput("0", (1, 2), (3,), "length")}) == 1


def test_completion_output_defaults_are_those_of_a_plain_request():
    """Left out, the optional fields read as a request without logprobs, its sample 0,
    stopped by no token or string and without a tokenizer: None, 0, None, None, None."""
    c = CompletionOutput("0", (1, 2), (3,), "length")
    assert (c.logprobs, c.cumulative_logprob, c.index) == (None, None, 0)
    assert (c.prompt_logprobs, c.stop_reason, c.text) == (None, None, None)


class _RefusesThird:
    """A driver whose add_request fails with a TypeError (not a ValueError) on call 3."""

    def __init__(self) -> None:
        self.queued: list[str] = []

    def add_request(self, prompt, params) -> str:
        if len(self.queued) == 2:
            raise TypeError("not a prompt")
        self.queued.append(str(len(self.queued)))
        return self.queued[-1]

    def abort(self, request_id: str) -> bool:
        self.queued.remove(request_id)
        return True

    def step(self):
        raise AssertionError("nothing may run")

    def has_unfinished_requests(self) -> bool:
        return bool(self.queued)


def test_any_exception_while_queueing_aborts_the_prompts_queued_before_it():
    driver, bar = _RefusesThird(), Bar()
    with pytest.raises(TypeError, match="not a prompt"):
        run_to_completion(driver, [[1], [2], [3]], progress_bar=bar)
    assert driver.queued == [] and bar.closed


class _RewindRefused(_RefusesThird):
    """Its checkpoint cannot be rewound (as when a queued request is still held)."""

    def __init__(self) -> None:
        super().__init__()
        self.rewinds = 0

    def queue_checkpoint(self):
        def rewind() -> None:
            self.rewinds += 1
            raise RuntimeError("still held")

        return rewind


def test_a_checkpoint_that_cannot_be_rewound_leaves_the_refusal_to_propagate():
    driver = _RewindRefused()
    with pytest.raises(TypeError, match="not a prompt"):
        run_to_completion(driver, [[1], [2], [3]])
    assert driver.rewinds == 1 and driver.queued == []


class _RewindLost(_RefusesThird):
    """Its rewind fails otherwise than by refusing (a remote replica's reply lost)."""

    def queue_checkpoint(self):
        def rewind() -> None:
            raise ConnectionError("replica gone")

        return rewind


def test_a_rewind_that_fails_otherwise_is_noted_and_the_refusal_propagates():
    # The rewind's ConnectionError replaced the refusal, and the bar stayed drawn.
    driver, bar = _RewindLost(), Bar()
    with pytest.raises(TypeError, match="not a prompt") as raised:
        run_to_completion(driver, [[1], [2], [3]], progress_bar=bar)
    assert driver.queued == [] and bar.closed
    assert "rewind raised ConnectionError('replica gone')" in "".join(raised.value.__notes__)


@pytest.mark.parametrize("progress", [False, True])
def test_prompts_that_are_no_sequence_are_refused_by_name_and_queue_nothing(progress):
    engine = make_engine()
    router, _ = make_router(2)
    for driver in (engine, router):
        with pytest.raises(ValueError, match="prompts must be a sequence of prompts"):
            driver.generate(5, progress=progress)  # was a TypeError from len()
    assert engine.add_request([1, 2]) == "0" and router.num_outstanding == (0, 0)
    with pytest.raises(KeyError):  # as for any unknown id (was a TypeError)
        router.replica_of(["x"])


@pytest.mark.parametrize(
    "one_prompt, kind",
    [([5, 6, 7], "sequence of ints"), (np.array([5, 6], np.int32), "sequence of ints"),
     (jnp.array([5, 6]), "sequence of ints"), ([np.array(5), np.array(6)], "sequence of ints"),
     ("hello", "str")],
)  # fmt: skip
def test_one_prompt_given_for_a_list_of_prompts_is_refused_by_name(one_prompt, kind):
    """generate takes a sequence of prompts; one prompt's token ids used to be refused as
    prompt 0 with a message about shape=(), naming neither `prompts` nor the fix."""
    engine = make_engine()
    router, _ = make_router(2)
    for driver in (engine, router):
        with pytest.raises(ValueError, match=f"it is one {kind} .*pass \\[prompt_token_ids\\]"):
            driver.generate(one_prompt, progress=False)
    assert engine.add_request([1, 2]) == "0" and router.num_outstanding == (0, 0)
    # A 2-D array is a sequence of prompts: its rows.
    outputs = engine.generate(
        np.ones((2, 3), np.int32), SamplingParams(max_tokens=1), progress=False
    )
    assert [(o.prompt_token_ids, len(o.output_token_ids)) for o in outputs] == [((1, 1, 1), 1)] * 2


def test_a_progress_flag_that_is_no_bool_is_refused_by_name_and_queues_nothing():
    engine = make_engine()
    router, _ = make_router(2)
    for driver in (engine, router):
        with pytest.raises(ValueError, match="progress='no' must be a bool"):
            driver.generate([[1, 2]], progress="no")  # showed the bar, by truthiness
    assert engine.add_request([1, 2]) == "0" and router.num_outstanding == (0, 0)


class _DropsSecond:
    """A driver on which prompt "1" is aborted by another caller after its first token."""

    def __init__(self) -> None:
        self.unfinished, self.steps = [], 0

    def add_request(self, prompt, params) -> str:
        self.unfinished.append(str(len(self.unfinished)))
        return self.unfinished[-1]

    def abort(self, request_id: str) -> bool:
        raise AssertionError("nothing is left to abort")

    def step(self):
        self.steps += 1
        assert self.steps <= 3, "the loop must end once the driver has nothing unfinished"
        if self.steps == 1:
            return [RequestOutput("0", (5,), False, None), RequestOutput("1", (6,), False, None)]
        if self.steps == 2:
            self.unfinished = ["0"]  # "1" aborted elsewhere: no final output follows
            return [RequestOutput("0", (7,), True, "stop")]
        self.unfinished = []
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.unfinished)


def test_a_request_aborted_by_another_caller_ends_as_abort_and_generate_returns():
    driver, bar = _DropsSecond(), Bar()
    outs = run_to_completion(driver, [[1], [2]], progress_bar=bar)
    assert [(o.output_token_ids, o.finish_reason) for o in outs] == [
        ((5, 7), "stop"),
        ((6,), "abort"),
    ]
    assert driver.steps == 3 and bar.n == 1 and bar.closed


def test_generate_progress_bar_counts_the_prompts_and_is_none_when_not_asked():
    from jaxkv.completion import generate_progress_bar

    bar = generate_progress_bar([[1], [2, 3], [4]], True)
    try:
        assert (bar.total, bar.desc, bar.n) == (3, "generate", 0)  # one step per prompt
    finally:
        bar.close()
    assert generate_progress_bar([[1]], False) is None


class _TwoSamples:
    """A driver serving one prompt of n=2: sample 0 ends first (a finish_reason with
    finished=False, as ParallelSamples reports it), sample 1 ends the prompt a step later."""

    def __init__(self) -> None:
        self._steps = [
            [RequestOutput("p", (5,), False, "length", None, 0),
             RequestOutput("p", (6,), False, None, None, 1)],
            [RequestOutput("p", (7,), True, "stop", None, 1)],
        ]  # fmt: skip

    def add_request(self, prompt_token_ids, sampling_params=None) -> str:
        return "p"

    def step(self):
        return self._steps.pop(0)

    def has_unfinished_requests(self) -> bool:
        return bool(self._steps)

    def abort(self, request_id: str) -> bool:
        return False


def test_the_bar_counts_a_prompt_of_n_samples_once():
    bar = Bar()
    params = SamplingParams(n=2, max_tokens=2)
    outs = run_to_completion(_TwoSamples(), [[1, 2]], params, progress_bar=bar)
    assert [(o.index, o.output_token_ids, o.finish_reason) for o in outs] == [
        (0, (5,), "length"),
        (1, (6, 7), "stop"),
    ]
    assert bar.n == 1 and bar.closed


class _NoAbort:
    """Has three of StepDriver's four methods: abort is missing."""

    def add_request(self, prompt, params) -> str:
        return "0"

    def step(self):
        return []

    def has_unfinished_requests(self) -> bool:
        return False


def test_a_driver_lacking_only_one_method_is_refused_by_name():
    with pytest.raises(ValueError, match="replicas: .*_NoAbort.* lacks one of the methods"):
        checked_drivers([_NoAbort()], "replicas")
    ok = _DropsSecond()
    assert checked_drivers((ok,), "replicas") == [ok]


def test_more_params_than_prompts_are_refused_by_count_and_queue_nothing():
    """Too many sampling_params is refused like too few, before any prompt is queued."""
    driver, bar = _RefusesThird(), Bar()
    with pytest.raises(ValueError, match="sampling_params: 3 for 2 prompts; pass one"):
        run_to_completion(driver, [[1], [2]], [SamplingParams()] * 3, progress_bar=bar)
    assert driver.queued == [] and bar.closed


@pytest.mark.parametrize("prompts", [{"a": [1, 2]}, {(1, 2): "a"}, {(1, 2), (3, 4)}])
def test_prompts_in_a_set_or_mapping_are_refused_by_name_and_queue_nothing(prompts):
    """Outputs come in prompt order, which neither has: a set of tuples ran in hash
    order, and a mapping's keys ran as the prompts (or were refused as prompt_token_ids;
    prompts[0] was no KeyError)."""
    engine = make_engine()
    kind = type(prompts).__name__
    with pytest.raises(ValueError, match=f"^prompts must be a sequence of prompts .*not {kind}$"):
        engine.generate(prompts, progress=False)
    assert not engine.has_unfinished_requests() and engine.add_request([1, 2]) == "0"


def test_prompt_token_ids_of_an_array_prompt_are_python_ints():
    """A prompt of numpy ints comes back as a tuple of ints, as CompletionOutput states."""
    prompt = np.array([1, 2], np.int32)
    outs = run_to_completion(_TwoSamples(), [prompt], SamplingParams(n=2, max_tokens=2))
    assert [o.prompt_token_ids for o in outs] == [(1, 2)] * 2
    assert {type(t) for o in outs for t in o.prompt_token_ids} == {int}


class _StopsOnToken(_TwoSamples):
    """Its one request stops on token 9 after a first output of token 5."""

    def __init__(self) -> None:
        self._steps = [
            [RequestOutput("p", (5,), False, None)],
            [RequestOutput("p", (9,), True, "stop", stop_reason=9, text="ab")],
        ]


def test_the_stop_reason_and_text_of_the_final_output_reach_the_completion():
    (out,) = run_to_completion(_StopsOnToken(), [[1, 2]])
    assert (out.output_token_ids, out.finish_reason, out.stop_reason, out.text) == (
        (5, 9),
        "stop",
        9,
        "ab",
    )


class _QueuedAbortFails(_RefusesThird):
    def abort(self, request_id: str) -> bool:
        if request_id == "0":
            raise ConnectionError("replica gone")
        return super().abort(request_id)


def test_an_abort_that_raises_after_a_refused_prompt_leaves_the_others_tried():
    driver = _QueuedAbortFails()
    with pytest.raises(TypeError, match="not a prompt") as raised:
        run_to_completion(driver, [[1], [2], [3]])
    assert driver.queued == ["0"]  # "1" aborted too
    assert "abort('0') raised ConnectionError" in "".join(raised.value.__notes__)


class _AbortedBeforeAnyToken(_TwoSamples):
    """Its one request is aborted by another caller before any output."""

    def __init__(self) -> None:
        self._steps = [[]]


def test_a_prompt_aborted_elsewhere_before_any_token_has_empty_logprobs():
    """Asked for logprobs, it gets one per token: none, summing to 0.0 (not None)."""
    (out,) = run_to_completion(_AbortedBeforeAnyToken(), [[1]], SamplingParams(logprobs=1))
    assert (out.output_token_ids, out.finish_reason) == ((), "abort")
    assert (out.logprobs, out.cumulative_logprob) == ((), 0.0)
    assert type(out.cumulative_logprob) is float  # as vLLM's, not the int 0 of an empty sum
