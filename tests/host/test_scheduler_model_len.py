"""The scheduler takes a manager only if it holds rows for the config's max_model_len,
and the least max_model_len the config takes serves a request."""

from __future__ import annotations

import pytest

from jaxkv import KVCacheManager
from jaxkv.config import SchedulerConfig
from jaxkv.scheduler import Scheduler
from tests.host._sched_util import add, make_scheduler, run_until_idle


def test_a_manager_one_token_short_of_max_model_len_is_refused_and_one_equal_taken():
    """A manager with max_model_len one below the config's would refuse the last token of
    a request the scheduler admitted as fitting: refused by name, one token short being
    enough. A manager of equal or greater max_model_len is taken."""
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32)
    with pytest.raises(ValueError, match=r"manager.max_model_len=31 must be >= "):
        Scheduler(config, KVCacheManager(16, 4, max_model_len=31))
    for max_model_len in (32, 33):
        manager = KVCacheManager(16, 4, max_model_len=max_model_len)
        assert Scheduler(config, manager).manager is manager


def test_the_least_max_model_len_serves_a_one_token_prompt_to_its_one_output_token():
    """max_model_len=2 is the least a request fits (SchedulerConfig refuses 1): a prompt
    token and the token it generates, the request finishing by length."""
    sched = make_scheduler(max_model_len=2, max_num_seqs=1, max_num_batched_tokens=1)
    a = add(sched, "a", [7], max_tokens=None)
    assert run_until_idle(sched) == {"a": "length"} and a.num_output_tokens == 1
