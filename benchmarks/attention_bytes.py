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

from jaxkv.field_checks import checked_int

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
    """Bytes read plus bytes written by one flat or cascade decode call (see the module).

    ValueError naming the argument unless batch and the head and item sizes are ints
    >= 1, prefix and suffix ints >= 0, and cascade a bool."""
    _check_sizes(batch, prefix, suffix, cascade)
    for name, size in (
        ("num_q_heads", num_q_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("kv_itemsize", kv_itemsize),
        ("q_itemsize", q_itemsize),
    ):
        checked_int(name, size, minimum=1)
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
    """The KV part alone: B * (P + S) tokens flat, P + B * S tokens cascade.

    ValueError naming the argument unless batch and kv_per_token are ints >= 1, prefix
    and suffix ints >= 0, and cascade a bool."""
    _check_sizes(batch, prefix, suffix, cascade)
    checked_int("kv_per_token", kv_per_token, minimum=1)
    return (prefix + batch * suffix if cascade else batch * (prefix + suffix)) * kv_per_token


def _check_sizes(batch: int, prefix: int, suffix: int, cascade: bool) -> None:
    # A negative or fractional size gave a bound of bytes nobody moves, without a word.
    checked_int("batch", batch, minimum=1)
    checked_int("prefix", prefix, minimum=0)
    checked_int("suffix", suffix, minimum=0)
    if not isinstance(cascade, bool):  # None or "no" chose a method by truthiness
        raise ValueError(f"cascade={cascade!r} must be a bool")
