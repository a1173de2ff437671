from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import serialization

from jaxkv.models import (
    CheckpointError,
    Llama,
    load_checkpoint,
    load_hf_safetensors,
    make_dense_forward,
    save_checkpoint,
)
from jaxkv.models.hf_checkpoint import read_safetensors, to_hf_tensors, write_safetensors
from tests.models.conftest import drop_weights_digest, hf_config_dict, random_model, small_config
from tests.models.reference import hf_llama_forward, random_hf_weights

TOKENS = np.array([3, 17, 0, 63, 42, 42, 8, 1, 29], dtype=np.int32)


def _logits(model: Llama, tokens=TOKENS) -> np.ndarray:
    return np.asarray(make_dense_forward(model)(jnp.asarray(tokens)[None]))[0]


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_round_trip_restores_config_and_every_weight(tmp_path, tied):
    cfg = small_config(tie_word_embeddings=tied)
    model = random_model(cfg, seed=1)
    save_checkpoint(model, tmp_path / "ckpt")
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.config == cfg
    np.testing.assert_array_equal(
        loaded.layers[1].mlp.down_proj.kernel[...], model.layers[1].mlp.down_proj.kernel[...]
    )
    np.testing.assert_array_equal(_logits(loaded), _logits(model))
    # A differently initialised model gives different logits: the equality above is not vacuous.
    assert not np.allclose(_logits(random_model(cfg, seed=2)), _logits(model))


def test_checkpoint_of_a_different_shape_raises_naming_the_parameter(tmp_path):
    save_checkpoint(random_model(small_config()), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 40
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"layers\.0\.mlp\.down_proj\.kernel.*\(48, 32\).*\(40, 32\)"
    ):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "file, corrupt, match",
    [
        ("params.msgpack", lambda b: b[: len(b) // 2], "params.msgpack: not a msgpack"),
        ("params.msgpack", lambda b: b"not msgpack at all", "params.msgpack: not a msgpack"),
        # A flax ndarray extension holding an int, not (shape, dtype, data): a TypeError.
        ("params.msgpack", lambda b: b"\xc7\x01\x01\x01", "params.msgpack: not a msgpack"),
        ("config.json", lambda b: b"{not json", "config.json: not a valid LlamaConfig"),
        ("config.json", lambda b: b'{"vocab_size": 8}', "config.json: not a valid LlamaConfig"),
        ("config.json", lambda b: b"\xff\xfe" + b, "config.json: not a valid LlamaConfig"),
    ],
)
def test_corrupt_checkpoint_files_raise_checkpoint_error_naming_the_file(
    tmp_path, file, corrupt, match
):
    save_checkpoint(random_model(small_config()), tmp_path)
    drop_weights_digest(tmp_path)  # as a config.json written by hand: no digest to check
    (tmp_path / file).write_bytes(corrupt((tmp_path / file).read_bytes()))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(tmp_path)


def _with_header(whole: bytes, **entry) -> bytes:
    """The safetensors file `whole` with tensor 'a''s header entry updated by `entry`."""
    n = int.from_bytes(whole[:8], "little")
    header = json.loads(whole[8 : 8 + n])
    header["a"].update(entry)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob + whole[8 + n :]


def test_corrupt_safetensors_raise_checkpoint_error_naming_file_and_tensor(tmp_path):
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"a": np.arange(6, dtype=np.float32).reshape(2, 3)})
    whole = path.read_bytes()
    for data, match in [
        (whole[:4], "w.safetensors: not a safetensors file"),
        ((1 << 40).to_bytes(8, "little") + whole[8:], "header of .* past the end"),
        (whole[:-4], "tensor 'a' in .*w.safetensors: bytes \\[0, 24\\) of 20"),
        (_with_header(whole, dtype=["F32"]), "tensor 'a' in .*w.safetensors: dtype"),
    ]:
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=match):
            read_safetensors(path)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_safetensors_match_an_independent_numpy_forward(tmp_path, tied):
    cfg = small_config(tie_word_embeddings=tied, num_heads=4, num_kv_heads=2)
    weights = random_hf_weights(cfg, seed=3)
    safetensors.numpy.save_file(weights, str(tmp_path / "model.safetensors"))
    model = load_hf_safetensors(tmp_path / "model.safetensors", cfg)

    # A specific weight lands in its module, transposed from [out, in] to [in, out].
    np.testing.assert_array_equal(
        model.layers[1].self_attn.k_proj.kernel[...],
        weights["model.layers.1.self_attn.k_proj.weight"].T,
    )
    np.testing.assert_array_equal(
        model.layers[0].post_attention_layernorm.weight[...],
        weights["model.layers.0.post_attention_layernorm.weight"],
    )
    expected = hf_llama_forward(weights, cfg, TOKENS)
    # float32 model against a float64 reference; logits are O(1-10).
    np.testing.assert_allclose(_logits(model), expected, rtol=1e-4, atol=1e-4)


