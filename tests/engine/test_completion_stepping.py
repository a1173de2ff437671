"""run_to_completion's stepping loop: what an error while stepping aborts, when the loop
sleeps (only after a step that ran no model, for an Engine or a router's replicas), how
a prompt's ids are read for its CompletionOutput, what an interrupt while queueing
leaves, and generate without tqdm."""

from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.completion import progress_bar, run_to_completion
from jaxkv.outputs import RequestOutput
from jaxkv.router import PrefixAwareRouter
from tests.engine._util import BLOCK_SIZE, make_engine
from tests.engine.test_completion import Bar
from tests.sharding._router_util import FakeReplica


class _FailsSecondStep:
    """Prompt "0" finishes on the first step; the second step raises."""

    def __init__(self) -> None:
        self.steps, self.aborted = 0, []

    def add_request(self, prompt, params) -> str:
        return str(prompt[0])

    def step(self):
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("device lost")
        return [RequestOutput("0", (5,), True, "length")]

    def has_unfinished_requests(self) -> bool:
        return True

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


def test_an_error_while_stepping_aborts_only_the_unfinished_prompts():
    """A finished prompt's id is not aborted: it may name another caller's request now."""
    driver, bar = _FailsSecondStep(), Bar()
    with pytest.raises(RuntimeError, match="device lost"):
        run_to_completion(driver, [[0], [1]], progress_bar=bar)
    assert driver.aborted == ["1"] and bar.n == 1 and bar.closed


class _FirstAbortFails(_FailsSecondStep):
    """Its abort of "1" raises (after recording the call)."""

    def abort(self, request_id: str) -> bool:
        super().abort(request_id)
        if request_id == "1":
            raise ConnectionError("replica gone")
        return True


def test_an_abort_that_raises_in_the_cleanup_leaves_the_others_tried_and_the_error():
    # The first abort's error replaced the step's, and the prompts after it ran on.
    driver = _FirstAbortFails()
    with pytest.raises(RuntimeError, match="device lost") as raised:
        run_to_completion(driver, [[0], [1], [2], [3]])
    assert driver.aborted == ["1", "2", "3"]
    assert "abort('1') raised ConnectionError('replica gone')" in "".join(raised.value.__notes__)


def test_generate_sleeps_only_after_a_step_that_ran_no_model(monkeypatch):
    """A step of prefill chunks only (no token yet) ran the model: the loop steps again at
    once. It used to sleep after each, as when waiting on a KV load."""
    engine = make_engine(max_num_batched_tokens=16)  # a 48-token prompt: 3 steps of chunks
    naps = []
    monkeypatch.setattr("jaxkv.completion.time.sleep", naps.append)
    [out] = engine.generate([list(range(1, 49))], SamplingParams(max_tokens=2), progress=False)
    assert len(out.output_token_ids) == 2 and engine.metrics.num_steps == 4
    assert naps == []


def test_router_generate_sleeps_only_after_a_step_in_which_no_replica_ran_a_model(monkeypatch):
    """The router's steps of prefill chunks only ran its replicas' models: no sleep. It
    had no last_step of its own, so it slept after each of them."""
    engines = [make_engine(max_num_batched_tokens=16) for _ in range(2)]
    router = PrefixAwareRouter(engines, block_size=BLOCK_SIZE)
    naps = []
    monkeypatch.setattr("jaxkv.completion.time.sleep", naps.append)
    prompts = [list(range(1, 49)), list(range(60, 108))]  # one per replica, 3 chunks each
    outs = router.generate(prompts, SamplingParams(max_tokens=2), progress=False)
    assert [len(o.output_token_ids) for o in outs] == [2, 2]
    assert [e.metrics.num_steps for e in engines] == [4, 4]
    assert naps == []
    for engine in engines:
        engine.close()


def test_router_generate_still_sleeps_after_a_step_that_ran_nothing(monkeypatch):
    """Replicas without a last_step (or whose last_step stayed) ran no model: one nap."""

    class Idle(FakeReplica):  # its first step waits (on a KV load, say)
        waited = False

        def step(self):
            if not self.waited:
                self.waited = True
                return []
            return super().step()

    router = PrefixAwareRouter([Idle(0), Idle(1)], block_size=4)
    naps = []
    monkeypatch.setattr("jaxkv.completion.time.sleep", naps.append)
    outs = router.generate([[1], [2]], SamplingParams(max_tokens=1), progress=False)
    assert [len(o.output_token_ids) for o in outs] == [1, 1] and naps == [0.0005]


