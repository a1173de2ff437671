"""Plain-jnp ragged paged attention and cascade attention: the contract every kernel follows.

`ragged_paged_attention` is jittable with static shapes (num_seqs is a traced array; no
Python loop over sequences) and returns `(out, lse)`:

- only the first num_seqs sequences are valid; sequence i owns query tokens
  cu_q_lens[i]:cu_q_lens[i+1] and keys 0:kv_lens[i], its queries being the last q_len of
  those kv_len tokens, so query r of the sequence sits at position kv_len - q_len + r;
- causal=True: key j is visible to position p iff j <= p (and j > p - sliding_window);
  causal=False: every key j < kv_len is visible (the prefix pass of cascade attention);
- logits are (q . k) * sm_scale, then soft_cap * tanh(logits / soft_cap) if soft_cap;
- quantized KV (int8, float8_e4m3fn) is read as k.astype(f32) * k_scale, v likewise;
- softmax and the value sum run in float32; out is cast to `out_dtype` (default q.dtype;
  float32 keeps a partial result unrounded for a later LSE merge);
- precision: both dot products run at least in the wider of q's dtype and a float
  cache's (jnp.promote_types), so K, V and the softmax weights are never rounded below
  the cache's dtype; over a quantized cache, in q's dtype (which holds every int8 and
  float8_e4m3fn value exactly). This reference runs them in float32; the Pallas kernels
  in exactly that dtype (kernels_pallas.precision), as JAX's own ragged paged attention
  does over an unquantized cache. Where it is float32 (float32 queries or a float32
  cache: bfloat16 queries over float32 pages too) the kernels match this reference to
  float32 rounding, out_dtype float32 too; where it is bfloat16 or float16 they round
  the softmax weights to it and match to that dtype's tolerance (a few 1e-3 on outputs
  of order 1);
- lse is float32, natural log, [max_num_tokens, num_q_heads]; a row that sees no key and
  every row past cu_q_lens[num_seqs] gives out 0 and lse -inf, never NaN, whatever the
  padding of q, kv_pages or the page table holds.

It is also the XLA backend of jaxkv on the CPU. It reads each sequence's pages once (a
gather to contiguous K/V per sequence) and lays queries out per sequence with at most
`max_q_len` rows, so a non-causal prefix pass holding a whole batch as one sequence reads
the shared pages once.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.merge import merge_attn_states
from kernels_pallas.validation import (
    checks_index_values,
    output_dtype,
    validate_ragged_paged_attention_inputs,
    validate_shared_prefix,
)

_HIGHEST = jax.lax.Precision.HIGHEST


def _dequantize(x: jax.Array, scale: float | None) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * scale if scale is not None else x


@checks_index_values
def ragged_paged_attention(
    q: jax.Array,  # [max_num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    max_q_len: int | None = None,
    out_dtype=None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of each sequence's query tokens over its paged keys; see the module doc.

    `max_q_len` (static) bounds the query length of every valid sequence; it defaults to
    max_num_tokens, which is always safe. A smaller bound saves work and memory (decode:
    1); on concrete arrays a sequence with more query tokens is refused (under jit it
    would get wrong results for the excess).

    Raises ValueError for bad shapes or options (at trace time) and, called on concrete
    arrays, for index values out of range (kernels_pallas.validation).
    """
    validate_ragged_paged_attention_inputs(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, causal=causal, sliding_window=sliding_window,
        soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, out_dtype=out_dtype,
    )  # fmt: skip
    # As jax arrays: numpy would index numpy eagerly and raise for an unread page id.
    q, kv_pages, page_indices = jnp.asarray(q), jnp.asarray(kv_pages), jnp.asarray(page_indices)
    max_num_tokens, num_q_heads, head_dim = q.shape
    max_num_seqs = page_indices.shape[0]
    if max_q_len is not None:
        _check_max_q_len(max_q_len, cu_q_lens, num_seqs)
    q_rows = max_num_tokens if max_q_len is None else min(int(max_q_len), max_num_tokens)

    # Entries past num_seqs are padding with any value (as the kernels read them): make
    # them the last valid offset so the per-token search below sees a sorted array.
    n = num_seqs[0]
    cu_q_lens = jnp.where(
        jnp.arange(max_num_seqs + 1, dtype=jnp.int32) <= n, cu_q_lens, cu_q_lens[n]
    )
    seq_valid = jnp.arange(max_num_seqs, dtype=jnp.int32) < n
    q_start = cu_q_lens[:-1]
    q_len = jnp.where(seq_valid, cu_q_lens[1:] - q_start, 0)
    kv_len = jnp.where(seq_valid, kv_lens, 0)
    masking = dict(causal=causal, sliding_window=sliding_window, soft_cap=soft_cap)
    scales = dict(sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)

    # Two layouts with the same result. Per sequence: each sequence's pages are gathered
    # once and its queries padded to q_rows, best when few sequences hold many tokens (a
    # prefix pass) or every sequence holds one (decode). Per token: each token gathers
    # its own sequence's keys, best for mixed batches where padding every sequence to
    # the longest query would waste more than re-reading keys per token.
    if max_num_seqs * q_rows <= 2 * max_num_tokens:
        out, lse = _per_sequence(
            q, kv_pages, page_indices, q_start, q_len, kv_len, q_rows, **masking, **scales
        )
    else:
        out, lse = _per_token(
            q, kv_pages, page_indices, q_start, q_len, kv_len, **masking, **scales
        )
    tok = jnp.arange(max_num_tokens, dtype=jnp.int32)
    valid = tok < cu_q_lens[num_seqs[0]]
    out = jnp.where(valid[:, None, None], out, 0.0)
    lse = jnp.where(valid[:, None], lse, -jnp.inf)
    return out.astype(output_dtype(q, out_dtype)), lse


