"""Correctness checks of the Pallas GPU kernel against `kernels_pallas.reference`.

Run on the device by benchmarks/gpu_kernel.py before it times anything (interpreted in
its --smoke run): decode, mixed prefill/decode with shuffled page tables, soft cap and
sliding window, and the non-causal prefix pass of cascade attention over each float cache
dtype the run times, and int8 and float8 KV.
A check that raises is reported as failed, except the kernel's own refusal of float8
pages on a GPU older than compute capability 8.9, which is reported as unsupported.
After the timings, the methods' outputs on the inputs they were timed on are judged
against flat's (benchmarks/output_agreement.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu_kernel_methods import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS
from benchmarks.output_agreement import agreement
from benchmarks.reference_errors import errors_against_reference
from kernels_pallas import reference
from kernels_pallas.gpu import ragged_paged_attention


def _random_ragged(key, seq_lens, *, page_size, num_q_heads, num_kv_heads, head_dim, dtype):
    """Inputs with shuffled page tables for (q_len, kv_len) pairs, and kv_dtype casts."""
    rng = np.random.default_rng(0)
    needed = [math.ceil(kv / page_size) for _, kv in seq_lens]
    pages_per_seq = max(needed)
    num_pages = sum(needed) + 1
    perm = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((len(seq_lens), pages_per_seq), np.int32)
    start = 0
    for i, n in enumerate(needed):
        table[i, :n] = perm[start : start + n]
        start += n
    num_tokens = sum(q for q, _ in seq_lens)
    kq, kk = jax.random.split(key)
    q = jax.random.normal(kq, (num_tokens, num_q_heads, head_dim), jnp.float32).astype(dtype)
    kv = jax.random.normal(kk, (num_pages, page_size, 2 * num_kv_heads, head_dim), jnp.float32)
    cu = np.concatenate([[0], np.cumsum([q for q, _ in seq_lens])]).astype(np.int32)
    kv_lens = np.array([kv for _, kv in seq_lens], np.int32)
    return q, kv, jnp.asarray(kv_lens), jnp.asarray(table), jnp.asarray(cu)


# The float cases' names tag the query/cache pair ("bf16": bfloat16 over bfloat16).
_CACHE_TAGS = {"bfloat16": "bf16", "float16": "bf16/f16", "float32": "bf16/f32"}


def device_checks(*, interpret: bool, small: bool, kv_dtypes=("bfloat16",)) -> list[dict]:
    """Kernel vs the jnp reference on the device; bf16 queries, bounds 2e-2 on out. The
    float cases run over a cache of each of `kv_dtypes` (names of float dtypes)."""
    heads = (4, 2, 64) if small else (NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM)
    hq, hkv, d = heads
    if small:
        seq_lens = [(1, 40), (9, 30), (1, 17)]
    else:
        seq_lens = [(1, 1100), (64, 300), (200, 200), (1, 17), (1, 4096)]
    page_size = 16
    q, kv, kv_lens, table, cu = _random_ragged(
        jax.random.key(1), seq_lens, page_size=page_size, num_q_heads=hq, num_kv_heads=hkv,
        head_dim=d, dtype=jnp.bfloat16,
    )  # fmt: skip
    num_seqs = jnp.array([len(seq_lens)], jnp.int32)
    sm_scale = d**-0.5
    int8_kv = jnp.clip(jnp.round(kv * 40), -127, 127).astype(jnp.int8)
    # The cascade prefix pass: one sequence holding every query token, no causal mask.
    one_seq = (kv_lens[:1], table[:1], jnp.array([0, q.shape[0]], jnp.int32), num_seqs * 0 + 1)
    all_seqs = (kv_lens, table, cu, num_seqs)
    cases = []
    for kv_dtype in kv_dtypes:
        tag, float_kv = _CACHE_TAGS[kv_dtype], kv.astype(kv_dtype)
        window = {"soft_cap": 30.0, "sliding_window": 128}
        cases += [
            (f"mixed_{tag}_causal", float_kv, all_seqs, {}),
            (f"mixed_{tag}_softcap_window", float_kv, all_seqs, window),
            (f"prefix_pass_{tag}_noncausal", float_kv, one_seq, {"causal": False}),
        ]
    cases += [
        ("int8_kv", int8_kv, all_seqs, {"k_scale": 1 / 40, "v_scale": 1 / 40}),
        (
            "float8_e4m3_kv",
            kv.astype(jnp.float8_e4m3fn),
            all_seqs,
            {"k_scale": 0.5, "v_scale": 0.5},
        ),
    ]
    return [
        _check_one(name, (q, kv_c, *meta), dict(sm_scale=sm_scale, **kw), interpret)
        for name, kv_c, meta, kw in cases
    ]


def _check_one(name: str, args, kw: dict, interpret: bool) -> dict:
    try:
        kernel = functools.partial(ragged_paged_attention, interpret=interpret, **kw)
        got = jax.jit(kernel)(*args)
        want = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(*args)
        res = {"check": name, **errors_against_reference(got, want)}
    except Exception as e:  # reported, not fatal: the other checks and timings still run
        res = {"check": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        res["unsupported"] = isinstance(e, ValueError) and "compute capability >= 8.9" in str(e)
    verdict = "PASS" if res["ok"] else "UNSUPPORTED" if res.get("unsupported") else "FAIL"
    print(f"check {name:28s} {verdict} {res}", flush=True)
    return res


def checks_passed(results: list[dict]) -> bool:
    """Whether every check passed or was refused as unsupported by this GPU."""
    return all(r["ok"] or r.get("unsupported", False) for r in results)


def outputs_agreement(outs: dict, dtype) -> dict:
    """The first timed call's outputs of each method, judged on the same inputs: cascade
    against flat_shared, JAX's kernel against flat_unique (flat and cascade return
    (out, lse) per call, JAX's kernel out alone). Worst difference and verdict of each."""
    casc = agreement(outs["cascade"][0][0], outs["flat_shared"][0][0], dtype)
    jaxp = agreement(outs["jax_paged"][0], outs["flat_unique"][0][0], dtype)
    return {
        "cascade_vs_flat_max_abs": casc["max_abs_diff"],
        "cascade_agrees": casc["agrees"],
        "jax_vs_flat_max_abs": jaxp["max_abs_diff"],
        "jax_agrees": jaxp["agrees"],
    }


def disagreeing_cells(rows: list[dict]) -> list[tuple[int, int, int]]:
    """(B, P, S) of the benchmark rows where cascade or JAX's kernel disagreed with flat."""
    return [(r["B"], r["P"], r["S"]) for r in rows if not (r["cascade_agrees"] and r["jax_agrees"])]
