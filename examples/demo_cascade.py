"""Cascade attention vs plain attention on a random shared-prefix batch.

Builds a decode batch whose requests share a long prompt prefix in the paged KV cache,
runs plain (flat) ragged paged attention and cascade attention (shared prefix read once,
each request's own suffix separately, merged through their LSEs), and prints the largest
difference between the two, which stays at float32 rounding.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.kv_memory import gathered_kv_overflow  # noqa: E402
from kernels_pallas.reference import cascade_attention, ragged_paged_attention  # noqa: E402


def shared_prefix_batch(rng, *, batch, prefix_pages, suffix_len, page_size, kv_heads, q_heads, dim):
    """Decode inputs whose sequences all start with the same prefix_pages pages."""
    suffix_pages = -(-suffix_len // page_size)
    num_pages = 1 + prefix_pages + batch * suffix_pages
    perm = rng.permutation(np.arange(1, num_pages))  # page 0 is the null page
    prefix, own = perm[:prefix_pages], perm[prefix_pages:].reshape(batch, suffix_pages)
    page_indices = np.concatenate([np.tile(prefix, (batch, 1)), own], axis=1).astype(np.int32)
    kv_pages = rng.standard_normal((num_pages, page_size, 2 * kv_heads, dim), np.float32)
    q = rng.standard_normal((batch, q_heads, dim), np.float32)
    kv_lens = np.full(batch, prefix_pages * page_size + suffix_len, np.int32)
    cu_q_lens = np.arange(batch + 1, dtype=np.int32)
    args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, np.array([batch], np.int32))
    return tuple(jnp.asarray(a) for a in args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="requests in the decode batch")
    parser.add_argument("--prefix-pages", type=int, default=64, help="shared prefix, in pages")
    parser.add_argument("--suffix-len", type=int, default=24, help="tokens of each own suffix")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for flag, least in (("batch", 1), ("prefix_pages", 1), ("suffix_len", 1), ("page_size", 1),
                        ("seed", 0)):  # fmt: skip
        if getattr(args, flag) < least:  # 0 raised IndexError, or divided by zero, later
            parser.error(
                f"--{flag.replace('_', '-')} must be >= {least}, not {getattr(args, flag)}"
            )
    # Past the device's memory it failed only once the inputs were built. K and V of a
    # token: 2 KV heads of 64 float32s each.
    context = args.prefix_pages * args.page_size + args.suffix_len
    if overflow := gathered_kv_overflow(args.batch, context, 2 * 2 * 64 * 4):
        parser.error(f"--batch, --prefix-pages, --page-size and --suffix-len: {overflow}")

    rng = np.random.default_rng(args.seed)
    inputs = shared_prefix_batch(
        rng, batch=args.batch, prefix_pages=args.prefix_pages, suffix_len=args.suffix_len,
        page_size=args.page_size, kv_heads=2, q_heads=8, dim=64,
    )  # fmt: skip
    scale = 1.0 / np.sqrt(64)
    flat = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=scale, max_q_len=1))
    cascade = jax.jit(
        lambda *a: cascade_attention(*a, args.prefix_pages, sm_scale=scale, max_q_len=1)
    )

    results = {}
    for name, fn in (("flat", flat), ("cascade", cascade)):
        out, lse = jax.block_until_ready(fn(*inputs))  # compile
        times = []
        for _ in range(7):
            start = time.perf_counter()
            jax.block_until_ready(fn(*inputs))
            times.append(time.perf_counter() - start)
        results[name] = (out, lse, float(np.median(times)))
    (f_out, f_lse, f_t), (c_out, c_lse, c_t) = results["flat"], results["cascade"]
    prefix = args.prefix_pages * args.page_size
    print(f"batch {args.batch} decode requests, shared prefix {prefix} tokens, "
          f"own suffix {args.suffix_len} tokens each")  # fmt: skip
    print("median of 7 calls after a compile:")
    print(
        f"flat    {f_t * 1e3:8.2f} ms   reads {args.batch * (prefix + args.suffix_len)} KV tokens"
    )
    print(f"cascade {c_t * 1e3:8.2f} ms   reads {prefix + args.batch * args.suffix_len} KV tokens")
    print(f"max |out_cascade - out_flat| = {float(jnp.max(jnp.abs(c_out - f_out))):.3e}")
    print(f"max |lse_cascade - lse_flat| = {float(jnp.max(jnp.abs(c_lse - f_lse))):.3e}")


if __name__ == "__main__":
    main()
