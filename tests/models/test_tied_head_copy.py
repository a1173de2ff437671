"""A tied checkpoint (tie_word_embeddings true) that stores lm_head.weight anyway: some
exporters save the head beside the embedding it is tied to. A copy loads; a head that
differs from the embedding means the files and the config disagree, and is refused
naming the tensor, where it was dropped without a word."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from jaxkv.models import CheckpointError, from_hf_tensors, load_hf_safetensors
from jaxkv.models.checkpoint import check_copy, flat_params
from jaxkv.models.hf_checkpoint import write_safetensors
from tests.models.conftest import hf_config_dict, small_config
from tests.models.reference import random_hf_weights

CFG = small_config(tie_word_embeddings=True)
EMBED = "model.embed_tokens.weight"


def _weights(dtype=np.float32) -> dict[str, np.ndarray]:
    return {k: v.astype(dtype) for k, v in random_hf_weights(CFG, seed=3).items()}


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("head_first", [False, True])
def test_a_stored_copy_of_the_embedding_loads(dtype, head_first):
    weights = _weights(dtype)
    head = {"lm_head.weight": weights[EMBED].copy()}
    model = from_hf_tensors(CFG, {**head, **weights} if head_first else {**weights, **head})
    assert model.lm_head is None
    np.testing.assert_array_equal(
        flat_params(model)["embed_tokens.embedding"], weights[EMBED].astype(np.float32)
    )


@pytest.mark.parametrize("row", [0, CFG.vocab_size - 1])
def test_a_stored_head_that_differs_from_the_embedding_is_refused_naming_both(row):
    weights = _weights()
    head = weights[EMBED].copy()
    head[row, -1] += 1.0  # one element, at either end
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'lm_head\.weight' in Hugging Face tensors differs from "
        r"'model\.embed_tokens\.weight': with tie_word_embeddings=True it must be a copy",
    ):
        from_hf_tensors(CFG, {**weights, "lm_head.weight": head})


def test_a_stored_head_of_another_shape_is_refused_naming_both_shapes():
    weights = _weights()
    head = weights[EMBED][:, :-1]
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'lm_head\.weight' in Hugging Face tensors: shape \(64, 31\) differs from "
        r"'model\.embed_tokens\.weight' \(64, 32\)",
    ):
        from_hf_tensors(CFG, {"lm_head.weight": head, **weights})


def test_a_tied_file_whose_head_differs_is_refused_naming_the_checkpoint(tmp_path):
    weights = _weights()
    write_safetensors(
        tmp_path / "model.safetensors", {**weights, "lm_head.weight": -weights[EMBED]}
    )
    config = hf_config_dict(CFG, tie_word_embeddings=True, rms_norm_eps=CFG.rms_norm_eps)
    (tmp_path / "config.json").write_text(json.dumps(config))
    before = (tmp_path / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match=rf"'lm_head\.weight' in {tmp_path} differs from"):
        load_hf_safetensors(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before  # nothing written
    # The same file with a copy of the embedding as its head loads.
    write_safetensors(tmp_path / "model.safetensors", {**weights, "lm_head.weight": weights[EMBED]})
    assert load_hf_safetensors(tmp_path).lm_head is None


def test_a_stored_head_that_is_not_floating_point_is_refused_naming_it():
    weights = _weights()
    head = weights[EMBED].astype(np.int32)  # equal values only where they are integers
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' .*dtype int32 is not a float"):
        from_hf_tensors(CFG, {**weights, "lm_head.weight": head})


def test_a_stored_copy_holding_nan_where_the_embedding_does_loads():
    # A NaN in the embedding is copied to the head as NaN: the copy is still a copy.
    weights = _weights()
    weights[EMBED][5, 2] = np.nan
    model = from_hf_tensors(CFG, {**weights, "lm_head.weight": weights[EMBED].copy()})
    assert model.lm_head is None
    assert np.isnan(flat_params(model)["embed_tokens.embedding"][5, 2])


def test_a_copy_is_compared_whole_when_one_row_is_longer_than_a_chunk():
    # Compared a few million elements at a time; a row longer than that is one chunk.
    wide = np.zeros((2, 2**22 + 1), np.int8)
    check_copy("head", wide, "embed", wide.copy(), "file", why="tied")
    other = wide.copy()
    other[1, -1] = 1
    with pytest.raises(CheckpointError, match="^tensor 'head' in file differs from 'embed': tied"):
        check_copy("head", other, "embed", wide, "file", why="tied")
