"""An interrupt (KeyboardInterrupt) raised inside the tokenizer, which the update pass
calls for stop strings, streamed text and finished text: the step's outputs are lost, but
the engine keeps serving: a request marked finished leaves the running queue with its
blocks, a running one keeps its tokens (one after it in the batch computes its tokens
again, and the metrics count both runs), and nothing stays in use or allocated. A Ctrl-C
(SIGINT) there stops the tokenizer at once, although the step holds one around it."""

from __future__ import annotations

import signal

import pytest

from jaxkv import SamplingParams
from jaxkv.engine import Engine
from jaxkv.models import ByteTokenizer
from tests.engine._util import assert_all_blocks_free, dense_greedy, engine_config, tiny_model

PROMPT = [97, 98, 99, 100, 101, 102]


class _InterruptOnce(ByteTokenizer):
    """Raises KeyboardInterrupt from its `after`-th decode call on, once."""

    def __init__(self) -> None:
        self.calls, self.after = 0, None

    def decode(self, ids):
        self.calls += 1
        if self.after is not None and self.calls >= self.after:
            self.after = None
            raise KeyboardInterrupt
        return super().decode(ids)


class _CtrlCOnce(ByteTokenizer):
    """Raises SIGINT (as a Ctrl-C would) in its `after`-th decode call, once; `ran_on`
    says whether that call went on past it."""

    def __init__(self) -> None:
        self.calls, self.after, self.ran_on = 0, None, False

    def decode(self, ids):
        self.calls += 1
        if self.after is not None and self.calls >= self.after:
            self.after = None
            signal.raise_signal(signal.SIGINT)
            self.ran_on = True
        return super().decode(ids)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=1),  # the finished text's decode
        SamplingParams(max_tokens=4, stream_text=True),  # a running request's read
        SamplingParams(max_tokens=4, stop="\x00\x01"),
    ],
    ids=["finishing", "streaming", "stop strings"],
)
def test_an_interrupt_in_the_tokenizer_leaves_the_engine_serving(params):
    tokenizer = _InterruptOnce()
    engine = Engine(tiny_model(), None, engine_config(), tokenizer=tokenizer)
    tokenizer.after = tokenizer.calls + 1
    with pytest.raises(KeyboardInterrupt):
        engine.generate([PROMPT], params, progress=False)
    assert not engine.scheduler.running and not engine.has_unfinished_requests()
    assert "0" not in engine.ids_in_use
    assert_all_blocks_free(engine)
    outs = engine.generate([PROMPT, PROMPT], params, progress=False)
    expected = dense_greedy([PROMPT], params.max_tokens)[0]
    assert [list(o.output_token_ids) for o in outs] == [expected, expected]
    assert_all_blocks_free(engine)


def test_a_step_driven_request_keeps_its_tokens_after_an_interrupt_and_runs_on():
    tokenizer = _InterruptOnce()
    engine = Engine(tiny_model(), None, engine_config(), tokenizer=tokenizer)
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=5, stream_text=True))
    seen = [t for o in engine.step() for t in o.new_token_ids]
    tokenizer.after = tokenizer.calls + 1
    with pytest.raises(KeyboardInterrupt):
        engine.step()  # its second token is kept, its output lost
    request = engine.scheduler.requests[rid]
    assert request.output_token_ids[: len(seen)] == seen and len(request.output_token_ids) == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert request.output_token_ids == dense_greedy([PROMPT], 5)[0]
    assert_all_blocks_free(engine)


def test_a_step_interrupted_in_the_tokenizer_counts_in_the_metrics():
    # The model ran and its tokens were kept: the step is one of num_steps, and the step
    # records still add up to the tokens computed (each prompt token and fed-back output).
    tokenizer = _InterruptOnce()
    engine = Engine(tiny_model(), None, engine_config(), tokenizer=tokenizer)
    engine.add_request(PROMPT, SamplingParams(max_tokens=4, stream_text=True))
    assert engine.step()
    steps = [engine.last_step]
    tokenizer.after = tokenizer.calls + 1
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    steps.append(engine.last_step)
    while engine.has_unfinished_requests():
        engine.step()
        steps.append(engine.last_step)
    m = engine.metrics
    assert len(set(map(id, steps))) == len(steps) == m.num_steps == 4
    assert m.num_generated_tokens == 4
    assert sum(s.num_tokens for s in steps) == m.num_prompt_tokens + 4 - 1 == len(PROMPT) + 3
    assert m.device_time_s == pytest.approx(sum(s.device_s for s in steps), rel=1e-12)


