"""Argument checks of the GPU kernel's entry point: its tuning knobs and `interpret`.

Every check runs while tracing (jax.eval_shape), before any Pallas or Triton failure, and
names the argument; good values, numpy integers included, still trace, run and lower.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gpu import ragged_paged_attention
from kernels_pallas.gpu.aot import lower_triton_calls
from tests.kernels import harness

SM_SCALE = 0.125


def _case(seq_lens=((1, 5),), dtype=jnp.float32):
    return harness.make_case(
        0, list(seq_lens), num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=dtype
    )


def _trace(case, **kw):
    kw = {"sm_scale": SM_SCALE, "interpret": True, **kw}
    return jax.eval_shape(functools.partial(ragged_paged_attention, **kw), *case.args())


KNOBS = ("block_m", "block_k", "num_kv_splits", "num_warps", "num_stages", "max_q_len")


@pytest.mark.parametrize("name", KNOBS)
@pytest.mark.parametrize("value", [16.0, True, "16", np.float32(16)], ids=repr)
def test_a_knob_that_is_no_int_is_refused_by_name(name, value):
    # A float block size failed in `n & (n - 1)` with a TypeError naming nothing, a float
    # split count in Pallas's grid check; num_warps, num_stages and max_q_len took
    # anything (16.0 reached Triton as std::bad_cast); True ran as 1.
    with pytest.raises(ValueError, match=rf"^{name}=.* must be an int"):
        _trace(_case(), **{name: value})


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_warps": 0}, "num_warps=0 must be a power of two"),
        ({"num_warps": -1}, "num_warps=-1 must be a power of two"),
        ({"num_warps": 3}, "num_warps=3 must be a power of two"),  # Triton asserts, on the GPU
        ({"num_warps": 64}, "num_warps=64 must be a power of two"),  # 2048 threads: ptxas fails
        ({"num_stages": 0}, "num_stages=0 must be >= 1"),
        ({"num_stages": -1}, "num_stages=-1 must be >= 1"),
        ({"max_q_len": 0}, "max_q_len=0 must be >= 1"),
        ({"max_q_len": -3}, "max_q_len=-3 must be >= 1"),
        ({"num_kv_splits": -2}, "num_kv_splits=-2 must be >= 1"),
        ({"block_m": -16}, "block_m=-16 must be a power of two"),
        ({"block_k": 0}, "block_k=0 must be a power of two"),
    ],
)
def test_a_knob_out_of_range_is_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        _trace(_case(), **kw)


@pytest.mark.parametrize("interpret", ["no", 1, 0, None, np.True_], ids=repr)
def test_interpret_must_be_a_bool(interpret):
    # "no" interpreted (truthy) and 0 or None compiled for the GPU, whatever was meant.
    with pytest.raises(ValueError, match="interpret=.* must be a bool"):
        _trace(_case(), interpret=interpret)


NUMPY_KNOBS = dict(
    block_m=np.int64(32),
    block_k=np.int32(32),
    num_kv_splits=np.int64(2),
    num_warps=np.int32(8),
    num_stages=np.int64(3),
    max_q_len=np.int32(4),
)


def test_numpy_int_knobs_run_like_python_ints():
    case = _case([(4, 37), (1, 16)])
    out, lse = ragged_paged_attention(
        *case.args(), sm_scale=SM_SCALE, interpret=harness.INTERPRET_GPU, **NUMPY_KNOBS
    )
    expected = harness.dense_oracle(case, sm_scale=SM_SCALE)
    harness.assert_close_to_oracle(case, out, lse, expected)
    harness.assert_padding_is_empty(case, out, lse)


def test_numpy_int_knobs_lower_for_cuda():
    # A numpy split count or block_m reached the grid as a numpy integer, which Pallas
    # takes for a dynamic bound: "dynamic grid bounds not supported in the Triton backend".
    case = _case([(4, 37), (1, 16)], dtype=jnp.bfloat16)
    f = functools.partial(ragged_paged_attention, sm_scale=SM_SCALE, **NUMPY_KNOBS)
    _, (call,) = lower_triton_calls(f, case.args())
    assert call.verified and (call.num_warps, call.num_stages) == (8, 3)


@pytest.mark.parametrize("option", ["sm_scale", "soft_cap"])
def test_a_scale_that_is_inf_in_float32_is_refused(option):
    # 1e39 passed as finite, then was inf in the kernel's float32: every row NaN.
    with pytest.raises(ValueError, match=f"{option}=1e\\+39 must be a finite number > 0"):
        _trace(_case(), **{"sm_scale": SM_SCALE, option: 1e39})


@pytest.mark.parametrize(
    "options",
    [
        {"sm_scale": 3e38},
        {"sm_scale": 1e30, "soft_cap": 1e-10},
        {"sm_scale": 1e20, "k_scale": 1e20, "v_scale": 1.0},
    ],
)
def test_a_scale_whose_folded_factor_is_inf_in_float32_is_refused(options):
    # Finite alone, but the kernel scales by it times log2(e) (or sm_scale by k_scale)
    # in one float32 factor, which was inf: every row NaN, where the reference is finite.
    with pytest.raises(ValueError, match=r"= .* must be finite and normal in float32"):
        _trace(_case(), **{"sm_scale": SM_SCALE, **options})
