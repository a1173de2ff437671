"""Loading weights into a narrower float dtype: a finite weight past the new dtype's range
is refused by name, whichever narrowing it is, rather than loaded as inf."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jaxkv.models import CheckpointError, from_hf_tensors
from tests.models.conftest import small_config
from tests.models.reference import random_hf_weights

NAME = "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize(
    "stored, loaded, value",
    [
        (np.float32, "bfloat16", 3.4e38),  # past bfloat16's largest finite, 3.3895e38
        (np.float64, "float32", 1e300),
        (np.float64, "bfloat16", -1e39),
    ],
)
def test_a_weight_past_the_loaded_dtypes_range_is_refused_by_name(stored, loaded, value):
    weights = {k: v.astype(stored) for k, v in random_hf_weights(small_config()).items()}
    weights[NAME][2, 1] = value
    with pytest.raises(CheckpointError, match=f"tensor '{NAME}' in .* overflows {loaded}"):
        from_hf_tensors(small_config(dtype=loaded), weights)
    # An inf the weights hold is no overflow, and values the dtype holds load as they are.
    weights[NAME][2, 1] = np.inf
    kernel = from_hf_tensors(small_config(dtype=loaded), weights).layers[0].mlp.up_proj.kernel
    assert np.isinf(np.asarray(kernel[...])[1, 2])
    assert np.asarray(kernel[...]).dtype == np.dtype(getattr(ml_dtypes, loaded, loaded))


@pytest.mark.parametrize(
    "value, loaded, hint",
    [
        (1e5, "float16", "load it as bfloat16 or float32"),
        (float(np.finfo(np.float32).max), "float16", "load it as float32"),  # past bfloat16's
        (1e39, "float32", "no dtype jaxkv loads holds it"),
    ],
)
def test_the_refusal_names_the_dtypes_that_hold_the_value(value, loaded, hint):
    weights = {k: v.astype(np.float64) for k, v in random_hf_weights(small_config()).items()}
    weights[NAME][0, 0] = -value
    with pytest.raises(CheckpointError, match=f"overflows {loaded} .*; {hint}$"):
        from_hf_tensors(small_config(dtype=loaded), weights)


def test_a_one_element_weight_past_the_range_is_refused_too():
    # hidden_size 1 with head_dim 2: every norm weight holds a single element.
    cfg = small_config(hidden_size=1, num_heads=1, num_kv_heads=1, head_dim=2, dtype="float16")
    weights = random_hf_weights(cfg)
    weights["model.norm.weight"][0] = 1e5
    with pytest.raises(CheckpointError, match="tensor 'model.norm.weight' .* overflows float16"):
        from_hf_tensors(cfg, weights)
