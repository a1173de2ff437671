"""StepBatch: the running requests' arrays come first, requests added one by one after
them, and set_running refuses a batch that already holds requests."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import Request, SamplingParams
from jaxkv.scheduler_output import StepBatch


def test_set_running_refuses_a_batch_that_already_holds_an_added_request():
    batch = StepBatch()
    batch.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=2)), 3)
    running = Request("b", [4, 5], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="set_running needs an empty batch"):
        batch.set_running([running], np.ones(1, np.int32), np.zeros(1, np.int32), [4])
    out = batch.output((), ())
    assert out.request_ids == ["a"] and out.token_ids == [1, 2, 3]


def test_set_running_after_clear_starts_the_batch_with_the_running_arrays():
    batch = StepBatch()
    batch.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=2)), 3)
    batch.clear()
    running = Request("b", [4, 5], SamplingParams(max_tokens=2))
    batch.set_running([running], np.ones(1, np.int32), np.array([1], np.int32), [5])
    batch.add(Request("c", [6, 7], SamplingParams(max_tokens=2)), 2)
    out = batch.output((), ())
    assert out.request_ids == ["b", "c"] and out.token_ids == [5, 6, 7]
    assert out.num_scheduled_tokens.tolist() == [1, 2]
    assert out.num_computed_tokens.tolist() == [1, 0]
