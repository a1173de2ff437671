"""A Ctrl-C at any line of Engine.abort: every request it names is cancelled whole, each
sample of one of n > 1 too, or (before it began) none is; nothing of a cancelled one
stays behind (sampling rows, samples, ids in use, blocks)."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from tests.engine._util import assert_all_blocks_free, make_engine
from tests.host._line_interrupts import LineInterrupts

PROMPTS = {"x": [5, 6, 7, 8, 9], "y": [3, 4, 5]}
PARAMS = {"x": SamplingParams(max_tokens=4, n=2), "y": SamplingParams(max_tokens=4)}


@pytest.mark.parametrize("running", [False, True], ids=["waiting", "running"])
def test_a_ctrl_c_at_any_line_of_abort_cancels_each_request_whole(running):
    # Cut after the scheduler had released a request (its own abort holds a Ctrl-C) but
    # before the engine forgot its sampling row and sample, those stayed for good (under
    # n > 1 the parent's id in use); cut between two samples, the second ran on.
    at = 0
    with make_engine() as engine:
        while True:
            at += 1
            for rid, prompt in PROMPTS.items():
                engine.add_request(prompt, PARAMS[rid], request_id=rid)
            if running:
                engine.step()
            lines = LineInterrupts(at)
            try:
                with lines:
                    engine.abort(["x", "y"])
            except KeyboardInterrupt:
                pass
            left = sorted(engine.scheduler.requests)
            assert left in ([], ["0_x", "1_x", "y"]), (left, lines.fired)  # before it began
            engine.abort(["x", "y"])
            assert not engine._samples and len(engine._sampling) == 0, lines.fired
            assert not any(rid in engine.ids_in_use for rid in PROMPTS), lines.fired
            assert_all_blocks_free(engine)
            if lines.fired is None:
                break
    assert at > 50  # abort's code was tried throughout
