"""Frozen, validated configuration of the serving engine: cache, scheduler, engine.

Every config checks its fields on construction, so a config that exists describes an
engine that can be built. Sizes that several parts must agree on (token budget vs. the
largest token bucket, max_model_len vs. blocks per sequence) are derived here once.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.block_pool import MAX_INT32
from jaxkv.buckets import BucketConfig
from jaxkv.cascade_cost import CascadeCostModel
from jaxkv.field_checks import (
    bool_fields,
    increasing_sizes,
    int_fields,
    names_a_dtype,
    positive_int_fields,
)

_KV_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: how many blocks of how many tokens, and prefix caching.

    num_blocks * block_size, the cache's token slots, must fit int32 (at most 2**31)."""

    num_blocks: int = 256  # includes the null block 0
    block_size: int = 16  # tokens per block
    enable_prefix_caching: bool = True
    hash_seed: int = 0  # seed of the chained block hashes
    kv_dtype: str | None = None  # None: the model's dtype; a dtype is kept by name
    # Record BlockStored / BlockRemoved / AllBlocksCleared for Engine.manager.take_events()
    # (vLLM's enable_kv_cache_events). Off, no event is kept. On, they are kept until
    # taken, unbounded, as in vLLM: take them every step or so (see take_events).
    enable_kv_cache_events: bool = False

    def __post_init__(self) -> None:
        # Block ids and token positions are int32 on the device.
        int_fields(self, "num_blocks", "block_size", minimum=1, maximum=MAX_INT32)
        bool_fields(self, "enable_prefix_caching", "enable_kv_cache_events")
        if self.num_blocks < 2:
            raise ValueError(
                f"num_blocks={self.num_blocks!r} must be >= 2 (block 0 is the null block)"
            )
        # A token's KV slot, block_id * block_size + offset, is int32 on the device: past
        # it, the slot wrapped negative and write_kv dropped the token's KV silently.
        if self.num_blocks * self.block_size > MAX_INT32 + 1:
            raise ValueError(
                f"num_blocks={self.num_blocks!r} times block_size={self.block_size!r} must be "
                "at most 2**31 token slots (KV slot ids are int32 on the device)"
            )
        if self.kv_dtype is not None:
            object.__setattr__(self, "kv_dtype", _kv_dtype_name(self.kv_dtype))
        int_fields(self, "hash_seed", minimum=-(2**63), maximum=2**63 - 1)


