"""Engine configs refuse bad fields on construction, naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.config import CacheConfig, EngineConfig, SchedulerConfig


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: CacheConfig(num_blocks=1), "num_blocks"),
        (lambda: CacheConfig(block_size=0), "block_size=0"),
        (lambda: CacheConfig(block_size=True), "block_size=True"),
        (lambda: CacheConfig(kv_dtype="int8"), "kv_dtype"),
        (lambda: CacheConfig(hash_seed=2**64), "hash_seed=18446744073709551616 must be an int in"),
        (lambda: CacheConfig(hash_seed="0"), "seed='0'"),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs=0"),
        # A prompt of one token leaves no room for output: every request was refused.
        (lambda: SchedulerConfig(max_model_len=1), "max_model_len=1 must be >= 2"),
        (lambda: SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=16), "max_num_seqs"),
        (
            lambda: SchedulerConfig(max_num_batched_tokens=64, enable_chunked_prefill=False),
            "without chunked prefill",
        ),
        (lambda: EngineConfig(backend="cuda"), "backend"),
        (lambda: EngineConfig(backend=""), "backend=''"),
        (lambda: EngineConfig(min_pages_bucket=0), "min_pages_bucket=0"),
        (lambda: EngineConfig(q_len_buckets=(4, 2)), "strictly increasing"),
        (lambda: EngineConfig(q_len_buckets=(1, 8)), "must reach"),
        (lambda: EngineConfig(q_len_buckets=(1, 511)), "must reach"),  # one short of 512
        (lambda: EngineConfig(q_len_buckets=()), "strictly increasing ints >= 1"),
        (lambda: EngineConfig(cache={"num_blocks": 8}), "must be a CacheConfig"),
        (lambda: EngineConfig(scheduler=None), "must be a SchedulerConfig"),
        (lambda: EngineConfig(seed=1.5), "seed=1.5"),
        (lambda: EngineConfig(seed=2**64), r"seed=18446744073709551616 must be an int in \[-"),
        (lambda: CacheConfig(enable_prefix_caching="false"), "enable_prefix_caching='false'"),
        (lambda: SchedulerConfig(enable_chunked_prefill=None), "enable_chunked_prefill=None"),
        (lambda: EngineConfig(enable_cascade="no"), "enable_cascade='no'"),
        (lambda: EngineConfig(interpret=1), "interpret=1"),
        (lambda: EngineConfig(pad_cascade_levels="yes"), "pad_cascade_levels='yes'"),
        (lambda: EngineConfig(cascade_cost_model={"min_requests": 2}), "cascade_cost_model"),
        (lambda: EngineConfig(max_logprobs=-1), "max_logprobs=-1"),
    ],
)
def test_bad_fields_raise_value_error_naming_them(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_defaults_build_and_derive_consistent_sizes():
    config = EngineConfig(
        cache=CacheConfig(num_blocks=64, block_size=16),
        scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8, max_model_len=100),
        q_len_buckets=(1, 128),
    )
    assert config.max_blocks_per_seq == 7 and config.q_len_buckets == (1, 128)
    assert config.buckets.max_pages_per_seq == 7


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: EngineConfig(q_len_buckets=(0, 512)), "strictly increasing ints >= 1"),
        (lambda: EngineConfig(q_len_buckets=(1.5, 512)), "strictly increasing ints >= 1"),
        (lambda: EngineConfig(q_len_buckets=(1, True, 512)), "strictly increasing ints >= 1"),
        (lambda: EngineConfig(q_len_buckets=512), "strictly increasing ints >= 1"),
        (lambda: EngineConfig(max_cascade_groups=0), "max_cascade_groups=0"),
    ],
)
def test_bad_bucket_fields_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_limits_at_their_bounds_are_accepted():
    # One token per request fills the budget exactly; the longest prompt (max_model_len - 1
    # tokens, the last position is for output) fills one step exactly.
    assert SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8).max_num_seqs == 8
    full = SchedulerConfig(
        max_num_batched_tokens=64, max_model_len=65, enable_chunked_prefill=False
    )
    assert full.max_model_len == 65
    with pytest.raises(ValueError, match="at most one more than"):
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=66, enable_chunked_prefill=False)
    assert CacheConfig(num_blocks=2).num_blocks == 2  # the null block and one usable block
    # q_len_buckets reaching the budget exactly; any integer sequence becomes a tuple of int.
    config = EngineConfig(q_len_buckets=[1, np.int64(512)])
    assert config.q_len_buckets == (1, 512) and all(type(b) is int for b in config.q_len_buckets)


_INT32_MAX = 2**31 - 1


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda n: CacheConfig(num_blocks=n, block_size=1), "num_blocks"),
        (lambda n: SchedulerConfig(max_num_batched_tokens=n), "max_num_batched_tokens"),
        (lambda n: SchedulerConfig(max_model_len=n), "max_model_len"),
        (
            lambda n: SchedulerConfig(max_num_batched_tokens=_INT32_MAX, max_num_seqs=n),
            "max_num_seqs",
        ),
        (lambda n: SchedulerConfig(long_prefill_token_threshold=n), "long_prefill_token_threshold"),
    ],
)
def test_sizes_past_int32_are_refused_by_name(make, name):
    """Block ids, positions and token counts are int32 on the device: a size past that
    range is refused by the config, not at build (where it failed on memory)."""
    assert getattr(make(_INT32_MAX), name) == _INT32_MAX
    with pytest.raises(
        ValueError, match=rf"{name}=2147483648 must be an int in \[[01], 2147483647\]"
    ):
        make(_INT32_MAX + 1)


def test_block_size_past_int32_is_refused_by_name():
    with pytest.raises(ValueError, match=r"block_size=2147483648 must be an int in \[1,"):
        CacheConfig(num_blocks=2, block_size=_INT32_MAX + 1)


def test_a_cache_of_more_token_slots_than_int32_holds_is_refused():
    """A token's KV slot (block_id * block_size + offset) is int32 on the device: with
    more than 2**31 slots a slot wrapped negative and its KV was dropped silently."""
    assert CacheConfig(num_blocks=2, block_size=2**30).block_size == 2**30  # 2**31 slots
    assert CacheConfig(num_blocks=2**21, block_size=2**10).num_blocks == 2**21
    for num_blocks, block_size in ((3, 2**30), (2, _INT32_MAX), (2**21 + 1, 2**10)):
        with pytest.raises(
            ValueError, match=r"num_blocks=\d+ times block_size=\d+ must be at most 2\*\*31"
        ):
            CacheConfig(num_blocks=num_blocks, block_size=block_size)


def test_a_bool_seed_is_refused():
    with pytest.raises(ValueError, match="seed"):
        EngineConfig(seed=True)


def test_duplicate_q_len_buckets_are_refused():
    with pytest.raises(ValueError, match="strictly increasing"):
        EngineConfig(q_len_buckets=(1, 1, 512))


def test_max_step_programs_without_cascade_counts_the_main_programs_only():
    flat = EngineConfig(enable_cascade=False)
    # Twice: each shape compiles with and without logprobs.
    assert flat.max_step_programs == 2 * flat.buckets.max_programs(cascade=False)
    assert flat.max_step_programs < EngineConfig().max_step_programs


def test_max_step_programs_with_padded_cascade_levels_counts_padded_levels():
    """pad_cascade_levels exists to bound the programs more tightly; the bound says so."""
    padded = EngineConfig(pad_cascade_levels=True)
    assert padded.max_step_programs == 2 * padded.buckets.max_programs(pad_levels=True)
    assert padded.max_step_programs < EngineConfig().max_step_programs


def test_buckets_take_each_minimum_from_its_own_field():
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32, max_model_len=128),
        cache=CacheConfig(block_size=8),
        max_cascade_groups=3,
        min_num_tokens_bucket=16,
        min_num_seqs_bucket=2,
        min_pages_bucket=8,
    )
    b = config.buckets
    assert (b.max_num_tokens, b.max_num_seqs, b.max_pages_per_seq) == (256, 32, 16)
    assert (b.min_num_tokens, b.min_num_seqs, b.min_pages_per_seq) == (16, 2, 8)
    assert b.max_cascade_groups == 3
    assert b.seq_buckets == (2, 4, 8, 16, 32) and b.token_buckets[0] == 16


@pytest.mark.parametrize(
    "block_size, max_model_len, least",
    [(16, 100, 8), (8, 17, 3), (4, 17, 5), (1, 64, 64), (4, 16, 5)],
)
def test_a_pool_too_small_for_one_max_model_len_request_is_refused(
    block_size, max_model_len, least
):
    """A pool that cannot hold one request of max_model_len tokens would refuse every
    request whose output may reach it; the config says so at construction instead. The
    request's last token is never fed back, so its KV is max_model_len - 1 tokens, as the
    scheduler sizes it (17 tokens in blocks of 8 need two blocks; block 0 is the null
    block)."""
    sched = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=max_model_len)
    cache = CacheConfig(num_blocks=least, block_size=block_size)
    assert EngineConfig(cache=cache, scheduler=sched).cache.num_blocks == least
    with pytest.raises(ValueError, match=rf"cache.num_blocks={least - 1} must be at least {least}"):
        EngineConfig(
            cache=CacheConfig(num_blocks=least - 1, block_size=block_size), scheduler=sched
        )


def test_defaults_are_the_documented_ones():
    """Every config field left out takes its documented default (a changed default
    would silently change every engine built without it)."""
    cache, sched, config = CacheConfig(), SchedulerConfig(), EngineConfig()
    assert (cache.num_blocks, cache.block_size, cache.hash_seed, cache.kv_dtype) == (
        256, 16, 0, None,
    )  # fmt: skip
    assert cache.enable_prefix_caching is True and cache.enable_kv_cache_events is False
    assert (sched.max_num_batched_tokens, sched.max_num_seqs, sched.max_model_len) == (512, 64, 512)
    assert sched.enable_chunked_prefill is True and sched.long_prefill_token_threshold == 0
    assert (config.cache, config.scheduler) == (cache, sched)
    assert (config.backend, config.interpret, config.enable_cascade) == (None, False, True)
    assert (config.cascade_cost_model, config.max_cascade_groups) == (None, 8)
    assert (config.min_num_tokens_bucket, config.min_num_seqs_bucket) == (8, 4)
    assert (config.min_pages_bucket, config.q_len_buckets) == (4, None)
    assert (config.pad_cascade_levels, config.seed, config.max_logprobs) == (False, 0, 20)