def test_hf_directory_with_config_json_and_sharded_bf16_files(tmp_path):
    cfg = small_config()
    weights = random_hf_weights(cfg, seed=4)
    names = sorted(weights)
    half = len(names) // 2
    for i, part in enumerate([names[:half], names[half:]]):
        shard = {n: weights[n].astype(ml_dtypes.bfloat16) for n in part}
        write_safetensors(tmp_path / f"model-0000{i + 1}-of-00002.safetensors", shard)
    hf_config = hf_config_dict(
        cfg,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    model = load_hf_safetensors(tmp_path, dtype="float32")
    bf16_weights = {n: w.astype(ml_dtypes.bfloat16).astype(np.float32) for n, w in weights.items()}
    np.testing.assert_array_equal(model.lm_head.kernel[...], bf16_weights["lm_head.weight"].T)
    np.testing.assert_allclose(
        _logits(model), hf_llama_forward(bf16_weights, cfg, TOKENS), rtol=1e-4, atol=1e-4
    )


def test_hf_export_reads_back_with_the_safetensors_package(tmp_path):
    model = random_model(small_config(), seed=5)
    write_safetensors(tmp_path / "m.safetensors", to_hf_tensors(model))
    theirs = safetensors.numpy.load_file(str(tmp_path / "m.safetensors"))
    ours = read_safetensors(tmp_path / "m.safetensors")
    assert theirs.keys() == ours.keys()
    for name in theirs:
        np.testing.assert_array_equal(theirs[name], ours[name])
    np.testing.assert_array_equal(
        theirs["model.layers.0.self_attn.q_proj.weight"],
        np.asarray(model.layers[0].self_attn.q_proj.kernel[...]).T,
    )


def _saved_hf(tmp_path, weights):
    safetensors.numpy.save_file(weights, str(tmp_path / "model.safetensors"))
    return tmp_path / "model.safetensors"


def test_hf_shape_mismatch_names_parameter_and_both_shapes(tmp_path):
    cfg = small_config()
    weights = random_hf_weights(cfg)
    weights["model.layers.1.self_attn.v_proj.weight"] = np.zeros((8, 32), np.float32)
    with pytest.raises(
        ValueError, match=r"'model\.layers\.1\.self_attn\.v_proj\.weight'.*\(8, 32\).*\(16, 32\)"
    ):
        load_hf_safetensors(_saved_hf(tmp_path, weights), cfg)


def test_hf_missing_and_unknown_tensors_raise(tmp_path):
    cfg = small_config()
    weights = random_hf_weights(cfg)
    del weights["model.layers.0.mlp.up_proj.weight"]
    missing = r"missing \['model\.layers\.0\.mlp\.up_proj\.weight'\]"
    with pytest.raises(CheckpointError, match=missing):
        load_hf_safetensors(_saved_hf(tmp_path, weights), cfg)
    weights = random_hf_weights(cfg)
    weights["model.layers.0.self_attn.q_norm.weight"] = np.ones(8, np.float32)
    with pytest.raises(CheckpointError, match="q_norm"):
        load_hf_safetensors(_saved_hf(tmp_path, weights), cfg)


def test_a_save_that_fails_while_writing_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    # Same shapes, other weights and rope_theta: a torn pair would load without complaint.
    old = random_model(small_config(), seed=1)
    save_checkpoint(old, tmp_path)
    new = random_model(small_config(rope_theta=500.0), seed=2)

    def fail(_):
        raise OSError("disk full")

    monkeypatch.setattr(serialization, "msgpack_serialize", fail)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(new, tmp_path)
    monkeypatch.undo()
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == old.config
    np.testing.assert_array_equal(_logits(loaded), _logits(old))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "params.msgpack"]


def test_hf_directory_loads_only_the_files_hugging_face_would(tmp_path):
    # An adapter's weights next to the model's were loaded too and refused as unexpected
    # names; Hugging Face takes model.safetensors, else the shards its index lists.
    cfg = small_config()
    weights = random_hf_weights(cfg, seed=5)
    names = sorted(weights)
    halves = (names[:3], names[3:])
    shards = {f"model-0000{i + 1}-of-00002.safetensors": part for i, part in enumerate(halves)}
    for file, part in shards.items():
        write_safetensors(tmp_path / file, {n: weights[n] for n in part})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    stray = {"base_model.model.layers.0.q_proj.lora_A.weight": np.zeros((2, 2), np.float32)}
    write_safetensors(tmp_path / "adapter_model.safetensors", stray)
    expected = hf_llama_forward(weights, cfg, TOKENS)
    model = load_hf_safetensors(tmp_path, cfg)
    np.testing.assert_allclose(_logits(model), expected, rtol=1e-4, atol=1e-4)
    for file in shards:
        (tmp_path / file).unlink()
    write_safetensors(tmp_path / "model.safetensors", weights)  # preferred over the index
    np.testing.assert_allclose(
        _logits(load_hf_safetensors(tmp_path, cfg)), expected, rtol=1e-4, atol=1e-4
    )
