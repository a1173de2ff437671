"""Checkpoints and configs that must be refused clearly, and round trips that must be exact."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import msgpack
import numpy as np
import optax
import pytest
from flax import serialization

from jaxkv.models import (
    CheckpointError,
    LlamaConfig,
    from_hf_tensors,
    load_checkpoint,
    load_hf_safetensors,
    save_checkpoint,
)
from jaxkv.models.checkpoint import build_with_params, flat_params
from jaxkv.models.hf_checkpoint import read_safetensors, write_safetensors
from jaxkv.models.train import Trainer
from tests.models.conftest import drop_weights_digest, hf_config_dict, random_model, small_config
from tests.models.reference import random_hf_weights


@pytest.mark.parametrize("dtype, tied", [("bfloat16", False), ("float32", True)])
def test_round_trip_is_bit_exact_for_every_parameter(tmp_path, dtype, tied):
    model = random_model(small_config(dtype=dtype, tie_word_embeddings=tied), seed=3)
    loaded = load_checkpoint(save_checkpoint(model, tmp_path))
    assert loaded.config == model.config
    want, got = flat_params(model), flat_params(loaded)
    assert want.keys() == got.keys() and len(want) == 2 + 9 * 2 + (not tied)
    for name in want:
        a, b = np.asarray(want[name]), np.asarray(got[name])
        assert a.dtype == b.dtype == np.dtype(dtype) and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), name


@pytest.mark.parametrize("payload", [1, None, [1, 2], "params"])
def test_msgpack_that_is_not_a_parameter_dict_is_refused_naming_the_file(tmp_path, payload):
    save_checkpoint(random_model(small_config()), tmp_path)
    drop_weights_digest(tmp_path)  # as a config.json written by hand: no digest to check
    (tmp_path / "params.msgpack").write_bytes(serialization.msgpack_serialize(payload))
    with pytest.raises(CheckpointError, match=r"params\.msgpack"):
        load_checkpoint(tmp_path)


def test_msgpack_with_keys_of_several_types_is_refused_naming_them(tmp_path):
    # Sorting the unexpected names raised TypeError: '<' between an int and a str.
    save_checkpoint(random_model(small_config()), tmp_path)
    drop_weights_digest(tmp_path)
    weights = tmp_path / "params.msgpack"
    params = msgpack.unpackb(weights.read_bytes())  # values stay packed: written back as read
    norm = next(v for k, v in params.items() if "norm" in k)
    weights.write_bytes(msgpack.packb({**params, 7: norm, "extra": norm}))
    with pytest.raises(CheckpointError, match=r"params\.msgpack.*unexpected \['extra', 7\]"):
        load_checkpoint(tmp_path)


def test_checkpoint_of_another_model_is_refused_naming_the_parameter(tmp_path):
    save_checkpoint(random_model(small_config(tie_word_embeddings=True)), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    with pytest.raises(CheckpointError, match=r"missing \['lm_head\.kernel'\]"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "field, value",
    [
        ("rope_scaling", [8.0, 1.0, 4.0, 8192]),
        ("rope_scaling", {"factor": 8.0, "rope_type": "llama3"}),
        ("tie_word_embeddings", "false"),
        ("rope_theta", "10000"),
        ("rope_theta", float("nan")),
        ("rms_norm_eps", float("inf")),
    ],
)
def test_ill_typed_config_fields_are_refused_by_name(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"{field}="):
        small_config(**{field: value})
    save_checkpoint(random_model(small_config()), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(CheckpointError, match=f"config.json: not a valid LlamaConfig.*{field}="):
        load_checkpoint(tmp_path)


def test_hf_errors_name_the_file_tensor_in_file_orientation(tmp_path):
    cfg = small_config()
    weights = random_hf_weights(cfg)
    weights["model.layers.1.self_attn.v_proj.weight"] = np.zeros((8, 32), np.float32)
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.1\.self_attn\.v_proj\.weight'.*\(8, 32\).*\(16, 32\)",
    ):
        from_hf_tensors(cfg, weights)
    weights = random_hf_weights(cfg)
    del weights["model.norm.weight"]
    weights["model.layers.2.mlp.up_proj.weight"] = np.zeros((48, 32), np.float32)
    with pytest.raises(
        CheckpointError,
        match=r"missing \['model\.norm\.weight'\].*unexpected \['model\.layers\.2\.mlp",
    ):
        from_hf_tensors(cfg, weights)


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    cfg = small_config()
    weights = random_hf_weights(cfg)
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", weights)
    write_safetensors(
        tmp_path / "model-00002-of-00002.safetensors",
        {"model.norm.weight": np.zeros(cfg.hidden_size, np.float32)},
    )
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight'.*twice"):
        load_hf_safetensors(tmp_path, cfg)


def test_an_ignored_tensor_given_twice_is_refused():
    # A tied model ignores a stored lm_head.weight, and every model the rotary buffer;
    # a second copy of either still means files from two checkpoints were mixed.
    cfg = small_config(tie_word_embeddings=True)
    weights = list(random_hf_weights(cfg).items())
    ignored = {
        "lm_head.weight": (cfg.vocab_size, cfg.hidden_size),
        "model.rotary_emb.inv_freq": (cfg.head_dim // 2,),
    }
    for name, shape in ignored.items():
        extra = (name, np.zeros(shape, np.float32))
        with pytest.raises(CheckpointError, match=rf"'{name}'.*twice"):
            from_hf_tensors(cfg, [*weights, extra, extra])


def _hf_config(**extra) -> dict:
    return hf_config_dict(small_config(), **extra)


def test_hf_config_dtype_key_and_activation():
    # Newer transformers write "dtype" where older ones wrote "torch_dtype".
    assert LlamaConfig.from_hf_dict(_hf_config(dtype="bfloat16")).dtype == "bfloat16"
    assert LlamaConfig.from_hf_dict(_hf_config(torch_dtype="float16")).dtype == "float16"
    assert LlamaConfig.from_hf_dict(_hf_config(hidden_act="silu")).dtype == "float32"
    # transformers' ACT2FN maps "swish" to the same SiLU: it was refused.
    swish = LlamaConfig.from_hf_dict(_hf_config(hidden_act="swish"))
    assert swish == LlamaConfig.from_hf_dict(_hf_config(hidden_act="silu"))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        LlamaConfig.from_hf_dict(_hf_config(hidden_act="gelu"))


def test_bf16_hf_weights_load_exactly():
    cfg = small_config(dtype="bfloat16")
    weights = {k: v.astype(ml_dtypes.bfloat16) for k, v in random_hf_weights(cfg, seed=6).items()}
    model = from_hf_tensors(cfg, weights)
    got = np.asarray(model.layers[0].self_attn.q_proj.kernel[...])
    assert got.dtype == ml_dtypes.bfloat16
    assert (
        got.tobytes()
        == np.ascontiguousarray(weights["model.layers.0.self_attn.q_proj.weight"].T).tobytes()
    )


def test_trainer_leaves_its_input_model_and_snapshots_usable():
    cfg = small_config(num_layers=1, vocab_size=16, hidden_size=8, intermediate_size=8)
    model = random_model(cfg)
    # Copies: a numpy view of a CPU buffer would pin it and keep it from being donated.
    values = lambda m: {k: np.array(v, copy=True) for k, v in flat_params(m).items()}
    before = values(model)
    tokens = np.random.default_rng(0).integers(0, 16, (2, 5)).astype(np.int32)
    trainer = Trainer.create(model, optax.sgd(0.1))  # the cheapest program to compile
    trainer.step(tokens)
    snapshot = trainer.model()
    after_one = values(snapshot)
    trainer.step(tokens)
    # Both were donated to the update program before: reading them raised.
    for name, value in values(model).items():
        np.testing.assert_array_equal(value, before[name])
    for name, value in values(snapshot).items():
        np.testing.assert_array_equal(value, after_one[name])
    assert not np.array_equal(after_one["norm.weight"], before["norm.weight"])


def test_hf_config_missing_keys_are_named():
    hf = _hf_config()
    del hf["hidden_size"]
    with pytest.raises(ValueError, match=r"lacks \['hidden_size'\]"):
        LlamaConfig.from_hf_dict(hf)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    with pytest.raises(ValueError, match="lacks.*high_freq_factor.*original_max_position"):
        LlamaConfig.from_hf_dict(_hf_config(rope_scaling=scaling))
    with pytest.raises(ValueError, match="rope_scaling=.*must be a dict"):
        LlamaConfig.from_hf_dict(_hf_config(rope_scaling=[8.0]))


def _raw_safetensors(path, header: dict, data: bytes = b"") -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


def test_safetensors_with_no_data_or_a_bad_shape_is_refused_by_tensor(tmp_path):
    path = tmp_path / "empty.safetensors"
    _raw_safetensors(path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
    with pytest.raises(CheckpointError, match=r"'w'.*bytes \[0, 8\) of 0"):
        read_safetensors(path)
    _raw_safetensors(path, {"w": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}})
    assert read_safetensors(path)["w"].shape == (0,)
    for shape in (["2"], [2.0], [-2], 2):
        header = {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 8]}}
        _raw_safetensors(path, header, bytes(8))
        with pytest.raises(CheckpointError, match="'w'.*bad header entry"):
            read_safetensors(path)
    # Float offsets passed the range checks and slicing then raised a bare TypeError.
    _raw_safetensors(
        path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8]}}, bytes(8)
    )
    with pytest.raises(CheckpointError, match="'w'.*bad header entry"):
        read_safetensors(path)
    # An entry that is no object, or lacks a key, is refused by name (from the KeyError
    # or TypeError of reading its fields).
    for entry in ([2], "F32", {"dtype": "F32", "shape": [2]}, {"data_offsets": [0, 8]}, None):
        _raw_safetensors(path, {"w": entry}, bytes(8))
        with pytest.raises(CheckpointError, match="'w'.*bad header entry"):
            read_safetensors(path)
    path.write_bytes((2).to_bytes(8, "little") + b"[]")  # a header that is no JSON object
    with pytest.raises(CheckpointError, match="header is not a JSON object"):
        read_safetensors(path)


def test_safetensors_shapes_numpy_cannot_hold_are_refused_by_tensor(tmp_path):
    path = tmp_path / "huge.safetensors"
    # 2**62 + 1 rows of 4: int64 element counts wrapped to 4, matching the 16 bytes given,
    # and reshape then raised a bare ValueError.
    _raw_safetensors(
        path, {"w": {"dtype": "F32", "shape": [2**62 + 1, 4], "data_offsets": [0, 16]}}, bytes(16)
    )
    with pytest.raises(CheckpointError, match=r"'w'.*cannot hold F32 \[4611686018427387905, 4\]"):
        read_safetensors(path)
    for shape in ([0, 2**62], [0, 2**64]):  # no bytes, but no numpy array has such a dimension
        _raw_safetensors(path, {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
        with pytest.raises(
            CheckpointError, match=rf"'w' in .*huge.safetensors: shape \[0, {shape[1]}\]"
        ):
            read_safetensors(path)


def test_a_checkpoint_with_a_parameter_the_model_lacks_is_refused_naming_it(tmp_path):
    # An untied checkpoint read with a tied config would otherwise drop its lm_head
    # silently and serve logits from the embedding instead.
    save_checkpoint(random_model(small_config(tie_word_embeddings=False)), tmp_path)
    drop_weights_digest(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(CheckpointError, match=r"missing \[\], unexpected \['lm_head\.kernel'\]"):
        load_checkpoint(tmp_path)


def test_a_save_that_fails_writing_its_config_leaves_no_staged_file(tmp_path, monkeypatch):
    old = random_model(small_config(), seed=1)
    save_checkpoint(old, tmp_path)
    write_bytes = Path.write_bytes

    def fail_on_config(path, data):
        if path.name == "config.json.tmp":
            raise OSError("disk full")
        return write_bytes(path, data)

    monkeypatch.setattr(Path, "write_bytes", fail_on_config)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(random_model(small_config(), seed=2), tmp_path)
    monkeypatch.undo()
    # The staged weights were written, and removed again; the old pair is untouched.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "params.msgpack"]
    loaded = load_checkpoint(tmp_path)
    np.testing.assert_array_equal(
        loaded.embed_tokens.embedding[...], old.embed_tokens.embedding[...]
    )


def test_save_checkpoint_refuses_what_is_no_model_before_making_its_directory(tmp_path):
    # An nnx.State or a str raised AttributeError or IndexError, an empty directory left.
    with pytest.raises(ValueError, match="model=str must be a jaxkv.models.Llama"):
        save_checkpoint("model", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(ValueError, match="path=None must be a str or os.PathLike"):
        save_checkpoint(random_model(small_config(), seed=0), None)  # was TypeError
    with pytest.raises(ValueError, match="path=None must be a str or os.PathLike"):
        load_checkpoint(None)


def test_a_directory_without_weights_is_refused_naming_it(tmp_path):
    """Neither model.safetensors, nor a shard index, nor any *.safetensors file."""
    (tmp_path / "notes.txt").write_text("not weights")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files in .*"):
        load_hf_safetensors(tmp_path, small_config())


def test_load_hf_safetensors_names_the_missing_path_not_its_parents_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # another model's config beside the typo
    with pytest.raises(FileNotFoundError, match="typo: no such file or directory"):
        load_hf_safetensors(tmp_path / "typo")


@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.uint8, np.complex64])
def test_weights_that_are_not_floating_point_are_refused_by_name(tmp_path, dtype):
    # Cast to the model's dtype they loaded as 0/1, truncated or real-part-only weights.
    cfg = small_config()
    name = "model.layers.0.self_attn.q_proj.weight"
    weights = random_hf_weights(cfg)
    weights[name] = weights[name].astype(dtype)
    with pytest.raises(CheckpointError, match=f"tensor '{name}' in .*dtype .* not a floating"):
        from_hf_tensors(cfg, weights)
    save_checkpoint(random_model(cfg), tmp_path)
    drop_weights_digest(tmp_path)  # as a config.json written by hand: no digest to check
    params = {k: np.asarray(v) for k, v in flat_params(random_model(cfg)).items()}
    params["norm.weight"] = params["norm.weight"].astype(dtype)
    (tmp_path / "params.msgpack").write_bytes(serialization.msgpack_serialize(params))
    with pytest.raises(CheckpointError, match=r"parameter 'norm\.weight' in .*params\.msgpack"):
        load_checkpoint(tmp_path)


def test_a_tensor_name_that_is_not_a_str_is_refused_as_a_checkpoint_error():
    # A dict keyed by ints (mixed-up state) raised AttributeError: 'int' has no endswith.
    weights = {**random_hf_weights(small_config()), 7: np.zeros(3, np.float32)}
    with pytest.raises(CheckpointError, match="tensor name 7 is not a str"):
        from_hf_tensors(small_config(), weights)


def test_tensors_that_are_not_name_array_pairs_are_refused_by_name():
    # None raised "not iterable", a list of names "too many values to unpack", and an
    # unhashable name "unhashable type" before the name check could refuse it.
    weights = random_hf_weights(small_config())
    pairs = r"tensors.* must be a mapping or an iterable of \(name, array\) pairs"
    for bad in (None, list(weights), [(*pair, 1) for pair in weights.items()]):
        with pytest.raises(ValueError, match=pairs):
            from_hf_tensors(small_config(), bad)
    with pytest.raises(CheckpointError, match=r"tensor name \['w'\] is not a str"):
        from_hf_tensors(small_config(), [(["w"], np.zeros(3, np.float32))])


def test_hf_tensors_given_as_nested_lists_load_as_arrays_would():
    # They passed the name, shape and dtype checks and then raised AttributeError from .T.
    cfg = small_config()
    weights = random_hf_weights(cfg)
    model = from_hf_tensors(cfg, {k: v.tolist() for k, v in weights.items()})
    for name, value in flat_params(from_hf_tensors(cfg, weights)).items():
        np.testing.assert_array_equal(flat_params(model)[name], value)


def test_weights_of_every_float_dtype_still_load():
    cfg = small_config()
    for dtype in (np.float16, np.float64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
        weights = {k: v.astype(dtype) for k, v in random_hf_weights(cfg).items()}
        assert flat_params(from_hf_tensors(cfg, weights)).keys()


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_a_weight_past_float16_range_is_refused_by_name_when_loading_as_float16(tmp_path, dtype):
    # Cast to float16 it loaded as inf without a word: logits of inf and NaN at run time.
    cfg = small_config()
    name = "model.layers.1.mlp.down_proj.weight"
    weights = {k: v.astype(dtype) for k, v in random_hf_weights(cfg, seed=2).items()}
    weights[name][3, 5] = -(2.0**17)  # held exactly by bfloat16 too
    write_safetensors(tmp_path / "model.safetensors", weights)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(cfg, torch_dtype="bfloat16")))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' in .*value 131072.0 overflows"):
        load_hf_safetensors(tmp_path, dtype="float16")
    with pytest.raises(CheckpointError, match=r"parameter 'layers\.1\.mlp\.down_proj\.kernel'"):
        build_with_params(small_config(dtype="float16"), flat_params(from_hf_tensors(cfg, weights)))
    # The same file loads as bfloat16, and as float16 once the weight fits; an inf the file
    # holds is not an overflow of the cast.
    assert load_hf_safetensors(tmp_path).config.dtype == "bfloat16"
    weights[name][3, 5], weights[name][0, 0] = 65280.0, np.inf  # 65280: both hold it
    model = from_hf_tensors(small_config(dtype="float16"), weights)
    kernel = np.asarray(model.layers[1].mlp.down_proj.kernel[...])
    assert kernel.dtype == np.float16 and kernel[5, 3] == 65280
    assert np.isinf(kernel[0, 0]) and np.isfinite(np.delete(kernel.ravel(), 0)).all()
