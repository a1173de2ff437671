"""Every kernel, and the reference, refuses zero-size padded axes by name at trace time
(kernels_pallas.validation): padded shapes hold at least one token, page and page slot."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from kernels_pallas import gpu, reference, tpu
from tests.kernels import harness

ATTEND = {
    "reference": reference.ragged_paged_attention,
    "tpu": functools.partial(tpu.ragged_paged_attention, interpret=True),
    "gpu": functools.partial(gpu.ragged_paged_attention, interpret=True),
}


@pytest.mark.parametrize("backend", sorted(ATTEND))
@pytest.mark.parametrize(
    "name, index",
    [("q", np.s_[:0]), ("kv_pages", np.s_[:, :0]), ("page_indices", np.s_[:, :0])],
)
def test_zero_size_axes_are_refused_by_name_on_every_backend(backend, name, index):
    # Zero tokens, zero-size pages or zero pages per sequence crashed each kernel deep
    # inside (ZeroDivisionError, a gather TypeError); the reference answered some of them.
    seq_lens = [(1, 17), (7, 7), (3, 40)]
    case = harness.make_case(0, seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    names = ("q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")
    args = dict(zip(names, case.args(), strict=True))
    args[name] = args[name][index]
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in args.items()}
    with pytest.raises(ValueError, match=rf"{name}.shape=.*(zero-size|must be >= 1)"):
        jax.eval_shape(functools.partial(ATTEND[backend], sm_scale=1.0), **abstract)
