"""Hugging Face configs and files as they occur in published checkpoints.

config.json keys left out take Hugging Face's `LlamaConfig` defaults; unsupported or
inconsistent values are refused by name. Safetensors files carry a `__metadata__` header
entry, tied models may store `lm_head.weight` anyway, older ones a `rotary_emb.inv_freq`
buffer: all load, checked against the numpy reference forward.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from jaxkv.models import (
    CheckpointError,
    LlamaConfig,
    RopeScaling,
    from_hf_tensors,
    load_hf_safetensors,
    make_dense_forward,
)
from jaxkv.models.checkpoint import flat_params
from jaxkv.models.hf_checkpoint import hf_to_jaxkv_name, read_safetensors, write_safetensors
from tests.models.conftest import hf_config_dict, small_config
from tests.models.reference import hf_llama_forward, random_hf_weights
from tests.models.test_checkpoint import TOKENS  # a program that file compiles

REQUIRED = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
)


def test_keys_left_out_take_hugging_face_defaults():
    cfg = LlamaConfig.from_hf_dict(REQUIRED)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling) == (4, 8, 1e4, None)
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e-6, 2048)
    assert (cfg.tie_word_embeddings, cfg.dtype) == (False, "float32")
    given = dict(num_key_value_heads=1, head_dim=16, rope_theta=5e5, rms_norm_eps=1e-5,
                 max_position_embeddings=4096, torch_dtype="float16")  # fmt: skip
    cfg = LlamaConfig.from_hf_dict({**REQUIRED, **given})
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.rms_norm_eps) == (1, 16, 5e5, 1e-5)
    assert (cfg.max_position_embeddings, cfg.dtype) == (4096, "float16")
    assert LlamaConfig.from_hf_dict({**REQUIRED, **given}, dtype="bfloat16").dtype == "bfloat16"


@pytest.mark.parametrize("key", sorted(REQUIRED))
def test_each_required_key_is_named_when_missing(key):
    hf = dict(REQUIRED)
    del hf[key]
    with pytest.raises(ValueError, match=f"lacks \\['{key}'\\]"):
        LlamaConfig.from_hf_dict(hf)


def test_unsupported_rope_scaling_and_inconsistent_values_are_refused():
    linear = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="'linear' is not supported"):
        LlamaConfig.from_hf_dict({**REQUIRED, "rope_scaling": linear})
    for bad, match in [
        (dict(factor=0.5), "factor"),
        (dict(low_freq_factor=4.0, high_freq_factor=1.0), "low_freq_factor"),
        (dict(low_freq_factor=0.0), "low_freq_factor"),
        (dict(low_freq_factor=4.0, high_freq_factor=4.0), "low_freq_factor"),  # 0 / 0 band
        (dict(original_max_position_embeddings=0), "original_max_position_embeddings"),
        (dict(factor=float("nan")), "factor=nan must be a finite real"),  # NaN RoPE else
        (dict(high_freq_factor=float("inf")), "high_freq_factor=inf must be a finite real"),
        (dict(factor="8"), "factor='8' must be a finite real"),
        (dict(original_max_position_embeddings=8192.5), "must be an int in \\[1, "),
        (dict(original_max_position_embeddings=True), "must be an int in \\[1, "),  # not 1
    ]:
        with pytest.raises(ValueError, match=match):
            RopeScaling(**bad)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        small_config(max_position_embeddings=0)


def test_null_and_default_values_read_as_hugging_face_reads_them():
    # transformers reads a null num_key_value_heads as num_attention_heads, a null
    # head_dim as hidden_size // num_attention_heads, and rope_type "default" as plain RoPE.
    nulls = dict(num_key_value_heads=None, head_dim=None)
    cfg = LlamaConfig.from_hf_dict({**REQUIRED, **nulls, "rope_scaling": {"rope_type": "default"}})
    assert cfg == LlamaConfig.from_hf_dict(REQUIRED)
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.rope_theta) == (1e-6, 2048, 1e4)


@pytest.mark.parametrize("head_dim", [0, False, 8.0, -8])
def test_a_head_dim_that_is_not_a_positive_int_is_refused_not_derived(head_dim):
    # 0 and false used to be read as absent (hidden_size // num_attention_heads): in
    # transformers they are heads of no dimensions, a config nobody can mean.
    with pytest.raises(ValueError, match=f"head_dim={head_dim!r} must be a positive int or null"):
        LlamaConfig.from_hf_dict({**REQUIRED, "head_dim": head_dim})


def test_the_legacy_rope_type_key_and_a_dtype_this_llama_lacks_are_read():
    """Older configs name the scaling under "type"; a torch_dtype this Llama does not run
    (float64) loads as float32, as a config without one does."""
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)  # fmt: skip
    legacy = LlamaConfig.from_hf_dict({**REQUIRED, "rope_scaling": {"type": "llama3", **scaling}})
    assert legacy.rope_scaling == RopeScaling(**scaling)
    assert LlamaConfig.from_hf_dict({**REQUIRED, "torch_dtype": "float64"}).dtype == "float32"


@pytest.mark.parametrize(
    "key, value, match",
    [
        # Said "Hugging Face config: Hugging Face config: rms_norm_eps=...".
        ("rms_norm_eps", "1e-5x", "^Hugging Face config: rms_norm_eps='1e-5x' must be a number$"),
        ("rope_theta", [5e5], "rope_theta=\\[500000.0\\] must be a number"),
        ("rope_theta", True, "rope_theta=True must be a number"),
    ],
)
def test_a_value_that_is_not_a_number_is_refused_naming_its_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf_dict({**REQUIRED, key: value})
    scaling = dict(rope_type="llama3", factor=value, low_freq_factor=1, high_freq_factor=4,
                   original_max_position_embeddings=8192)  # fmt: skip
    with pytest.raises(ValueError, match="rope_scaling: factor="):
        LlamaConfig.from_hf_dict({**REQUIRED, "rope_scaling": scaling})


BIG = 10**400  # json.loads reads an integer of 401 digits as this int


@pytest.mark.parametrize(
    "key, value, match",
    [
        # float() of these raised a bare OverflowError, which load_hf_safetensors
        # did not even pin on config.json.
        ("rope_theta", BIG, "^Hugging Face config: rope_theta=10+ must be a finite number$"),
        ("factor", BIG, "^Hugging Face rope_scaling: factor=10+ must be a finite number$"),
        ("original_max_position_embeddings", BIG,
         "^Hugging Face rope_scaling: original_max_position_embeddings=10+ must be an int in"),
        # Said "must be a number" of a number.
        ("original_max_position_embeddings", 1.5,
         "^Hugging Face rope_scaling: original_max_position_embeddings=1.5 must be an integer$"),
    ],
    ids=["huge-theta", "huge-factor", "huge-original-max", "fractional-original-max"],
)  # fmt: skip
def test_a_value_too_large_or_not_integral_is_refused_naming_its_key(key, value, match):
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)  # fmt: skip
    hf = {**REQUIRED, "rope_scaling": scaling}
    if key in scaling:
        hf["rope_scaling"] = {**scaling, key: value}
    else:
        hf[key] = value
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf_dict(hf)


@pytest.mark.parametrize(
    "given, match",
    [
        (dict(num_hidden_layers=0), "^Hugging Face config: num_hidden_layers=0 must be positive "
         "\\(LlamaConfig says num_layers for num_hidden_layers\\)$"),
        (dict(num_attention_heads=3), "multiple of num_attention_heads=3 when head_dim"),
        (dict(num_key_value_heads=3), "num_attention_heads=4 must be a multiple of "
         "num_key_value_heads=3"),
        (dict(num_attention_heads=2.5), "^Hugging Face config: num_attention_heads=2.5 must be"),
        (dict(eos_token_id=64), "^Hugging Face config: eos_token_id=64 must be token ids"),
        (dict(hidden_size="32"), "^Hugging Face config: hidden_size='32' must be an int$"),
    ],
)  # fmt: skip
def test_a_bad_size_is_refused_naming_its_config_json_key(given, match):
    # Used to name LlamaConfig's fields (self.num_heads, num_layers), not the user's keys.
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf_dict({**REQUIRED, **given})
    # The dtype argument is the caller's, not config.json's: refused under its own name.
    with pytest.raises(ValueError, match="^dtype='float64' must be one of"):
        LlamaConfig.from_hf_dict(REQUIRED, dtype="float64")


@pytest.mark.parametrize("value", ["false", "true", 0, 1])
def test_tie_word_embeddings_that_is_not_a_bool_is_refused_by_name(value):
    # bool("false") used to tie the head, so a stored lm_head.weight was dropped unread.
    with pytest.raises(ValueError, match=f"tie_word_embeddings={value!r} must be a bool"):
        LlamaConfig.from_hf_dict({**REQUIRED, "tie_word_embeddings": value})
    null = LlamaConfig.from_hf_dict({**REQUIRED, "tie_word_embeddings": None})
    assert null.tie_word_embeddings is False


def _logits(model, tokens):
    return np.asarray(make_dense_forward(model)(jnp.asarray(tokens)[None]))[0]


def test_a_published_tied_file_loads_with_its_extra_tensors(tmp_path):
    cfg = small_config(tie_word_embeddings=True)
    weights = random_hf_weights(cfg, seed=6)
    extra = {
        # Some tied exports store the head too (a copy of the embedding); older ones a buffer.
        "lm_head.weight": weights["model.embed_tokens.weight"].copy(),
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32),
    }
    safetensors.numpy.save_file({**weights, **extra}, str(tmp_path / "model.safetensors"),
                                metadata={"format": "pt"})  # fmt: skip
    hf_config = hf_config_dict(cfg, tie_word_embeddings=True, rms_norm_eps=cfg.rms_norm_eps)
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    # A file path: config.json is read from its directory.
    model = load_hf_safetensors(tmp_path / "model.safetensors")
    assert model.config == cfg and model.lm_head is None
    want = hf_llama_forward(weights, cfg, TOKENS)  # the head is the embedding
    np.testing.assert_allclose(_logits(model, TOKENS), want, rtol=1e-4, atol=1e-4)


def test_loaded_parameters_take_the_requested_dtype(tmp_path):
    cfg = small_config()
    weights = random_hf_weights(cfg, seed=7)
    safetensors.numpy.save_file(weights, str(tmp_path / "model.safetensors"))
    model = load_hf_safetensors(tmp_path / "model.safetensors", cfg, dtype="bfloat16")
    assert model.config.dtype == "bfloat16"
    assert {np.asarray(v).dtype for v in flat_params(model).values()} == {np.dtype("bfloat16")}
    # bfloat16 tensors into a float32 config: cast up, exactly.
    half = {k: v.astype(ml_dtypes.bfloat16) for k, v in weights.items()}
    params = flat_params(from_hf_tensors(cfg, half))
    assert {np.asarray(v).dtype for v in params.values()} == {np.dtype("float32")}
    np.testing.assert_array_equal(
        params["norm.weight"], half["model.norm.weight"].astype(np.float32)
    )


# [-4, 4) is 8 bytes long, but a negative offset would slice from the end of the data.
@pytest.mark.parametrize("begin, end", [(0, 4), (-4, 4)])
def test_a_tensor_whose_byte_range_does_not_match_its_shape_is_refused(tmp_path, begin, end):
    blob = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [begin, end]}}).encode()
    path = tmp_path / "w.safetensors"
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(8))
    match = rf"'w'.*bytes \[{begin}, {end}\) of 8 cannot hold F32 \[2\]"
    with pytest.raises(CheckpointError, match=match):
        read_safetensors(path)


def test_written_safetensors_align_their_data_to_8_bytes(tmp_path):
    path = tmp_path / "a.safetensors"
    write_safetensors(path, {"odd_name": np.arange(3, dtype=np.float32)})
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0  # the format's requirement: data starts 8-byte aligned
    np.testing.assert_array_equal(read_safetensors(path)["odd_name"], np.arange(3))


def test_eos_comes_from_config_and_generation_config(tmp_path):
    # Llama 3 Instruct names <|eot_id|> only in generation_config.json; vLLM stops at
    # both files' EOS ids, and so does Engine with the loaded config's eos_token_ids.
    cfg = small_config()
    safetensors.numpy.save_file(random_hf_weights(cfg, seed=7), str(tmp_path / "m.safetensors"))
    hf_config = hf_config_dict(cfg, rms_norm_eps=cfg.rms_norm_eps)
    (tmp_path / "config.json").write_text(json.dumps({**hf_config, "eos_token_id": 9}))
    assert load_hf_safetensors(tmp_path).config.eos_token_ids == (9,)
    # Joined in order, config.json's first, each id once.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [11, 9]}))
    assert load_hf_safetensors(tmp_path).config.eos_token_ids == (9, 11)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**6}))
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id=1000000 "):
        load_hf_safetensors(tmp_path)


@pytest.mark.parametrize(
    "file, text, match",
    [
        ("config.json", '{"vocab_size": 6', "config.json: not valid JSON"),  # truncated
        ("config.json", "null", "config.json: holds a NoneType, not a JSON object"),
        ("generation_config.json", '{"eos_token_id": ', "generation_config.json: not valid"),
        ("generation_config.json", "[9]", "generation_config.json: holds a list, not a JSON"),
        # A ValueError from from_hf_dict named no file (which of several checkpoints?).
        ("config.json", '{"vocab_size": 64}', "config.json: Hugging Face config lacks"),
        (
            "config.json",
            json.dumps({**REQUIRED, "num_attention_heads": 3}),
            "config.json: Hugging Face config: hidden_size=32 must be a multiple of num_attention",
        ),
    ],
)
def test_a_config_file_that_is_no_valid_config_is_refused_naming_the_file(
    tmp_path, file, text, match
):
    # Used to raise a JSONDecodeError naming no file, or a TypeError / AttributeError.
    cfg = small_config()
    safetensors.numpy.save_file(random_hf_weights(cfg, seed=7), str(tmp_path / "m.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    (tmp_path / file).write_text(text)
    with pytest.raises(CheckpointError, match=match):
        load_hf_safetensors(tmp_path)
    with pytest.raises(ValueError, match="Hugging Face config must be a dict, got list"):
        LlamaConfig.from_hf_dict([("vocab_size", 64)])


def test_a_bad_dtype_argument_is_refused_as_the_argument_not_as_config_json(tmp_path):
    cfg = small_config()
    safetensors.numpy.save_file(random_hf_weights(cfg, seed=7), str(tmp_path / "m.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    with pytest.raises(ValueError, match="^dtype='float64' must be one of"):
        load_hf_safetensors(tmp_path, dtype="float64")
    assert load_hf_safetensors(tmp_path, dtype="bfloat16").config.dtype == "bfloat16"


def _raw(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


@pytest.mark.parametrize(
    "offsets, data_len, match",
    [
        # b reads a's last 4 bytes: two weights would share memory.
        ([(0, 8), (4, 12)], 12, r"'b'.*bytes \[4, 12\) overlaps the tensor before it"),
        ([(0, 8), (0, 8)], 8, r"'b'.*bytes \[0, 8\) overlaps the tensor before it"),
        ([(0, 8), (12, 20)], 20, r"'b'.*bytes \[12, 20\) leaves a gap before it"),
        ([(0, 8), (8, 16)], 20, r"bytes \[16, 20\) after the last tensor belong to no tensor"),
    ],
)
def test_byte_ranges_that_do_not_tile_the_data_are_refused(tmp_path, offsets, data_len, match):
    # The format's reference reader (safetensors) refuses each of these files too.
    header = {
        name: {"dtype": "F32", "shape": [2], "data_offsets": list(r)}
        for name, r in zip("ab", offsets, strict=True)
    }
    path = tmp_path / "w.safetensors"
    _raw(path, header, bytes(data_len))
    with pytest.raises(CheckpointError, match=match):
        read_safetensors(path)


def test_byte_ranges_in_any_header_order_and_empty_tensors_tile_the_data(tmp_path):
    header = {
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
        "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
    }
    path = tmp_path / "w.safetensors"
    _raw(path, header, np.array([1.0, 2.0], np.float32).tobytes())
    got = read_safetensors(path)
    assert (got["a"].tolist(), got["b"].tolist(), got["e"].shape) == ([1.0], [2.0], (0,))


def test_write_safetensors_stores_any_byte_order_little_endian(tmp_path):
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"x": np.arange(3, dtype=">f4"), "i": np.arange(2, dtype=">i8")})
    got = read_safetensors(path)
    assert got["x"].tolist() == [0.0, 1.0, 2.0] and got["i"].tolist() == [0, 1]
    assert got["x"].dtype == np.float32 and got["i"].dtype == np.int64


def test_write_safetensors_refuses_a_dtype_the_format_lacks_naming_the_tensor(tmp_path):
    path = tmp_path / "w.safetensors"
    with pytest.raises(ValueError, match="tensor 'c': dtype complex64"):
        write_safetensors(path, {"a": np.zeros(2, np.float32), "c": np.zeros(2, np.complex64)})
    assert not path.exists()


@pytest.mark.parametrize(
    "tensors, match",
    [
        ({7: np.zeros(2, np.float32)}, "tensor name 7 must be a str"),  # written as "7"
        ({"__metadata__": np.zeros(2, np.float32)}, "tensor name '__metadata__' must be"),
        ([("a", np.zeros(2, np.float32))], "tensors=list must be a mapping"),  # .items
    ],
)
def test_write_safetensors_refuses_names_its_reader_would_not_give_back(tmp_path, tensors, match):
    # Each was written: 7 read back as "7" (beside a "7" already there, a file the reader
    # refused), and "__metadata__" where the reader skips it, also a refused file.
    path = tmp_path / "w.safetensors"
    with pytest.raises(ValueError, match=match):
        write_safetensors(path, tensors)
    assert not path.exists()


def test_safetensors_refuse_a_file_descriptor_or_none_as_path(tmp_path):
    # An int was taken by open() as a file descriptor: written over or read, then closed.
    with open(tmp_path / "other", "wb") as f:
        for path in (f.fileno(), None):
            with pytest.raises(ValueError, match=f"path={path} must be a str or os.PathLike"):
                write_safetensors(path, {"x": np.zeros(2, np.float32)})
            with pytest.raises(ValueError, match=f"path={path} must be a str or os.PathLike"):
                read_safetensors(path)
        f.write(b"still open")
    assert (tmp_path / "other").read_bytes() == b"still open"


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.input_layernorm.weight.bak",
        "model.layers.1.mlp.up_proj.weight_old",
        "model.layers.0.self_attn.q_proj.weight\n",  # "$" matched before a final newline
    ],
)
def test_a_layer_name_with_a_suffix_is_not_a_llama_parameter(name):
    """Only whole Hugging Face names map: a layer weight's name with anything after it is
    refused, not read as that weight."""
    assert hf_to_jaxkv_name(name.rsplit(".weight", 1)[0] + ".weight")[0].startswith("layers.")
    with pytest.raises(CheckpointError, match="is not a Hugging Face Llama parameter"):
        hf_to_jaxkv_name(name)
