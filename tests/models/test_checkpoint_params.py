"""build_with_params takes a parameter given as nested lists of numbers by its values, as
an array of them: floats load, integers are refused by their dtype like an integer array."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.models import CheckpointError
from jaxkv.models.checkpoint import build_with_params, flat_params
from tests.models.conftest import random_model, small_config

NORM = "layers.1.post_attention_layernorm.weight"


def _params():
    cfg = small_config()
    return cfg, {k: np.asarray(v) for k, v in flat_params(random_model(cfg)).items()}


def test_a_parameter_given_as_lists_of_floats_loads_with_its_values():
    cfg, params = _params()
    values = [0.5 + i for i in range(cfg.hidden_size)]
    model = build_with_params(cfg, {**params, NORM: values})
    np.testing.assert_array_equal(flat_params(model)[NORM], np.float32(values))
    embed = "embed_tokens.embedding"
    model = build_with_params(cfg, {**params, embed: params[embed].tolist()})
    np.testing.assert_array_equal(flat_params(model)[embed], params[embed])


def test_a_parameter_given_as_lists_of_ints_is_refused_by_its_dtype():
    cfg, params = _params()
    with pytest.raises(CheckpointError, match=f"parameter '{NORM}' in .*: dtype int"):
        build_with_params(cfg, {**params, NORM: list(range(cfg.hidden_size))})
