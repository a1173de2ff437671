"""The loaders' dtype check (check_float_dtypes) on values numpy cannot read: a dtype it
does not know, or nested lists that make no array, are refused as a CheckpointError
naming the parameter or tensor, with nothing built."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jaxkv.models import CheckpointError, from_hf_tensors
from jaxkv.models.checkpoint import build_with_params, check_float_dtypes, flat_params
from tests.models.conftest import random_model, small_config
from tests.models.reference import random_hf_weights

NORM = "layers.1.post_attention_layernorm.weight"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


class _Tensor:
    """Stands for another library's tensor: numpy reads its values (__array__), but its
    dtype is whatever it was given."""

    def __init__(self, values: np.ndarray, dtype: object) -> None:
        self.values, self.dtype, self.shape = values, dtype, values.shape

    def __array__(self, dtype=None, copy=None):
        return self.values


class _OtherDtype:
    """Another library's dtype object (torch.float32, say): numpy does not read it."""

    def __repr__(self) -> str:
        return "other.float32"


@pytest.mark.parametrize(
    "dtype, shown",
    [
        ("float99", "'float99'"),  # a name numpy does not know: TypeError named nothing
        (_OtherDtype(), "other.float32"),
        (np.floating, "<class 'numpy.floating'>"),  # abstract: no dtype
        (np.float32(1.0), r"np.float32\(1.0\)"),  # a value: np.dtype read its dtype, took it
        (1, "1"),
    ],
)
def test_a_dtype_numpy_does_not_read_is_refused_naming_the_tensor(dtype, shown):
    cfg = small_config()
    params = {k: np.asarray(v) for k, v in flat_params(random_model(cfg)).items()}
    params[NORM] = _Tensor(params[NORM], dtype)
    with pytest.raises(CheckpointError, match=rf"parameter '{NORM}' in .*: dtype {shown} is no"):
        build_with_params(cfg, params)
    weights = random_hf_weights(cfg)
    weights[Q_PROJ] = _Tensor(weights[Q_PROJ], dtype)
    with pytest.raises(CheckpointError, match=rf"tensor '{Q_PROJ}' in .*: dtype {shown} is no"):
        from_hf_tensors(cfg, weights)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.float16, "float32", ml_dtypes.bfloat16])
def test_a_float_dtype_numpy_reads_passes_however_it_is_given(dtype):
    check_float_dtypes({"w": _Tensor(np.zeros(2, np.float32), dtype)}, "src", kind="tensor")


def test_nested_lists_of_ragged_lengths_are_refused_naming_the_tensor():
    # numpy's ValueError ("inhomogeneous shape") named no tensor.
    cfg = small_config()
    weights = random_hf_weights(cfg)
    rows = weights[Q_PROJ].tolist()
    weights[Q_PROJ] = [*rows[:-1], rows[-1][:-1]]
    with pytest.raises(CheckpointError, match=rf"tensor '{Q_PROJ}' in .*: makes no array"):
        from_hf_tensors(cfg, weights)
    with pytest.raises(CheckpointError, match="tensor 'w' in src: makes no array"):
        check_float_dtypes({"w": [[1.0], [1.0, 2.0]]}, "src", kind="tensor")


@pytest.mark.parametrize("value", [True, None, np.int8(1), [1, 2], np.zeros(2, ml_dtypes.int4)])
def test_values_of_no_floating_point_type_are_refused_by_their_dtype(value):
    with pytest.raises(CheckpointError, match="tensor 'w' in src: dtype .* not a floating-point"):
        check_float_dtypes({"w": value}, "src", kind="tensor")
