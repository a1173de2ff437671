"""The body of the GPU (Pallas Triton) ragged paged attention kernel: one program.

The wrapper that checks the arguments, picks the tiling, calls it and merges KV splits
is `kernels_pallas.gpu.ragged_paged_attention`; its contract is the one of
`kernels_pallas.reference.ragged_paged_attention`.

Layout of the work: grid (query block, KV head, KV split). A query block holds up to
`block_m` rows, each row one (token, query head) pair of one sequence and of one KV
head's group of query heads (GQA packs the group into the rows, so every K/V page is
read once per group, not once per query head). Blocks never straddle two sequences:
sequence i owns blocks cu_q_lens[i] // tokens_per_block + i onward, and each program
finds its sequence by binary search over cu_q_lens (kernels_pallas.gpu.block_schedule,
which also bounds the key blocks each program reads). Keys are walked `block_k` at a time
(each key's page looked up in the page table, so any page size works) with an online
softmax in float32 (base 2: each score's row max is subtracted before it is scaled by
log2(e), so any logit finite in float32 stays finite). With more than one KV split each
split covers a contiguous slice of the key blocks, writes its normalized output and LSE
in float32, and the wrapper merges the splits through their LSEs, so a small decode
batch still fills the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.gpu.block_schedule import block_rows, block_tokens, key_block_range, split_range
from kernels_pallas.scales import LOG2E  # the factor check_folded_scales bounds


def paged_attention_kernel(
    # Scalars and tables (whole arrays in global memory)
    cu_q_lens_ref,  # i32[max_num_seqs + 1]
    kv_lens_ref,  # i32[max_num_seqs]
    page_indices_ref,  # i32[max_num_seqs, pages_per_seq]
    num_seqs_ref,  # i32[1]
    # Input
    q_ref,  # [max_num_tokens * num_q_heads, head_dim]
    k_ref,  # [num_pages, page_size, head_dim] this program's KV head, keys
    v_ref,  # [num_pages, page_size, head_dim] this program's KV head, values
    # Output
    o_ref,  # [max_num_tokens * num_q_heads + block_m, head_dim] this program's KV split
    lse_ref,  # f32[max_num_tokens * num_q_heads + block_m] this program's KV split
    *,
    sm_scale: float,
    causal: bool,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale: float | None,
    v_scale: float | None,
    block_m: int,
    block_k: int,
    num_kv_splits: int,
    group: int,
    num_q_heads: int,
    max_num_seqs: int,
    num_tokens: int,
    compute_dtype,
    precision,
):
    """One program (query block, KV head, KV split): its rows' normalized output and LSE
    over its split's keys. A row that sees no key gets out 0 and lse -inf; a row of no
    valid (token, query head) is not stored."""
    pid_q, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_pages, page_size, head_dim = k_ref.shape
    pages_per_seq = page_indices_ref.shape[1]
    tokens_per_block = block_m // group

    num_seqs = num_seqs_ref[0]
    seq, tok0, tok_end = block_tokens(
        cu_q_lens_ref, num_seqs, pid_q, tokens_per_block=tokens_per_block, max_num_seqs=max_num_seqs
    )
    q_end = cu_q_lens_ref[seq + 1]
    kv_len = kv_lens_ref[seq]

    r = jnp.arange(block_m, dtype=jnp.int32)
    tok, row_valid = block_rows(tok0, tok_end, block_m=block_m, group=group)
    row = tok * num_q_heads + kv_head * group + r % group
    q_row = jnp.where(row_valid, row, 0)
    # Masked-off rows still need distinct in-bounds indices (a masked store in interpret
    # mode rewrites their old values): the block_m spare rows past the real ones.
    row = jnp.where(row_valid, row, num_q_heads * num_tokens + r)
    pos = tok + (kv_len - q_end)  # i32[block_m]

    # Keys any row of this block may see, as a range of key blocks, then this split's part.
    kb_lo, kb_hi = key_block_range(
        q_end, kv_len, tok0, tok_end, block_k=block_k, causal=causal, sliding_window=sliding_window
    )
    split_lo, split_hi = split_range(kb_lo, kb_hi, split, num_kv_splits=num_kv_splits)

    col = jnp.arange(head_dim, dtype=jnp.int32)
    q = plgpu.load(q_ref.at[q_row[:, None], col[None, :]], mask=row_valid[:, None], other=0)
    q = q.astype(compute_dtype)
    logit_scale = sm_scale * (1.0 if k_scale is None else k_scale)
    # Scores stay in units whose max is subtracted before they are scaled to base 2 (the
    # q.k dot, or its tanh with a soft cap): scaling first took a logit past
    # float32 max / log2(e) (about 2.36e38) to inf, and the row to NaN or no key, where
    # the reference is finite. (s - max) * scale is as many ops as s * scale - max.
    to_natural = logit_scale if soft_cap is None else soft_cap  # natural logit per unit
    to_base2 = to_natural * LOG2E

    def body(kb, carry):
        acc, m_prev, l_prev = carry
        key = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)
        key_valid = key < kv_len
        # Page of every key; keys past kv_len use the null page 0 and are masked below. The
        # clamps keep every address inside the arrays even for out-of-contract tables.
        slot = jnp.where(key_valid, jnp.minimum(key // page_size, pages_per_seq - 1), 0)
        page = jnp.where(key_valid, page_indices_ref[seq, slot], 0)
        page = jnp.minimum(jnp.maximum(page, 0), num_pages - 1)
        idx = (page[:, None], (key % page_size)[:, None], col[None, :])
        # Slots past kv_len may hold anything (NaN included), and 0 * NaN in the value sum
        # would leak into acc: they load as 0 (a predicated load, no select).
        kv_mask = key_valid[:, None]
        zero = jnp.zeros((), k_ref.dtype)
        k = plgpu.load(k_ref.at[idx], mask=kv_mask, other=zero).astype(compute_dtype)
        v = plgpu.load(v_ref.at[idx], mask=kv_mask, other=zero).astype(compute_dtype)

        s = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        if soft_cap is not None:
            s = jnp.tanh(s * (logit_scale / soft_cap))
        visible = key_valid[None, :]
        if causal:
            visible = visible & (key[None, :] <= pos[:, None])
        if sliding_window is not None:
            visible = visible & (key[None, :] > pos[:, None] - sliding_window)
        s = jnp.where(visible, s, -jnp.inf)

        m_next = jnp.maximum(m_prev, s.max(axis=-1))
        # The max stays -inf until a row sees a key; shifting by 0 then keeps exp2 off
        # -inf + inf. (A finite start would hide every key whose logits all lie below it.)
        shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        alpha = jnp.exp2((m_prev - shift) * to_base2)
        p = jnp.exp2((s - shift[:, None]) * to_base2)
        l_next = l_prev * alpha + p.sum(axis=-1)
        pv = jax.lax.dot_general(
            p.astype(compute_dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        return acc * alpha[:, None] + pv, m_next, l_next

    acc = jnp.zeros((block_m, head_dim), jnp.float32)
    m = jnp.full((block_m,), -jnp.inf, jnp.float32)
    denom = jnp.zeros((block_m,), jnp.float32)
    acc, m, denom = jax.lax.fori_loop(split_lo, split_hi, body, (acc, m, denom))

    seen = denom != 0  # NaN (from NaN or inf data) must not read as "no keys"
    l_safe = jnp.where(seen, denom, 1.0)
    out = acc * ((1.0 if v_scale is None else v_scale) / l_safe)[:, None]
    lse = jnp.where(seen, m * to_natural + jnp.log(l_safe), -jnp.inf)
    o_idx = (row[:, None], col[None, :])
    plgpu.store(o_ref.at[o_idx], out.astype(o_ref.dtype), mask=row_valid[:, None])
    plgpu.store(lse_ref.at[row], lse, mask=row_valid)