def test_samples_finished_in_an_interrupted_step_leave_the_parallel_samples_bookkeeping():
    # n=2, one token each: sample 0's finished text is decoded first and interrupted, so
    # sample 0 has finished and sample 1 was not yet updated. The step (engine_step) forgets the
    # finished sample in its `finally:`; kept, the request would never report finished
    # and its id would stay in use.
    tokenizer = _InterruptOnce()
    engine = Engine(tiny_model(), None, engine_config(), tokenizer=tokenizer)
    params = SamplingParams(max_tokens=1, n=2)
    rid = engine.add_request(PROMPT, params)
    tokenizer.after = tokenizer.calls + 1
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert rid in engine.ids_in_use  # sample 1 runs on
    outs = [o for _ in range(3) for o in engine.step()]
    assert [(o.request_id, o.index, o.finished) for o in outs] == [(rid, 1, True)]
    assert rid not in engine.ids_in_use and not engine.has_unfinished_requests()
    assert engine.add_request(PROMPT, params, request_id=rid) == rid
    outs = engine.step()
    assert [(o.request_id, o.index, o.finished) for o in outs] == [(rid, 0, False), (rid, 1, True)]
    assert_all_blocks_free(engine)


def _third_greedy_token_stops(**args) -> SamplingParams:
    third = dense_greedy([PROMPT], 3)[0][2]
    assert third not in dense_greedy([PROMPT], 2)[0]
    return SamplingParams(max_tokens=8, stop_token_ids=(third,), **args)


@pytest.mark.parametrize(
    "make_params",
    [
        lambda: SamplingParams(max_tokens=3, stream_text=True),
        lambda: SamplingParams(max_tokens=3, stop="\x00\x01"),
        lambda: _third_greedy_token_stops(include_stop_str_in_output=True, stop="\x00\x01"),
        lambda: _third_greedy_token_stops(include_stop_str_in_output=True, stream_text=True),
    ],
    ids=["length-streaming", "length-stop", "stop-token-stop", "stop-token-streaming"],
)
def test_an_interrupt_reading_a_finishing_token_still_finishes_the_request(make_params):
    # The update decided the request stops (its length, or a stop token whose text it
    # keeps) and then read the token's text for stop strings or the stream: interrupted
    # there, the request must not stay running and sample a token past its end (which
    # the metrics would count as generated too).
    tokenizer = _InterruptOnce()
    engine = Engine(tiny_model(), None, engine_config(), tokenizer=tokenizer)
    rid = engine.add_request(PROMPT, make_params())
    engine.step()
    engine.step()
    tokenizer.after = tokenizer.calls + 1
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert not engine.has_unfinished_requests() and rid not in engine.ids_in_use
    assert engine.step() == []
    assert engine.metrics.num_generated_tokens == 3
    assert_all_blocks_free(engine)


def test_tokens_an_interrupt_leaves_to_compute_again_count_each_time_they_run():
    # The interrupt comes in the first request's read, so the second was not advanced:
    # the model ran its prompt in the interrupted step and runs it again in the next.
    # num_prompt_tokens counts both runs, as it counts a preempted request's recompute,
    # so the step records add up to the tokens computed.
    tokenizer = _InterruptOnce()
    engine = Engine(tiny_model(), None, engine_config(), tokenizer=tokenizer)
    params = SamplingParams(max_tokens=2, stream_text=True)
    first = engine.add_request(PROMPT, params)
    second = engine.add_request([t + 10 for t in PROMPT], params)
    tokenizer.after = tokenizer.calls + 1
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    steps = [engine.last_step]
    requests = engine.scheduler.requests
    assert requests[first].num_computed_tokens == len(PROMPT)
    assert requests[second].num_computed_tokens == 0  # its prompt runs again
    while engine.has_unfinished_requests():
        engine.step()
        steps.append(engine.last_step)
    m, stats = engine.metrics, engine.scheduler.stats
    assert m.num_prompt_tokens == 3 * len(PROMPT) and m.num_generated_tokens == 4
    decoded = stats.num_decode_tokens_computed
    assert sum(s.num_tokens for s in steps) == m.num_prompt_tokens + decoded
    assert_all_blocks_free(engine)


def test_a_ctrl_c_in_the_tokenizer_stops_it_at_once_inside_the_step():
    # Engine.step holds a Ctrl-C from the update on, but not in the tokenizer the update
    # calls: that one is raised there, as it would be outside any hold.
    tokenizer = _CtrlCOnce()
    engine = Engine(tiny_model(), None, engine_config(), tokenizer=tokenizer)
    tokenizer.after = tokenizer.calls + 1
    params = SamplingParams(max_tokens=4, stream_text=True)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([PROMPT], params, progress=False)
    assert tokenizer.calls > 0 and not tokenizer.ran_on
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)