def _check_max_q_len(max_q_len, cu_q_lens, num_seqs) -> None:
    """ValueError unless max_q_len is an int >= 1 and, on concrete arrays, bounds every
    valid sequence's query length (rows past it would silently get no attention)."""
    if not isinstance(max_q_len, (int, np.integer)) or isinstance(max_q_len, bool):
        raise ValueError(f"{max_q_len=} must be an int >= 1 or None")
    if max_q_len < 1:
        raise ValueError(f"{max_q_len=} must be >= 1 or None")
    if isinstance(cu_q_lens, jax.core.Tracer) or isinstance(num_seqs, jax.core.Tracer):
        return
    n = int(np.asarray(num_seqs)[0])
    q_lens = np.diff(np.asarray(cu_q_lens)[: n + 1].astype(np.int64))
    if q_lens.size and q_lens.max() > max_q_len:
        i = int(q_lens.argmax())
        raise ValueError(f"sequence {i} has {q_lens[i]} query tokens, more than {max_q_len=}")


def _softmax_pv(logits, visible, v, spec_pv: str):
    """Masked softmax of logits [..., keys] and its product with v: (out, lse), f32."""
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.where(visible, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(probs, axis=-1)
    seen = denom != 0  # NaN (from NaN or inf data) must not read as "no keys"
    safe = jnp.where(seen, denom, 1.0)
    lse = jnp.where(seen, row_max[..., 0] + jnp.log(safe), -jnp.inf)
    return jnp.einsum(spec_pv, probs / safe[..., None], v, precision=_HIGHEST), lse


def _cap(logits, soft_cap):
    return logits if soft_cap is None else soft_cap * jnp.tanh(logits / soft_cap)


def _visibility(key_pos, q_pos, kv_len, causal, sliding_window):
    visible = key_pos < kv_len
    if causal:
        visible &= key_pos <= q_pos
    if sliding_window is not None:
        visible &= key_pos > q_pos - sliding_window
    return visible


def _keys_values(kv, key_valid, k_scale, v_scale):
    """Dequantized K and V with keys past kv_len zeroed (padding may hold NaN)."""
    mask = key_valid[..., None, None]
    k = jnp.where(mask, _dequantize(kv[..., 0::2, :], k_scale), 0.0)
    v = jnp.where(mask, _dequantize(kv[..., 1::2, :], v_scale), 0.0)
    return k, v


def _per_sequence(
    q, kv_pages, page_indices, q_start, q_len, kv_len, q_rows, *,
    causal, sliding_window, soft_cap, sm_scale, k_scale, v_scale,
):  # fmt: skip
    max_num_tokens, num_q_heads, head_dim = q.shape
    num_combined = kv_pages.shape[2]
    num_kv_heads = num_combined // 2
    group = num_q_heads // num_kv_heads
    max_num_seqs, pages_per_seq = page_indices.shape
    max_kv_len = pages_per_seq * kv_pages.shape[1]

    row = jnp.arange(q_rows, dtype=jnp.int32)
    row_valid = row[None, :] < q_len[:, None]
    token = jnp.clip(q_start[:, None] + row[None, :], 0, max_num_tokens - 1)
    qs = jnp.where(row_valid[..., None, None], q[token].astype(jnp.float32), 0.0)
    qs = qs.reshape(max_num_seqs, q_rows, num_kv_heads, group, head_dim)

    kv = kv_pages[page_indices].reshape(max_num_seqs, max_kv_len, num_combined, head_dim)
    key_pos = jnp.arange(max_kv_len, dtype=jnp.int32)
    k, v = _keys_values(kv, key_pos[None, :] < kv_len[:, None], k_scale, v_scale)

    logits = jnp.einsum("sqhgd,skhd->shgqk", qs, k, precision=_HIGHEST) * sm_scale
    logits = _cap(logits, soft_cap)
    q_pos = (kv_len - q_len)[:, None] + row[None, :]  # [S, q_rows]
    visible = _visibility(
        key_pos[None, None, :], q_pos[:, :, None], kv_len[:, None, None], causal, sliding_window
    )
    visible &= row_valid[:, :, None]
    out_s, lse_s = _softmax_pv(logits, visible[:, None, None], v, "shgqk,skhd->sqhgd")
    out_s = out_s.reshape(max_num_seqs, q_rows, num_q_heads, head_dim)
    lse_s = lse_s.transpose(0, 3, 1, 2).reshape(max_num_seqs, q_rows, num_q_heads)

    tok = jnp.arange(max_num_tokens, dtype=jnp.int32)
    tok_seq = jnp.clip(jnp.searchsorted(q_start[1:], tok, side="right"), 0, max_num_seqs - 1)
    tok_row = tok - q_start[tok_seq]
    in_rows = (tok_row >= 0) & (tok_row < q_rows)
    tok_row = jnp.clip(tok_row, 0, q_rows - 1)
    out = jnp.where(in_rows[:, None, None], out_s[tok_seq, tok_row], 0.0)
    lse = jnp.where(in_rows[:, None], lse_s[tok_seq, tok_row], -jnp.inf)
    return out, lse


def _per_token(
    q, kv_pages, page_indices, q_start, q_len, kv_len, *,
    causal, sliding_window, soft_cap, sm_scale, k_scale, v_scale,
):  # fmt: skip
    max_num_tokens, num_q_heads, head_dim = q.shape
    num_combined = kv_pages.shape[2]
    num_kv_heads = num_combined // 2
    group = num_q_heads // num_kv_heads
    max_num_seqs, pages_per_seq = page_indices.shape
    max_kv_len = pages_per_seq * kv_pages.shape[1]

    tok = jnp.arange(max_num_tokens, dtype=jnp.int32)
    tok_seq = jnp.clip(jnp.searchsorted(q_start[1:], tok, side="right"), 0, max_num_seqs - 1)
    seq_kv_len = kv_len[tok_seq]
    row = tok - q_start[tok_seq]
    tok_valid = (row >= 0) & (row < q_len[tok_seq])
    q_pos = seq_kv_len - q_len[tok_seq] + row
    kv = kv_pages[page_indices[tok_seq]].reshape(max_num_tokens, max_kv_len, num_combined, head_dim)
    key_pos = jnp.arange(max_kv_len, dtype=jnp.int32)
    k, v = _keys_values(kv, key_pos[None, :] < seq_kv_len[:, None], k_scale, v_scale)
    qs = q.astype(jnp.float32).reshape(max_num_tokens, num_kv_heads, group, head_dim)
    qs = jnp.where(tok_valid[:, None, None, None], qs, 0.0)  # padding rows may hold NaN
    logits = jnp.einsum("thgd,tkhd->thgk", qs, k, precision=_HIGHEST) * sm_scale
    logits = _cap(logits, soft_cap)
    visible = _visibility(
        key_pos[None, :], q_pos[:, None], seq_kv_len[:, None], causal, sliding_window
    )
    visible &= tok_valid[:, None]
    out, lse = _softmax_pv(logits, visible[:, None, None], v, "thgk,tkhd->thgd")
    return out.reshape(max_num_tokens, num_q_heads, head_dim), lse.reshape(max_num_tokens, -1)


AttentionFn = Callable[..., tuple[jax.Array, jax.Array]]


def prefix_pass_inputs(
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs: jax.Array,  # i32[1]
    prefix_pages: jax.Array,  # i32[pages_per_seq]
    prefix_len: jax.Array | int,  # i32[] tokens in the shared prefix
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(kv_lens, page_indices, cu_q_lens, num_seqs) of one sequence holding every query
    token, over prefix_len keys; over none when there is no query token (then no row
    needs them, and the prefix pages may be padding)."""
    num_tokens = cu_q_lens[num_seqs[0]]
    kv_lens = jnp.where(num_tokens > 0, jnp.asarray(prefix_len, jnp.int32), 0).reshape(1)
    cu = jnp.stack([jnp.int32(0), num_tokens.astype(jnp.int32)])
    return kv_lens, prefix_pages[None, :].astype(jnp.int32), cu, jnp.ones((1,), jnp.int32)


def suffix_page_indices(
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq]
    num_prefix_pages: jax.Array | int,  # i32[]
) -> jax.Array:
    """Each row shifted left by num_prefix_pages columns, the freed tail pointing at page 0."""
    pages_per_seq = page_indices.shape[1]
    col = jnp.arange(pages_per_seq, dtype=jnp.int32) + num_prefix_pages
    shifted = jnp.take(page_indices, jnp.clip(col, 0, pages_per_seq - 1), axis=1)
    return jnp.where(col[None, :] < pages_per_seq, shifted, 0).astype(jnp.int32)


def cascade_attention(
    q: jax.Array,  # [max_num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[max_num_seqs] whole context length per sequence
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq] whole block table per sequence
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs: jax.Array,  # i32[1]
    num_prefix_pages: jax.Array | int,  # i32[] pages shared by every valid sequence
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    attention_fn: AttentionFn | None = None,
    max_q_len: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Cascade attention for one group whose sequences all start with the same pages.

    Precondition (the planner's cap): every sequence's first query position is at or past
    the shared prefix, i.e. kv_lens - q_lens >= num_prefix_pages * page_size, so the
    non-causal prefix pass never shows a query a key after itself. Then the result equals
    plain causal attention over each whole context. Called on concrete arrays, raises
    ValueError unless that precondition holds and every sequence with query tokens holds
    sequence 0's first num_prefix_pages pages (validation.validate_shared_prefix).
    `attention_fn` is any kernel with the contract of `ragged_paged_attention` (default:
    this module's, with `max_q_len`; refused with an `attention_fn`, which would not see
    it); both passes return float32 and the merged result is rounded to q.dtype once.
    A Python int `num_prefix_pages` splits the page table statically: each pass gets only
    its own columns, so a kernel whose work follows the padded width does less of it.
    """
    if attention_fn is not None and max_q_len is not None:  # it would go unused
        raise ValueError(
            f"{max_q_len=} applies to the default attention_fn only: bind it into the "
            "attention_fn given"
        )
    validate_shared_prefix(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, num_prefix_pages
    )
    if attention_fn is None:
        prefix_fn = ragged_paged_attention
        suffix_fn = lambda *a, **kw: ragged_paged_attention(*a, **kw, max_q_len=max_q_len)
    else:
        prefix_fn = suffix_fn = attention_fn
    page_size = kv_pages.shape[1]
    prefix_len = jnp.asarray(num_prefix_pages, jnp.int32) * page_size
    # Both partial results stay float32 until after the merge: one rounding to q.dtype.
    common = dict(
        sm_scale=sm_scale, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
        out_dtype=jnp.float32,
    )  # fmt: skip
    pages_per_seq = page_indices.shape[1]
    if isinstance(num_prefix_pages, int) and 0 < num_prefix_pages < pages_per_seq:
        # A static split: each pass gets only its own columns (narrower padded pages).
        prefix_pages = page_indices[0, :num_prefix_pages]
        suffix_pages = page_indices[:, num_prefix_pages:]
    else:
        prefix_pages = page_indices[0]
        suffix_pages = suffix_page_indices(page_indices, num_prefix_pages)
    out_p, lse_p = prefix_fn(
        q,
        kv_pages,
        *prefix_pass_inputs(cu_q_lens, num_seqs, prefix_pages, prefix_len),
        causal=False,
        **common,
    )
    out_s, lse_s = suffix_fn(
        q,
        kv_pages,
        jnp.maximum(kv_lens - prefix_len, 0),
        suffix_pages,
        cu_q_lens,
        num_seqs,
        causal=True,
        **common,
    )
    out, lse = merge_attn_states(out_p, lse_p, out_s, lse_s)
    return out.astype(q.dtype), lse
