"""A Ctrl-C at any line of Engine.step's own code in a step that finishes requests: the
finished requests' sampling rows and samples are forgotten (their ids free again), and
every request generates the dense model's greedy tokens."""

from __future__ import annotations

import numpy as np

from jaxkv import SamplingParams
from tests.engine._util import VOCAB, assert_all_blocks_free, dense_greedy, make_engine
from tests.host._line_interrupts import LineInterrupts

PROMPTS = [np.random.default_rng(3).integers(0, VOCAB, n).tolist() for n in (9, 6)]
PARAMS = [SamplingParams(max_tokens=2, logprobs=1), SamplingParams(max_tokens=2, n=2)]
STEP_FILES = {"engine.py", "engine_step.py"}  # Engine.step and its host path


def _serve(engine, at):
    """Serves PROMPTS, a SIGINT at the `at`-th line of STEP_FILES that runs in the step
    that finishes them (the second); returns each request's generated tokens by id."""
    requests = {}
    for prompt, params in zip(PROMPTS, PARAMS, strict=True):
        rid = engine.add_request(prompt, params)
        ids = [rid] if params.n == 1 else [f"{k}_{rid}" for k in range(params.n)]
        requests.update({i: engine.scheduler.requests[i] for i in ids})
    engine.step()  # the prompts
    lines = LineInterrupts(at, STEP_FILES)
    try:
        with lines:
            engine.step()  # the last tokens: every request finishes
    except KeyboardInterrupt:
        pass
    while engine.has_unfinished_requests():
        engine.step()
    return lines.fired, {rid: list(r.output_token_ids) for rid, r in requests.items()}


def test_a_ctrl_c_at_any_line_of_a_finishing_step_leaves_no_request_behind():
    # Cut in the step's closing bookkeeping (after the update finished the requests), the
    # engine kept their sampling rows, and under n > 1 their parent's id, in use for good.
    want = dense_greedy(PROMPTS, 2)
    expected = {"0": want[0], "0_1": want[1], "1_1": want[1]}
    at = 0
    with make_engine() as engine:
        while True:
            at += 1
            fired, tokens = _serve(engine, at)
            assert tokens == expected, fired
            assert len(engine._sampling) == 0, (fired, engine._sampling._slots)
            assert not engine._samples and "1" not in engine.ids_in_use, fired
            assert_all_blocks_free(engine)
            if fired is None:
                break
            engine.abort(list(engine.scheduler.requests))
            engine._serials.next = 0  # the same default ids and seeds next time
    assert at > 20  # the step's code was tried throughout
