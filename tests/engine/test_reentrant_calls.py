"""A call back into the Engine from inside its step (the tokenizer decodes there) is
refused with RuntimeError, and the step goes on as if it had not been made: a nested
step used to hand out the outer step's tokens twice and lose others."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from jaxkv.engine import Engine
from jaxkv.models import ByteTokenizer
from tests.engine._util import assert_all_blocks_free, engine_config, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 40, 41, 42]]
PARAMS = SamplingParams(max_tokens=4, stream_text=True)
CALLS = {
    "step": lambda engine: engine.step(),
    "abort": lambda engine: engine.abort("0"),
    "add_request": lambda engine: engine.add_request([1, 2, 3]),
    "generate": lambda engine: engine.generate([[1, 2, 3]], progress=False),
    "drain_transfers": lambda engine: engine.drain_transfers(),
    "close": lambda engine: engine.close(),
}


class _CallsBack(ByteTokenizer):
    """Makes `call` on `engine` from every decode once armed; records what it raised."""

    def __init__(self, call) -> None:
        self.call, self.engine, self.errors = call, None, []

    def decode(self, ids, **kwargs) -> str:
        if self.engine is not None:
            try:
                self.call(self.engine)
            except Exception as e:  # noqa: BLE001 - which one is the point
                self.errors.append(e)
        return super().decode(ids, **kwargs)


def _run(tokenizer) -> list[tuple]:
    with Engine(tiny_model(), None, engine_config(), tokenizer=tokenizer) as engine:
        for prompt in PROMPTS:
            engine.add_request(prompt, PARAMS)
        outputs = [engine.step()]
        tokenizer.engine = engine
        while engine.has_unfinished_requests():
            outputs.append(engine.step())
        tokenizer.engine = None
        assert_all_blocks_free(engine)
        assert engine.step() == [] and not engine.closed
    return [(o.request_id, o.new_token_ids, o.finish_reason, o.text) for s in outputs for o in s]


@pytest.mark.parametrize("name", list(CALLS))
def test_a_call_back_into_the_engine_from_its_step_is_refused(name):
    expected = _run(_CallsBack(lambda engine: None))
    tokenizer = _CallsBack(CALLS[name])
    assert _run(tokenizer) == expected
    assert tokenizer.errors  # every call was refused, by name
    assert all(type(e) is RuntimeError for e in tokenizer.errors)
    assert all("inside Engine.step()" in str(e) for e in tokenizer.errors)


@pytest.mark.parametrize("timeout_s", [-1, "60"])
def test_close_from_a_step_is_refused_before_its_timeout_is_checked(timeout_s):
    # The refusal comes first (engine.py's close checks it before anything else): a
    # call back with a bad timeout is still a call back into the step, RuntimeError,
    # not a ValueError the tokenizer would raise into the step. One request finishing
    # in the step: the finished text's decode makes the call.
    tokenizer = _CallsBack(lambda engine: engine.close(timeout_s))
    engine = Engine(tiny_model(), None, engine_config(), tokenizer=tokenizer)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=1))
    tokenizer.engine = engine
    (out,) = engine.step()
    tokenizer.engine = None
    assert out.finished and not engine.has_unfinished_requests() and not engine.closed
    assert tokenizer.errors and all(type(e) is RuntimeError for e in tokenizer.errors)
    assert all("inside Engine.step()" in str(e) for e in tokenizer.errors)
    assert_all_blocks_free(engine)
    engine.close()
    assert engine.closed
