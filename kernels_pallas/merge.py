"""Merge of two partial attention results over disjoint key sets through their LSEs.

Attention over the union of two disjoint key sets A and B is recovered exactly from
attention over each set plus each set's log-sum-exp:

    M = max(lse_a, lse_b); wa = exp(lse_a - M); wb = exp(lse_b - M)
    out = (wa * out_a + wb * out_b) / (wa + wb);  lse = M + log(wa + wb)

Guarantees: the math runs in float32; a side with lse == -inf (no keys) passes the other
side's output through bit for bit; both sides empty gives out 0 and lse -inf; no NaN
comes out for any finite or infinite lse (and finite outputs), and the blend lies
between the two outputs, so finite ones give a finite one up to float32's max.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.validation import check_arrays


def _check(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> None:
    check_arrays(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    if out_a.shape != out_b.shape:
        raise ValueError(f"{out_a.shape=} must equal {out_b.shape=}")
    if out_a.dtype != out_b.dtype:  # else a pass-through would be rounded to out_a's dtype
        raise ValueError(f"{out_a.dtype=} must equal {out_b.dtype=}")
    if not jnp.issubdtype(out_a.dtype, jnp.floating):  # int32 outputs would be truncated
        raise ValueError(f"{out_a.dtype=} must be a floating dtype")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):  # a complex lse lost its imag
        if not jnp.issubdtype(lse.dtype, jnp.floating):
            raise ValueError(f"{name}.dtype={lse.dtype} must be a floating dtype")
    if out_a.ndim != 3:
        raise ValueError(f"{out_a.shape=} must be [num_tokens, num_heads, head_dim]")
    if lse_a.shape != out_a.shape[:2] or lse_b.shape != out_a.shape[:2]:
        raise ValueError(f"{lse_a.shape=} and {lse_b.shape=} must both be {out_a.shape[:2]}")


def merge_attn_states(
    out_a: jax.Array,  # [num_tokens, num_heads, head_dim]
    lse_a: jax.Array,  # f32[num_tokens, num_heads]
    out_b: jax.Array,  # [num_tokens, num_heads, head_dim]
    lse_b: jax.Array,  # f32[num_tokens, num_heads]
) -> tuple[jax.Array, jax.Array]:
    """Returns (out in out_a.dtype, lse f32) of attention over the union of both key sets."""
    _check(out_a, lse_a, out_b, lse_b)
    lse_a = lse_a.astype(jnp.float32)
    lse_b = lse_b.astype(jnp.float32)
    m = jnp.maximum(lse_a, lse_b)
    # Where a side equals the max its weight is exactly 1; this also covers +inf == +inf,
    # which would otherwise give inf - inf = NaN.
    wa = jnp.exp(jnp.where(lse_a == m, 0.0, lse_a - m))
    wb = jnp.exp(jnp.where(lse_b == m, 0.0, lse_b - m))
    a_empty = lse_a == -jnp.inf
    b_empty = lse_b == -jnp.inf
    wa = jnp.where(a_empty, 0.0, wa)
    wb = jnp.where(b_empty, 0.0, wb)
    both_empty = a_empty & b_empty
    denom = jnp.where(both_empty, 1.0, wa + wb)

    fa = out_a.astype(jnp.float32)
    fb = out_b.astype(jnp.float32)
    # Shares in [0, 1] (the larger side weighs 1, so denom >= 1), and the blend clipped to
    # the range of the two outputs, where the exact blend lies: dividing the weighted sum
    # last overflowed to inf for outputs past half of float32's max, and a share rounded up
    # could still step past the max.
    share_a = (wa / denom)[..., None]
    share_b = (wb / denom)[..., None]
    blended = jnp.clip(share_a * fa + share_b * fb, jnp.minimum(fa, fb), jnp.maximum(fa, fb))
    blended = blended.astype(out_a.dtype)
    # The pass-throughs take the inputs themselves: exact also for a dtype wider than f32.
    out = jnp.where(b_empty[..., None], out_a, jnp.where(a_empty[..., None], out_b, blended))
    out = jnp.where(both_empty[..., None], jnp.zeros((), out_a.dtype), out)
    lse = jnp.where(both_empty, -jnp.inf, m + jnp.log(denom))
    return out, lse