def test_a_jax_array_prompt_is_read_as_one_array_not_token_by_token(monkeypatch):
    """Iterating a jax array makes one device array per token (about 0.3 ms each: 1.3 s
    for a 4096-token prompt); generate reads a prompt's ids for its CompletionOutput
    as one array, as add_request does."""
    prompt = jnp.arange(1, 9, dtype=jnp.int32)
    engine = make_engine()

    def token_by_token(self):
        raise AssertionError("a jax array prompt was iterated token by token")

    monkeypatch.setattr(type(prompt), "__iter__", token_by_token)
    [out] = engine.generate([prompt], SamplingParams(max_tokens=2), progress=False)
    assert out.prompt_token_ids == tuple(range(1, 9))
    assert {type(t) for t in out.prompt_token_ids} == {int}


@pytest.mark.parametrize(
    "prompts, progress, match",
    [(5, False, "prompts must be a sequence of prompts"), ([[1]], "no", "must be a bool")],
)
def test_a_caller_s_bar_is_closed_when_prompts_or_progress_are_refused(prompts, progress, match):
    """Refused before any prompt is queued, as a count of sampling_params is: the bar
    used to stay open."""
    driver, bar = _FailsSecondStep(), Bar()
    with pytest.raises(ValueError, match=match):
        run_to_completion(driver, prompts, progress_bar=bar, progress=progress)
    assert bar.closed and driver.steps == 0


def test_a_prompt_of_mixed_numpy_integer_types_comes_back_as_python_ints():
    """numpy reads uint64 among int64 as float64: the prompt's ids are still ints."""
    engine = make_engine()
    prompt = [np.uint64(3), np.int64(4), 5]
    [out] = engine.generate([prompt], SamplingParams(max_tokens=1), progress=False)
    assert out.prompt_token_ids == (3, 4, 5)
    assert {type(t) for t in out.prompt_token_ids} == {int}


class _Unreadable:
    """A prompt numpy cannot read as an array (a tensor on another device, say), whose
    tokens iterate as ints."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __array__(self, *args, **kwargs):
        raise TypeError("cannot convert to numpy")

    def __iter__(self):
        return iter(self.ids)


class _TakesAnyPrompt:
    """A driver that takes any prompt and finishes it in one step with token 9."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def add_request(self, prompt, params) -> str:
        self.ids.append(str(len(self.ids)))
        return self.ids[-1]

    def step(self):
        ids, self.ids = self.ids, []
        return [RequestOutput(rid, (9,), True, "length") for rid in ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self.ids)

    def abort(self, request_id: str) -> bool:
        return False


def test_a_driver_s_prompt_that_numpy_cannot_read_comes_back_token_by_token():
    """Its outputs are not lost at the end for want of an array of its ids."""
    outs = run_to_completion(_TakesAnyPrompt(), [_Unreadable([4, 5]), [], [6]])
    assert [(o.prompt_token_ids, o.output_token_ids) for o in outs] == [
        ((4, 5), (9,)),
        ((), (9,)),
        ((6,), (9,)),
    ]


class _InterruptedThird(_FailsSecondStep):
    """Its add_request is interrupted (Ctrl-C) on the third prompt."""

    def __init__(self) -> None:
        super().__init__()
        self.queued: list[str] = []

    def add_request(self, prompt, params) -> str:
        if len(self.queued) == 2:
            raise KeyboardInterrupt
        self.queued.append(str(prompt[0]))
        return self.queued[-1]

    def abort(self, request_id: str) -> bool:
        self.queued.remove(request_id)
        return True


def test_an_interrupt_while_queueing_aborts_the_queued_prompts_and_is_not_annotated():
    """A Ctrl-C is no refusal of the prompt it came at: raised as it is, without the note
    naming that prompt that an exception gets, the prompts queued before it aborted."""
    driver, bar = _InterruptedThird(), Bar()
    with pytest.raises(KeyboardInterrupt) as raised:
        run_to_completion(driver, [[1], [2], [3]], progress_bar=bar)
    assert driver.queued == [] and driver.steps == 0 and bar.closed
    assert not hasattr(raised.value, "__notes__")


def test_without_tqdm_generate_runs_with_no_bar(monkeypatch, capsys):
    """tqdm is an optional dependency: progress=True then draws nothing."""
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # its import raises ImportError
    assert progress_bar(3, desc="generate") is None
    engine = make_engine()
    outs = engine.generate([[1, 2], [3]], SamplingParams(max_tokens=1), progress=True)
    assert [len(o.output_token_ids) for o in outs] == [1, 1]
    assert capsys.readouterr().err == ""
