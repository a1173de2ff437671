"""A batch of no sequences gives out 0 and lse -inf in every row, on every backend,
whatever its tables still hold from an earlier batch (here: a whole valid batch)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import reference
from kernels_pallas.gpu import ragged_paged_attention as gpu_attention
from tests.kernels import harness

KERNELS = {
    "reference": reference.ragged_paged_attention,
    "pallas_gpu": lambda *a, **kw: gpu_attention(*a, interpret=harness.INTERPRET_GPU, **kw),
}


@pytest.mark.parametrize("backend", list(KERNELS))
def test_no_sequences_give_zero_and_neg_inf_whatever_the_tables_hold(backend):
    case = harness.make_case(
        5, [(1, 17), (7, 7), (3, 40)], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16
    )
    out, lse = KERNELS[backend](
        *case.replace(num_seqs=jnp.array([0], jnp.int32)).args(), sm_scale=0.125
    )
    assert np.all(np.asarray(out) == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)))
