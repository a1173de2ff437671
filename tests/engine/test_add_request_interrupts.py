"""A Ctrl-C at any line of Engine.add_request: the request (each of its samples under
n > 1) is queued whole, its default id and seed taken, or nothing is; an abort then
leaves no id in use and no sampling row behind."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from tests.engine._util import assert_all_blocks_free, make_engine
from tests.host._line_interrupts import LineInterrupts

PROMPT = [5, 6, 7, 8, 9]


@pytest.mark.parametrize("n", [1, 2])
def test_a_ctrl_c_at_any_line_of_add_request_queues_the_request_whole_or_not_at_all(n):
    # Cut after the samples were queued on the scheduler but before they were registered
    # as the request's, their parent id stayed in use for good (an abort of it raised
    # KeyError); cut before the serial was taken, the next request got the same seed.
    ids = ["0"] if n == 1 else ["0_0", "1_0"]
    at = 0
    with make_engine() as engine:
        while True:
            at += 1
            lines = LineInterrupts(at)
            try:
                with lines:
                    engine.add_request(PROMPT, SamplingParams(max_tokens=2, n=n))
            except KeyboardInterrupt:
                pass
            queued = [i for i in ids if i in engine.scheduler.requests]
            assert queued in ([], ids), lines.fired
            assert ("0" in engine.ids_in_use) == bool(queued), lines.fired
            assert engine._serials.next == (1 if queued else 0), lines.fired
            engine.abort("0")
            assert "0" not in engine.ids_in_use and not engine._samples, lines.fired
            assert len(engine._sampling) == 0, lines.fired
            assert_all_blocks_free(engine)
            if lines.fired is None:
                break
            engine._serials.next = 0  # the same default id next time
    assert at > 50  # add_request's code was tried throughout
