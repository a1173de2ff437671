"""Bytes one decode attention call moves, flat and cascade: the bound a kernel is held to.

Per layer, for B requests that share a P-token prefix and own S more tokens each, one
query token each:

- flat: reads B * (P + S) tokens of KV and the queries; writes the output (query dtype)
  and the float32 log-sum-exps;
- cascade: reads P + B * S tokens of KV; each of its two passes reads the queries and
  writes float32 partial outputs and log-sum-exps, which the merge reads back before it
  writes the output and log-sum-exps.

Counting only the KV would make cascade's bound unreachable at large B and small S,
where the partials weigh as much as its KV.
"""

from __future__ import annotations

F32 = 4


def decode_bytes(
    batch: int,
    prefix: int,
    suffix: int,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_itemsize: int,
    q_itemsize: int,
    cascade: bool,
) -> int:
    """Bytes read plus bytes written by one flat or cascade decode call (see the module)."""
    kv_per_token = 2 * num_kv_heads * head_dim * kv_itemsize
    queries = batch * num_q_heads * head_dim * q_itemsize
    result = queries + batch * num_q_heads * F32  # output in the query dtype, lse in f32
    if not cascade:
        return batch * (prefix + suffix) * kv_per_token + queries + result
    partial = batch * num_q_heads * (head_dim + 1) * F32  # one pass's f32 output and lse
    passes = 2 * (queries + partial)
    merge = 2 * partial + result
    return (prefix + batch * suffix) * kv_per_token + passes + merge


def kv_bytes(batch: int, prefix: int, suffix: int, *, kv_per_token: int, cascade: bool) -> int:
    """The KV part alone: B * (P + S) tokens flat, P + B * S tokens cascade."""
    return (prefix + batch * suffix if cascade else batch * (prefix + suffix)) * kv_per_token
