"""Random scheduled batches with shared-prefix structure, built through the real manager.

A World holds a KVCacheManager with requests under a few system prompts; some of them
are scheduled this step (prefill chunks after a cache hit, or one decode token), others
hold blocks without being scheduled (finished and still transferring, running but not
scheduled). The oracle reads each request's block ids straight from the manager, never
from the metadata under test.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv import KVCacheManager, Request
from jaxkv.batch import AttentionMetadata, build_attention_metadata
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import CascadePlan


@dataclasses.dataclass
class Step:
    """One scheduled batch: ids in scheduler order, tokens already cached, tokens scheduled."""

    manager: KVCacheManager
    request_ids: list[str]
    num_computed_tokens: np.ndarray  # i[R]
    query_lens: np.ndarray  # i[R]

    def metadata(self, plan: CascadePlan, buckets: BucketConfig) -> AttentionMetadata:
        """The step's attention metadata for `plan` (batch in plan order), built from the
        manager's block table as the engine builds it."""
        return build_attention_metadata(
            block_table=self.manager.block_table,
            plan=plan,
            query_lens=self.query_lens[plan.order],
            num_computed_tokens=self.num_computed_tokens[plan.order],
            block_size=self.manager.block_size,
            buckets=buckets,
        )


def allocate_after_hit(manager: KVCacheManager, request: Request, chunk: int | None = None) -> int:
    """Cache hit plus an allocation of `chunk` more tokens (default: the rest of the
    request); returns tokens cached before. request.num_computed_tokens is left as it was."""
    blocks, num_hit = manager.get_computed_blocks(request)
    chunk = request.num_tokens - num_hit if chunk is None else chunk
    got = manager.allocate_slots(
        request, chunk, num_new_computed_tokens=num_hit, new_computed_blocks=blocks
    )
    assert got is not None, "test pool too small"
    return num_hit


def _admit(manager: KVCacheManager, request: Request, chunk: int | None = None) -> int:
    """allocate_after_hit, then the request has computed the hit's tokens."""
    request.num_computed_tokens = num_hit = allocate_after_hit(manager, request, chunk)
    return num_hit


def random_step(
    seed: int,
    *,
    block_size: int,
    max_requests: int = 10,
    max_prompt_blocks: int = 6,
    num_blocks: int = 512,
    max_model_len: int = 256,
    common_root_blocks: int = 0,
) -> Step:
    """A random batch; every request's context fits max_model_len.

    With common_root_blocks > 0 every system prompt starts with the same root blocks
    and every request has a system prompt, and an unscheduled holder has computed each
    prompt before, so the batch shares a global prefix and per-prompt group prefixes.
    """
    rng = np.random.default_rng(seed)
    manager = KVCacheManager(num_blocks, block_size, max_model_len=max_model_len)
    num_prompts = int(rng.integers(1, 4))
    root = list(rng.integers(3000, 4000, common_root_blocks * block_size))
    prompts = [
        root + list(rng.integers(0, 1000, int(rng.integers(1, max_prompt_blocks + 1)) * block_size))
        for _ in range(num_prompts)
    ]
    if common_root_blocks:
        for j, prompt in enumerate(prompts):
            _admit(manager, Request(f"warm{j}", [int(t) for t in prompt] + [1]))
    scheduled, computed, query = [], [], []
    num_requests = int(rng.integers(1, max_requests + 1))
    num_holders = int(rng.integers(0, 4))
    for i in range(num_requests + num_holders):
        with_prompt = common_root_blocks > 0 or rng.random() < 0.85
        prefix = prompts[int(rng.integers(num_prompts))] if with_prompt else []
        own = list(rng.integers(1000, 2000, int(rng.integers(1, 3 * block_size))))
        request = Request(f"r{i}", [int(t) for t in prefix + own])
        is_holder = i >= num_requests
        if is_holder or rng.random() < 0.5:
            # Fully computed; scheduled requests then decode one token.
            _admit(manager, request)
            request.num_computed_tokens = request.num_tokens
            if is_holder:
                continue
            request.append_output_token_ids([int(rng.integers(0, 1000))])
            assert manager.allocate_slots(request, 1) is not None
            scheduled.append(request.request_id)
            computed.append(request.num_tokens - 1)
            query.append(1)
        else:
            blocks, num_hit = manager.get_computed_blocks(request)
            remaining = request.num_tokens - num_hit
            chunk = int(rng.integers(1, remaining + 1))
            _admit(manager, request, chunk)
            scheduled.append(request.request_id)
            computed.append(num_hit)
            query.append(chunk)
    return Step(manager, scheduled, np.array(computed), np.array(query))


def dense_oracle(
    step: Step,
    order: np.ndarray,  # i[R] batch position -> scheduled index
    q: np.ndarray,  # f[T, Hq, D] query tokens in batch order
    kv_pages: np.ndarray,  # f[num_blocks, block_size, 2 * Hkv, D]
    sm_scale: float,
) -> np.ndarray:
    """f64[num_valid_tokens, Hq, D]: causal softmax attention over each whole context."""
    return dense_attention(step, order, q, kv_pages, sm_scale)[0]


def dense_attention(
    step: Step,
    order: np.ndarray,  # i[R] batch position -> scheduled index
    q: np.ndarray,  # f[T, Hq, D] query tokens in batch order
    kv_pages: np.ndarray,  # f[num_blocks, block_size, 2 * Hkv, D]
    sm_scale: float,
    *,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(out f64[num_valid_tokens, Hq, D], lse f64[num_valid_tokens, Hq]): causal softmax
    attention over each whole context, rebuilt key by key from the manager's block ids;
    lse is the natural log of the softmax denominator of the scaled (then soft-capped)
    logits. A sliding window shows position p the keys j with p - window < j <= p."""
    block_size = step.manager.block_size
    outs, lses = [], []
    token = 0
    for index in order:
        rid = step.request_ids[index]
        num_computed, q_len = int(step.num_computed_tokens[index]), int(step.query_lens[index])
        kv_len = num_computed + q_len
        blocks = step.manager.block_ids(rid)
        rows = np.stack([kv_pages[blocks[j // block_size], j % block_size] for j in range(kv_len)])
        k = rows[:, 0::2].astype(np.float64)
        v = rows[:, 1::2].astype(np.float64)
        group = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        qs = q[token : token + q_len].astype(np.float64)
        token += q_len
        logits = np.einsum("qhd,khd->hqk", qs, k) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        key_pos, q_pos = np.arange(kv_len)[None, :], (num_computed + np.arange(q_len))[:, None]
        visible = key_pos <= q_pos
        if sliding_window is not None:
            visible &= key_pos > q_pos - sliding_window
        logits = np.where(visible[None], logits, -np.inf)
        row_max = logits.max(-1, keepdims=True)  # finite: every query sees its own key
        p = np.exp(logits - row_max)
        denom = p.sum(-1, keepdims=True)
        outs.append(np.einsum("hqk,khd->qhd", p / denom, v))
        lses.append((row_max + np.log(denom))[..., 0].T)
    return np.concatenate(outs), np.concatenate(lses)
