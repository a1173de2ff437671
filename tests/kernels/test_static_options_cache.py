"""Each entry point refuses a count or flag of the wrong type whatever jit has compiled.

jit keys its cache on static options by == and hash, where 16.0 is 16 and 1 is True. The
kernels refused block_k=16.0 or causal=1 when tracing, yet ran the program of 16 or True
once it was cached; the types are now checked on every call, before jit
(kernels_pallas.static_options.check_option_types). Scales given as Python ints are
taken as their floats (static_number_options), and an option that does not hash is
refused by name (refuse_array_options).
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import paged_attention, write_kv
from kernels_pallas import reference
from kernels_pallas.gpu import ragged_paged_attention as gpu_kernel
from kernels_pallas.static_options import check_option_types
from kernels_pallas.tpu import ragged_paged_attention as tpu_kernel
from tests.attention.test_static_fields_as_given import _inputs
from tests.kernels import harness

SM_SCALE = 0.125
ENTRY_POINTS = {"reference": reference.ragged_paged_attention, "gpu": gpu_kernel, "tpu": tpu_kernel}


def _case():
    return harness.make_case(
        0, [(3, 9), (1, 5)], num_q_heads=4, num_kv_heads=2, head_dim=128, page_size=16,
        max_num_seqs=8, max_num_tokens=8,
    )  # fmt: skip


@pytest.mark.parametrize(
    "entry, name, good, bad",
    [
        ("reference", "max_q_len", 4, 4.0),
        ("reference", "causal", True, 1),
        ("gpu", "block_k", 16, 16.0),
        ("gpu", "num_kv_splits", 1, np.float32(1)),
        ("gpu", "causal", True, 1),
        ("gpu", "interpret", True, 1),
        ("tpu", "num_kv_pages_per_block", 1, 1.0),
        ("tpu", "sliding_window", 4, 4.0),
        ("tpu", "causal", False, np.int64(0)),
    ],
)
def test_an_option_equal_to_a_compiled_one_but_of_the_wrong_type_is_refused(entry, name, good, bad):
    case, fn = _case(), ENTRY_POINTS[entry]
    interpret = {} if entry == "reference" else {"interpret": True}
    expected = fn(*case.args(), sm_scale=SM_SCALE, **{**interpret, name: good})
    kind = "a bool" if type(good) is bool else "an int or None"
    with pytest.raises(ValueError, match=rf"^{name}={re.escape(repr(bad))} must be {kind}$"):
        fn(*case.args(), sm_scale=SM_SCALE, **{**interpret, name: bad})
    again = fn(*case.args(), sm_scale=SM_SCALE, **{**interpret, name: good})
    for want, got in zip(expected, again, strict=True):
        np.testing.assert_array_equal(got, want)


def test_numpy_integers_and_bools_and_other_flags_pass_the_type_check():
    """A numpy integer is a count and np.bool_ a flag, as in the kernels' own checks;
    None, a str or an InterpretParams for a flag hashes apart from True and False and is
    left to the entry point's own check."""
    check_option_types(
        {"block_k": np.int64(16), "max_q_len": None, "causal": np.bool_(True), "interpret": None}
    )
    check_option_types({"causal": "no", "interpret": object(), "unknown_option": 2.5})
    case = _case()
    out, _ = gpu_kernel(*case.args(), sm_scale=SM_SCALE, interpret=True, block_k=np.int32(16))
    assert out.dtype == jnp.float32


def test_paged_attention_refuses_a_flag_equal_to_a_compiled_one_but_of_the_wrong_type():
    """return_lse=1 is True to jit's cache: once return_lse=True was compiled, 1 would
    return its (out, lse) pair unchecked; paged_attention refuses it on every call."""
    md, q, pages = _inputs()
    out, lse = paged_attention(q, pages, md, sm_scale=SM_SCALE, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    for bad in (1, np.int64(1)):
        with pytest.raises(
            ValueError, match=rf"^return_lse={re.escape(repr(bad))} must be a bool$"
        ):
            paged_attention(q, pages, md, sm_scale=SM_SCALE, return_lse=bad)


@pytest.mark.parametrize("name", ["sm_scale", "soft_cap", "k_scale", "v_scale"])
def test_a_python_int_scale_past_int32_gives_its_floats_result(name):
    # JAX reads a Python int as int32: sm_scale=2**31, finite in float32, failed inside
    # the kernels with an OverflowError naming no option.
    case = _case()
    base = dict(sm_scale=2.0**-40)  # 2**-40 * 2**31: normal logit scales
    for entry in ("reference", "gpu"):
        interpret = {} if entry == "reference" else {"interpret": True}
        fn = ENTRY_POINTS[entry]
        want = fn(*case.args(), **{**base, **interpret, name: 2.0**31})
        got = fn(*case.args(), **{**base, **interpret, name: 2**31})
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=entry)
    if name in ("k_scale", "v_scale"):
        k = jnp.asarray(np.random.default_rng(0).standard_normal((8, 2, 16), np.float32))
        slots = jnp.arange(8, dtype=jnp.int32)
        want = write_kv(jnp.zeros((6, 4, 4, 16)), k, k, slots, **{name: 2.0**31})
        got = write_kv(jnp.zeros((6, 4, 4, 16)), k, k, slots, **{name: 2**31})
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["sm_scale", "soft_cap", "causal", "interpret", "backend"])
def test_an_option_that_does_not_hash_is_refused_by_name(name):
    # jit's own error ("Non-hashable static arguments", or a bare "unhashable type" for
    # paged_attention's backend) named no option.
    match = rf"^{name}=\[1\] must be a static value \(a Python or numpy scalar\), not list$"
    if name != "backend":
        case = _case()
        options = {"sm_scale": SM_SCALE, "interpret": True, name: [1]}
        with pytest.raises(ValueError, match=match):
            gpu_kernel(*case.args(), **options)
    if name != "causal":
        md, q, pages = _inputs()
        with pytest.raises(ValueError, match=match):
            paged_attention(q, pages, md, **{"sm_scale": SM_SCALE, name: [1]})
    if name == "sm_scale":
        k = jnp.zeros((8, 2, 16))
        slots = jnp.arange(8, dtype=jnp.int32)
        with pytest.raises(ValueError, match=match.replace(name, "k_scale")):
            write_kv(jnp.zeros((6, 4, 4, 16)), k, k, slots, k_scale=[1])
