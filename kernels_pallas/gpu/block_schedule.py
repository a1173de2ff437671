"""Which query tokens and key blocks one program of the GPU kernel covers.

Scalar index arithmetic on the kernel's tables (refs inside the kernel; any int32 array
indexable by a traced scalar outside it, which is how the tests check it against a walk
over every token and key). The rows a program stores must be exactly its own (a row of
another sequence's token would race with that sequence's program on a GPU, where the
interpreter runs programs in order and hides it), and its key blocks must cover every key
its rows see (or rows lose keys) and should cover nothing more (or it loads and
multiplies keys for nothing).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def find_seq(cu_q_lens, num_seqs, pid, *, tokens_per_block: int, max_num_seqs: int):
    """Largest valid i with cu_q_lens[i] // tokens_per_block + i <= pid (0 if none): the
    sequence whose query blocks hold block `pid`, sequence i owning the blocks from
    cu_q_lens[i] // tokens_per_block + i on, so that no block holds two sequences. A
    binary search with a static trip count, the fewest that tell max_num_seqs (>= 1)
    outcomes apart."""

    def first_block(i):
        return cu_q_lens[i] // tokens_per_block + i

    def body(_, carry):
        lo, hi = carry  # invariant: first_block(lo) <= pid, answer < hi
        mid = (lo + hi) // 2
        ok = first_block(mid) <= pid
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    num_steps = math.ceil(math.log2(max_num_seqs))  # each step halves [lo, hi)
    hi = jnp.maximum(num_seqs, 1)
    lo, _ = jax.lax.fori_loop(0, num_steps, body, (jnp.int32(0), hi))
    return lo


def block_tokens(cu_q_lens, num_seqs, pid, *, tokens_per_block: int, max_num_seqs: int):
    """(seq, tok0, tok_end): block `pid` holds the query tokens [tok0, tok_end) of
    sequence `seq`, at most tokens_per_block of them, none (tok_end == tok0) for a block
    no valid token lands in. Over every block, each token below cu_q_lens[num_seqs] is
    held exactly once."""
    seq = find_seq(
        cu_q_lens, num_seqs, pid, tokens_per_block=tokens_per_block, max_num_seqs=max_num_seqs
    )
    q_start = cu_q_lens[seq]
    q_end = cu_q_lens[seq + 1]
    tok0 = q_start + (pid - (q_start // tokens_per_block + seq)) * tokens_per_block
    has_rows = (seq < num_seqs) & (tok0 < q_end)
    tok_end = jnp.where(has_rows, jnp.minimum(tok0 + tokens_per_block, q_end), tok0)
    return seq, tok0, tok_end


def block_rows(tok0, tok_end, *, block_m: int, group: int):
    """(tok, row_valid), each [block_m]: row r holds query head r % group (of the program's
    KV head) of token tok0 + r // group, valid for the tokens in [tok0, tok_end)."""
    r = jnp.arange(block_m, dtype=jnp.int32)
    tok = tok0 + r // group
    return tok, tok < tok_end


def key_block_range(
    q_end, kv_len, tok0, tok_end, *, block_k: int, causal: bool, sliding_window: int | None
):
    """(kb_lo, kb_hi): key blocks [kb_lo, kb_hi) of `block_k` keys hold exactly the keys
    some token in [tok0, tok_end) of a sequence ending at q_end sees: every key below
    kv_len without causal masking; with it, the keys up to the token's position (token t
    sits at position t + kv_len - q_end) and, with a sliding window, the `sliding_window`
    keys ending there. No token gives (0, 0)."""
    shift = kv_len - q_end  # position of token t is t + shift
    hi = kv_len
    if causal:
        hi = jnp.minimum(hi, tok_end + shift)
    lo = jnp.int32(0)
    if sliding_window is not None:
        lo = jnp.maximum(lo, tok0 + shift - sliding_window + 1)
    hi = jnp.where(tok_end > tok0, hi, 0)
    kb_lo = jnp.minimum(lo, hi) // block_k
    kb_hi = jnp.maximum((hi + block_k - 1) // block_k, kb_lo)
    return kb_lo, kb_hi


def split_range(kb_lo, kb_hi, split, *, num_kv_splits: int):
    """Key blocks [split_lo, split_hi) of split `split`: the splits 0..num_kv_splits - 1
    cover [kb_lo, kb_hi) in order, each block once, each with at most
    ceil((kb_hi - kb_lo) / num_kv_splits) blocks (the last ones may hold none)."""
    chunk = (kb_hi - kb_lo + num_kv_splits - 1) // num_kv_splits
    split_lo = jnp.minimum(kb_lo + split * chunk, kb_hi)
    return split_lo, jnp.minimum(split_lo + chunk, kb_hi)
