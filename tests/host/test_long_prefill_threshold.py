"""SchedulerConfig.long_prefill_token_threshold: no request is scheduled more tokens in a
step than the threshold (vLLM's option of that name), whether it is admitted, continues
its prefill while running, or resumes after a landed load; decodes are unchanged, and
the budget the capped prompt leaves goes to the next requests in the queue."""

from __future__ import annotations

import pytest

from jaxkv.config import SchedulerConfig
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import FakeCopier, add, make_scheduler, run_until_idle, step


def _scheduled(out) -> dict[str, int]:
    return dict(zip(out.request_ids, out.num_scheduled_tokens.tolist(), strict=True))


def test_long_prompts_run_in_chunks_of_the_threshold_side_by_side():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=32, long_prefill_token_threshold=8)
    add(sched, "a", range(1, 21), max_tokens=2)  # 20 tokens: chunks of 8, 8, 4
    add(sched, "b", range(30, 41), max_tokens=2)  # 11 tokens: 8, 3
    add(sched, "c", range(50, 53), max_tokens=3)  # 3 tokens: whole
    add(sched, "d", range(60, 80), max_tokens=1)  # gets the 8 left in the first step
    steps = [_scheduled(step(sched)[0]) for _ in range(4)]
    assert steps == [
        {"a": 8, "b": 8, "c": 3, "d": 8},
        {"a": 8, "b": 3, "c": 1, "d": 8},  # running, in admission order
        {"a": 4, "b": 1, "c": 1, "d": 4},  # c's last token; d's only one
        {"a": 1},  # a's second token
    ]
    assert run_until_idle(sched) == {}
    sched.manager.check_integrity()


def test_without_a_threshold_one_prompt_takes_the_whole_budget():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=32)
    add(sched, "a", range(1, 41), max_tokens=1)
    add(sched, "b", range(50, 53), max_tokens=1)
    assert _scheduled(step(sched)[0]) == {"a": 32}
    assert _scheduled(step(sched)[0]) == {"a": 8, "b": 3}


def test_a_request_that_loses_its_blocks_resumes_in_chunks_of_the_threshold():
    # 6 usable blocks of 4: a and b fill them as they decode, and b is preempted; its
    # recompute is capped like any prefill.
    sched = make_scheduler(
        num_blocks=7, max_num_seqs=2, max_num_batched_tokens=16, long_prefill_token_threshold=5
    )
    add(sched, "a", range(1, 9), max_tokens=8)
    b = add(sched, "b", range(20, 28), max_tokens=8)
    seen = []
    for _ in range(40):
        out, _ = step(sched)
        seen.append(_scheduled(out))
        if not sched.has_unfinished_requests():
            break
    assert b.num_preemptions >= 1
    assert max(n for s in seen for n in s.values()) == 5
    assert all(n <= 5 for s in seen for n in s.values())


def test_a_step_that_preempts_still_caps_a_prompt_chunk_at_the_threshold():
    # 5 usable blocks of 4. In the third step a's chunk and b's first decode need one new
    # block each, one too many: the requests are allocated one by one, from the whole
    # budget again, and b preempted.
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=8, long_prefill_token_threshold=4)
    add(sched, "a", range(1, 17), max_tokens=2)
    add(sched, "b", range(20, 28), max_tokens=2)
    steps = [step(sched)[0] for _ in range(3)]
    assert [_scheduled(out) for out in steps] == [{"a": 4, "b": 4}, {"a": 4, "b": 4}, {"a": 4}]
    assert steps[-1].preempted_request_ids == ("b",)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold=-1"),
        (dict(long_prefill_token_threshold=2.5), "long_prefill_token_threshold=2.5"),
        (
            dict(long_prefill_token_threshold=8, enable_chunked_prefill=False),
            "long_prefill_token_threshold=8 splits prompts into chunks: it needs "
            "enable_chunked_prefill=True",
        ),
    ],
)
def test_a_threshold_it_cannot_use_is_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(max_num_batched_tokens=512, max_model_len=64, **kwargs)
    assert SchedulerConfig(long_prefill_token_threshold=1).long_prefill_token_threshold == 1


@pytest.mark.parametrize("threshold, expected", [(0, 32), (1, 1), (8, 8), (32, 32), (40, 32)])
def test_max_tokens_per_request_is_the_threshold_or_else_the_budget(threshold, expected):
    config = SchedulerConfig(
        max_num_batched_tokens=32, max_num_seqs=8, long_prefill_token_threshold=threshold
    )
    assert config.max_tokens_per_request == expected


def test_a_request_whose_load_landed_runs_its_remaining_tokens_in_capped_chunks():
    copier = FakeCopier(64, 4)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=4, hash_seed=0)
    sched = make_scheduler(num_blocks=64, connector=connector, long_prefill_token_threshold=2)
    prompt = list(range(1, 24))  # 23 tokens: 5 full blocks stored, then 20 tokens loaded
    add(sched, "a", prompt, max_tokens=1)
    run_until_idle(sched, copier)
    assert sched.manager.reset_prefix_cache()  # only the host store has the prefix now
    b = add(sched, "b", prompt + [90, 91], max_tokens=1)  # 25 tokens: 5 left after 20
    scheduled = []
    while sched.has_unfinished_requests():
        scheduled.append(_scheduled(step(sched, copier)[0]).get("b", 0))
    assert connector.stats.num_loads == 1 and b.num_output_tokens == 1
    assert [n for n in scheduled if n] == [2, 2, 1]