def _kv_dtype_name(kv_dtype) -> str:
    """One of _KV_DTYPES, given by that name or as a numpy or JAX dtype (np.dtype("float16"),
    jnp.bfloat16), stored by name: a dtype object kept as given compared equal to its name
    but hashed apart. ValueError naming kv_dtype otherwise ("f2", float, an array or a
    scalar value of a listed dtype)."""
    if isinstance(kv_dtype, str):
        name = str(kv_dtype)  # np.str_ too
    elif names_a_dtype(kv_dtype):  # not a value of that dtype (np.float16(1.0), an array)
        try:
            name = np.dtype(kv_dtype).name
        except (TypeError, ValueError):
            name = None
    else:
        name = None
    if name not in _KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r} must be None or one of {_KV_DTYPES}")
    return name


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    max_num_batched_tokens: tokens scheduled in one step (prefill chunks plus decodes).
    max_num_seqs: requests running at once (and so scheduled in one step).
    max_model_len: prompt plus output tokens of one request (at least 2: one of each).
    enable_chunked_prefill: split a prompt over several steps when the budget is short;
    when False a prompt is admitted only once its whole remainder fits the budget.
    long_prefill_token_threshold: the most tokens one request is scheduled in a step
    (vLLM's option of that name): a long prompt then runs in chunks of at most this many,
    leaving the rest of the budget to other prompts. 0 (the default): only the budget
    bounds it. Needs chunked prefill.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 512
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        sizes = ("max_num_batched_tokens", "max_num_seqs", "max_model_len")
        int_fields(self, *sizes, minimum=1, maximum=MAX_INT32)  # int32 on the device
        if self.max_model_len < 2:  # add_request refused every request: none fits
            raise ValueError(
                f"max_model_len={self.max_model_len!r} must be >= 2: a request holds at least "
                "one prompt token and the token it generates"
            )
        bool_fields(self, "enable_chunked_prefill")
        int_fields(self, "long_prefill_token_threshold", minimum=0, maximum=MAX_INT32)
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold!r} splits "
                "prompts into chunks: it needs enable_chunked_prefill=True"
            )
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs={self.max_num_seqs!r} must be <= "
                f"max_num_batched_tokens={self.max_num_batched_tokens!r} "
                "(every scheduled request takes at least one token)"
            )
        # A prompt, or a preempted request's recompute, has at most max_model_len - 1 tokens.
        if not self.enable_chunked_prefill and self.max_model_len - 1 > self.max_num_batched_tokens:
            raise ValueError(
                f"without chunked prefill max_model_len={self.max_model_len!r} must be at most "
                f"one more than max_num_batched_tokens={self.max_num_batched_tokens!r} (a "
                "whole prompt must fit one step)"
            )

    @property
    def max_tokens_per_request(self) -> int:
        """The most tokens one request is scheduled in a step: long_prefill_token_threshold
        (0: no threshold), and never more than max_num_batched_tokens."""
        budget = self.max_num_batched_tokens
        return min(self.long_prefill_token_threshold or budget, budget)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything Engine needs beyond the model.

    backend: attention backend ("xla", "pallas_tpu", "pallas_gpu"); None picks the
    platform default. enable_cascade: plan shared-prefix (cascade) attention when the
    cost model says it pays; `cascade_cost_model` overrides the backend's default.
    The bucket minima bound how many programs compile: with min == max an axis has
    one size. `q_len_buckets` (None: powers of two) coarsens the static bound on one
    sequence's query length (e.g. (1, max_num_batched_tokens) gives decode and
    "anything else"), trading padding for fewer programs; `pad_cascade_levels` pads every
    cascade level to its largest number of sequences (one program per level structure).
    `max_step_programs` is the resulting bound on Engine.num_compiles; a request below
    its SamplingParams.min_tokens adds the shapes of its batches once per power of two
    its stop list (EOS included) rounds up to (jaxkv.min_tokens).
    seed: default sampling seed of requests that give none, 64 bits as SamplingParams.seed
    (mixed with their index, and drawn in a stream of its own: no SamplingParams.seed
    replays an unseeded request).
    max_logprobs: the most SamplingParams.logprobs, and prompt_logprobs, a request may ask
    for (vLLM's default, 20); a batch where a request asks for any computes this many top
    tokens for all of its rows (its prompt rows), in a variant of its step program.
    """

    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    backend: str | None = None
    interpret: bool = False
    enable_cascade: bool = True
    cascade_cost_model: CascadeCostModel | None = None
    max_cascade_groups: int = 8
    min_num_tokens_bucket: int = 8
    min_num_seqs_bucket: int = 4
    min_pages_bucket: int = 4
    q_len_buckets: tuple[int, ...] | None = None
    pad_cascade_levels: bool = False
    seed: int = 0
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        if not isinstance(self.cache, CacheConfig):
            raise ValueError(f"cache={self.cache!r} must be a CacheConfig")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ValueError(f"scheduler={self.scheduler!r} must be a SchedulerConfig")
        int_fields(self, "seed", minimum=-(2**63), maximum=2**64 - 1)
        int_fields(self, "max_logprobs", minimum=0, maximum=2**31 - 1)  # lax.top_k's k: int32
        bool_fields(self, "interpret", "enable_cascade", "pad_cascade_levels")
        if self.cascade_cost_model is not None and not isinstance(
            self.cascade_cost_model, CascadeCostModel
        ):
            raise ValueError(
                f"cascade_cost_model={self.cascade_cost_model!r} must be a CascadeCostModel or None"
            )
        if self.backend not in (None, "xla", "pallas_tpu", "pallas_gpu"):
            raise ValueError(
                f"backend={self.backend!r} must be None, 'xla', 'pallas_tpu' or 'pallas_gpu'"
            )
        positive_int_fields(
            self,
            "max_cascade_groups",
            "min_num_tokens_bucket",
            "min_num_seqs_bucket",
            "min_pages_bucket",
        )
        # As the scheduler sizes a request: its last token's KV is never written.
        max_kv_blocks = -(-(self.scheduler.max_model_len - 1) // self.cache.block_size)
        if self.cache.num_blocks - 1 < max_kv_blocks:
            raise ValueError(
                f"cache.num_blocks={self.cache.num_blocks} must be at least "
                f"{max_kv_blocks + 1}: one request of scheduler.max_model_len="
                f"{self.scheduler.max_model_len} tokens writes the KV of up to "
                f"{self.scheduler.max_model_len - 1} tokens, {max_kv_blocks} blocks of "
                f"{self.cache.block_size}, and block 0 is the null block"
            )
        if self.q_len_buckets is not None:
            qb = increasing_sizes(self.q_len_buckets)
            if not qb:
                raise ValueError(
                    f"q_len_buckets={self.q_len_buckets!r} must be strictly increasing ints >= 1"
                )
            if qb[-1] < self.scheduler.max_num_batched_tokens:
                raise ValueError(
                    f"q_len_buckets={self.q_len_buckets!r} must reach scheduler."
                    f"max_num_batched_tokens={self.scheduler.max_num_batched_tokens!r}"
                )
            object.__setattr__(self, "q_len_buckets", qb)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.scheduler.max_model_len // self.cache.block_size)

    @property
    def buckets(self) -> BucketConfig:
        """Padded sizes of every array that enters the jitted step."""
        s = self.scheduler
        return BucketConfig(
            max_num_tokens=s.max_num_batched_tokens,
            max_num_seqs=s.max_num_seqs,
            max_pages_per_seq=self.max_blocks_per_seq,
            max_cascade_groups=self.max_cascade_groups,
            min_num_tokens=self.min_num_tokens_bucket,
            min_num_seqs=self.min_num_seqs_bucket,
            min_pages_per_seq=self.min_pages_bucket,
        )

    @property
    def max_step_programs(self) -> int:
        """An upper bound on the step programs an Engine with this config compiles
        (Engine.num_compiles), whatever the workload without min_tokens, penalties or
        prompt logprobs:
        BucketConfig.max_programs with this config's q_len_buckets, pad_cascade_levels
        and enable_cascade, twice over (each shape also has the variant that computes
        logprobs). Batches in which a request's stop tokens are banned (before its
        min_tokens) compile those shapes again for each ban width they use: the longest
        banned stop list rounded up to a power of two; batches with penalties, for each
        width of their penalty table (jaxkv.penalties), and batches computing prompt
        logprobs, for each of their row counts (jaxkv.prompt_logprobs), likewise."""
        return 2 * self.buckets.max_programs(
            self.q_len_buckets, pad_levels=self.pad_cascade_levels, cascade=self.enable_cascade
        )
