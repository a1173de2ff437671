"""The pallas_gpu cost model against the decode timings it was set from.

benchmarks/gpu_kernel.py on an NVIDIA H200 (jax 0.11.2, 2026-12-04, two runs): B decode
requests, Llama-3-8B heads, bfloat16, pages of 16 tokens, sharing a P-token prefix and
owning S tokens each. Flat attention over the shared (prefix-cached) pages is what the
engine runs when cascade is off. A cell where both runs agree on the winner by 5% or
more must get that winner from the default model; the two cells where the runs disagree
are left out.
"""

from __future__ import annotations

import pytest

from jaxkv.cascade import DEFAULT_COST_MODELS

# (B, P, S): (flat_shared us, cascade us) of run 1, then of run 2.
H200_DECODE_US = {
    (8, 1024, 128): ((84.1, 67.2), (57.3, 80.1)),
    (8, 1024, 1024): ((70.7, 77.5), (82.4, 95.7)),
    (8, 8192, 128): ((110.8, 82.9), (126.8, 120.0)),
    (8, 8192, 1024): ((122.4, 96.9), (135.1, 97.7)),
    (64, 1024, 128): ((113.7, 100.1), (131.7, 113.0)),
    (64, 1024, 1024): ((177.6, 197.7), (189.7, 179.3)),
    (64, 8192, 128): ((388.6, 134.2), (421.9, 176.0)),
    (64, 8192, 1024): ((478.8, 232.6), (508.3, 227.9)),
    (128, 1024, 128): ((155.0, 132.4), (175.5, 149.2)),
    (128, 1024, 1024): ((272.0, 256.8), (278.2, 256.7)),
    (128, 8192, 128): ((609.6, 236.3), (632.2, 208.2)),
    (128, 8192, 1024): ((721.3, 339.2), (748.1, 308.6)),
}


def _winner(runs) -> str | None:
    """'cascade' or 'flat' where every run agrees by at least 5%, else None."""
    speedups = [flat / cascade for flat, cascade in runs]
    if min(speedups) >= 1.05:
        return "cascade"
    if max(speedups) <= 1 / 1.05:
        return "flat"
    return None


CLEAR = {cell: w for cell, runs in H200_DECODE_US.items() if (w := _winner(runs))}


def test_most_cells_have_a_clear_winner():
    assert len(CLEAR) == 10 and list(CLEAR.values()).count("flat") == 1


@pytest.mark.parametrize("cell", sorted(CLEAR), ids=lambda c: "B={}-P={}-S={}".format(*c))
def test_the_gpu_default_picks_the_measured_winner(cell):
    b, p, s = cell
    pays = DEFAULT_COST_MODELS["pallas_gpu"].pays(
        num_requests=b, prefix_tokens=p, num_query_tokens=b, num_q_heads=32, num_kv_heads=8,
        head_dim=128, kv_itemsize=2, context_tokens=b * (p + s),
    )  # fmt: skip
    assert ("cascade" if pays else "flat") == CLEAR[cell]
