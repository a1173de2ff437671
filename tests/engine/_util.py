"""Shared pieces of the end-to-end engine tests: one tiny model, fixed buckets, the oracle.

Every engine built here uses the same bucket sizes, so all tests share a handful of
compiled step programs (one per cascade level structure).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.cascade import CascadeCostModel
from jaxkv.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxkv.engine import Engine
from jaxkv.models import Llama, LlamaConfig

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
MAX_TOKENS_PER_STEP = 64
MAX_SEQS = 8
VOCAB = 256
ORACLE_BATCH = 8
# Two cache sizes only (the cache shape is part of every compiled program): roomy, and
# tight enough to force preemption and device-cache eviction.
ROOMY_BLOCKS = 96
TIGHT_BLOCKS = 24
MIN_MARGIN = 2e-5  # smallest top-2 logit gap the oracle accepts; logits have std ~0.16, and
# the attention paths differ by ~1e-6, so a smaller gap could let float noise pick the token

# Cascade whenever two or more requests share a block: the tests must exercise it.
ALWAYS_CASCADE = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0.0)


@functools.cache
def tiny_model() -> Llama:
    """2 layers, hidden 64, vocab 256, random weights (untied head: varied greedy text)."""
    config = LlamaConfig.preset(
        "tiny",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=MAX_MODEL_LEN,
    )
    return Llama(config, rngs=nnx.Rngs(0))


def make_engine(*, connector=None, **config_args) -> Engine:
    """An engine over tiny_model() with engine_config(**config_args)."""
    return Engine(tiny_model(), None, engine_config(**config_args), connector=connector)


def engine_config(
    *,
    cascade: bool = True,
    prefix_caching: bool = True,
    num_blocks: int = ROOMY_BLOCKS,
    max_num_seqs: int = MAX_SEQS,
    max_num_batched_tokens: int = MAX_TOKENS_PER_STEP,
    long_prefill_token_threshold: int = 0,
) -> EngineConfig:
    """The engine tests' config. A smaller max_num_batched_tokens chunks prefills but
    keeps the token bucket (and so the compiled programs) of the default."""
    assert num_blocks in (ROOMY_BLOCKS, TIGHT_BLOCKS), "keep the number of programs small"
    return EngineConfig(
        cache=CacheConfig(
            num_blocks=num_blocks, block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            max_num_seqs=max_num_seqs,
            max_model_len=MAX_MODEL_LEN,
        ),
        backend="xla",
        enable_cascade=cascade,
        cascade_cost_model=ALWAYS_CASCADE,
        max_cascade_groups=2,
        min_num_tokens_bucket=MAX_TOKENS_PER_STEP,
        min_num_seqs_bucket=MAX_SEQS,
        min_pages_bucket=MAX_MODEL_LEN // BLOCK_SIZE,
        q_len_buckets=(MAX_TOKENS_PER_STEP,),
        pad_cascade_levels=True,
    )


@functools.cache
def _dense_logits():
    graphdef, state = nnx.split(tiny_model())

    @jax.jit
    def last_logits(tokens, lengths):  # i32[B, L], i32[B] -> f32[B, vocab]
        logits = nnx.merge(graphdef, state).dense_forward(tokens)
        return logits[jnp.arange(tokens.shape[0]), lengths - 1]

    return last_logits


def dense_greedy(prompts, max_tokens) -> list[list[int]]:
    """Greedy continuations by the dense model, recomputing whole sequences every token.

    Asserts the top-2 logit gap stays above MIN_MARGIN, so a mismatch with the engine is
    a wrong result, not float noise deciding a tie.
    """
    return dense_decode(prompts, max_tokens)[0]


def dense_decode(prompts, max_tokens, stops=None, min_tokens=None):
    """(tokens, logprobs): greedy continuations by the dense model as the engine's
    SamplingParams define them, and f64[num_tokens, VOCAB] log_softmax rows of the raw
    logits each token was picked from, one list per prompt.

    A prompt stops after max_tokens, or at a token of its `stops` once it has more than
    its `min_tokens` tokens; before that its stop tokens are excluded from the argmax.
    The top-2 gap among the allowed tokens must exceed MIN_MARGIN (as dense_greedy).
    """
    num = len(prompts)
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * num
    stops = [()] * num if stops is None else stops
    min_tokens = [0] * num if min_tokens is None else min_tokens
    tokens: list[list[int]] = []
    logprobs: list[list[np.ndarray]] = []
    for start in range(0, num, ORACLE_BATCH):
        chunk = [list(p) for p in prompts[start : start + ORACLE_BATCH]]
        part = slice(start, start + len(chunk))
        limits, stop, floor = max_tokens[part], stops[part], min_tokens[part]
        seqs = chunk + [[0]] * (ORACLE_BATCH - len(chunk))
        gen: list[list[int]] = [[] for _ in chunk]
        rows: list[list[np.ndarray]] = [[] for _ in chunk]
        done = [limit == 0 for limit in limits]
        while not all(done):
            batch = np.zeros((ORACLE_BATCH, MAX_MODEL_LEN), np.int32)
            lengths = np.array([len(s) for s in seqs], np.int32)
            for i, s in enumerate(seqs):
                batch[i, : len(s)] = s
            logits = np.asarray(_dense_logits()(batch, lengths), np.float64)
            for i in range(len(chunk)):
                if done[i]:
                    continue
                allowed = logits[i].copy()
                if len(gen[i]) < floor[i]:
                    allowed[list(stop[i])] = -np.inf
                top2 = np.sort(allowed)[-2:]
                assert top2[1] - top2[0] > MIN_MARGIN, "oracle near-tie: pick a new seed"
                t = int(np.argmax(allowed))
                z = logits[i] - logits[i].max()
                rows[i].append(z - np.log(np.exp(z).sum()))
                gen[i].append(t)
                seqs[i] = seqs[i] + [t]
                done[i] = len(gen[i]) >= limits[i] or t in stop[i]
        tokens.extend(gen)
        logprobs.extend(rows)
    return tokens, logprobs


def dense_logits(seqs) -> np.ndarray:
    """f32[len(seqs), VOCAB]: the dense model's logits after each whole sequence (no
    paging, no cache: the full sequence recomputed)."""
    rows = []
    for start in range(0, len(seqs), ORACLE_BATCH):
        chunk = [list(s) for s in seqs[start : start + ORACLE_BATCH]]
        tokens = np.zeros((ORACLE_BATCH, MAX_MODEL_LEN), np.int32)
        lengths = np.ones(ORACLE_BATCH, np.int32)
        for i, s in enumerate(chunk):
            tokens[i, : len(s)], lengths[i] = s, len(s)
        rows.append(np.asarray(_dense_logits()(tokens, lengths))[: len(chunk)])
    return np.concatenate(rows) if rows else np.zeros((0, VOCAB), np.float32)


def prompts_for(workload: str, seed: int = 1) -> list[list[int]]:
    """Prompts of one shape: "shared" prefix, "two_groups", or "none" shared."""
    rng = np.random.default_rng(seed)
    rand = lambda n: rng.integers(0, VOCAB, n).tolist()
    if workload == "shared":
        prefix = rand(20)
        return [prefix + rand(int(n)) for n in rng.integers(1, 6, 6)]
    if workload == "two_groups":
        pa, pb = rand(16), rand(13)
        return [p + rand(int(n)) for p in (pa, pb) for n in rng.integers(1, 6, 3)]
    if workload == "none":
        return [rand(int(n)) for n in rng.integers(3, 24, 6)]
    raise ValueError(workload)


def assert_all_blocks_free(engine: Engine) -> None:
    m = engine.manager
    m.check_integrity()
    assert m.num_free_blocks == m.pool.num_blocks - 1, f"{m.num_free_blocks=} blocks leaked"
    assert m.request_ids == []


def recording_orders(engine) -> list:
    """The batch order (None: schedule order) of every step `engine` runs from now: wraps
    its _step_inputs."""
    orders, build = [], engine._step_inputs

    def recording(out, plan):
        inputs = build(out, plan)
        orders.append(inputs[0])
        return inputs

    engine._step_inputs = recording
    return orders
