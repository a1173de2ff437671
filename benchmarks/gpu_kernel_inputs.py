"""Inputs of benchmarks/gpu_kernel.py: its KV pages and the page tables that share (or
do not share) a prefix."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def kv_pool(key, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype):
    """Combined K/V pages [num_pages, page_size, 2 * num_kv_heads, head_dim] of `dtype`,
    standard normal, drawn on the device."""
    shape = (num_pages, page_size, 2 * num_kv_heads, head_dim)
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def decode_tables(b: int, p: int, s: int, page_size: int, *, shared: bool, copies: int):
    """(tables i32[copies, b, pages_per_seq], pages_per_copy): page 0 stays the null page.

    Request i's context is P prefix tokens then S own tokens. With `shared` the prefix
    pages are one physical run used by every request, as with prefix caching.
    """
    prefix_pages, own_pages = p // page_size, math.ceil(s / page_size)
    pages_per_seq = prefix_pages + own_pages
    table = np.zeros((b, pages_per_seq), np.int32)
    nxt = 1
    if shared:
        table[:, :prefix_pages] = np.arange(nxt, nxt + prefix_pages)
        nxt += prefix_pages
    for i in range(b):
        start = 0 if not shared else prefix_pages
        n = pages_per_seq - start
        table[i, start:] = np.arange(nxt, nxt + n)
        nxt += n
    pages_per_copy = nxt
    tables = np.stack([table + c * pages_per_copy for c in range(copies)])
    return tables, pages_per_copy
