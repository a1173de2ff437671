from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.model_fingerprint import model_fingerprint
from jaxkv.models import TINY_CHECKPOINT, Llama, LlamaConfig, RopeScaling
from jaxkv.models.config import check_config
from jaxkv.models.llama import rope_inv_freq
from tests.models.conftest import hf_config_dict, random_model, small_config


def test_head_dim_is_derived_and_presets_have_published_sizes():
    assert LlamaConfig.preset("tiny").head_dim == 128 // 4
    # Published parameter counts of the two Llama checkpoints whose shapes the presets copy.
    assert LlamaConfig.preset("llama3_8b").num_params == 8_030_261_248
    assert LlamaConfig.preset("llama3_2_1b").num_params == 1_235_814_400


@pytest.mark.parametrize("name", ["llama3_2_1b", "llama3_8b"])
def test_big_presets_build_abstractly_with_the_config_shapes(name):
    # Two layers: every layer has the same shapes, and tracing all of them only costs time.
    cfg = LlamaConfig.preset(name, num_layers=2)
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert sum(int(np.prod(x.shape)) for x in leaves) == cfg.num_params
    layer = abstract.layers[cfg.num_layers - 1].self_attn
    assert layer.q_proj.kernel.shape == (cfg.hidden_size, cfg.num_heads * cfg.head_dim)
    assert layer.k_proj.kernel.shape == (cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
    assert all(x.dtype == np.dtype("bfloat16") for x in leaves)
    assert (abstract.lm_head is None) == cfg.tie_word_embeddings


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(num_heads=4, num_kv_heads=3), "multiple of"),
        (dict(hidden_size=30, num_heads=4), "hidden_size"),
        (dict(head_dim=7), "even"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(dtype="int8"), "dtype"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
        (dict(num_layers=2.0), "num_layers=2.0 must be an int"),
        (dict(hidden_size=True), "hidden_size=True must be an int"),
        (dict(dtype=None), "dtype=None must be one of"),
        (dict(dtype=np.dtype("float64")), "dtype='float64' must be one of"),
        # A numpy type that no dtype is made from (np.dtype raises TypeError on it).
        (dict(dtype=np.floating), "dtype=<class 'numpy.floating'> must be one of"),
    ],
)
def test_invalid_configs_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        small_config(**overrides)


@pytest.mark.parametrize("dtype", [np.dtype("bfloat16"), jnp.bfloat16])
def test_a_dtype_object_is_kept_by_name_so_configs_save_and_hash_alike(dtype):
    cfg = small_config(dtype=dtype)
    assert cfg.dtype == "bfloat16" and cfg == small_config(dtype="bfloat16")
    assert hash(cfg) == hash(small_config(dtype="bfloat16"))
    assert LlamaConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_preset_overrides_derive_head_dim_again():
    wide = LlamaConfig.preset("tiny", hidden_size=256)
    assert wide.head_dim == 64 == LlamaConfig(**{**wide.to_dict(), "head_dim": 0}).head_dim
    assert LlamaConfig.preset("tiny", num_heads=8, num_kv_heads=2).head_dim == 16
    assert LlamaConfig.preset("tiny", hidden_size=256, head_dim=32).head_dim == 32
    with pytest.raises(ValueError, match="hidden_size=130 must be a multiple"):
        LlamaConfig.preset("tiny", hidden_size=130)


def test_an_unknown_preset_is_refused_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown preset 'llama9'; choose from \['llama3_2_1b'"):
        LlamaConfig.preset("llama9")


def test_config_round_trips_through_dict_and_hf_dict():
    cfg = LlamaConfig.preset("llama3_2_1b")
    assert LlamaConfig.from_dict(cfg.to_dict()) == cfg
    hf = {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    }
    assert LlamaConfig.from_hf_dict(hf) == cfg
    with pytest.raises(ValueError, match="unknown"):
        LlamaConfig.from_dict({**cfg.to_dict(), "n_layer": 3})


def test_a_rope_scaling_dict_refused_for_a_value_names_rope_scaling():
    # As a dict (from to_dict, a jaxkv config.json) a bad value was refused as RopeScaling
    # said it, "self.factor=0.5 must be >= 1", naming no field of LlamaConfig.
    with pytest.raises(ValueError, match=r"^rope_scaling=\{'factor': 0.5\}: .*factor=0.5 must"):
        small_config(rope_scaling={"factor": 0.5})


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize(
    "values, match",
    [
        (dict(factor=0.5), "factor=0.5 must be >= 1"),
        (dict(low_freq_factor=4.0, high_freq_factor=1.0), "low_freq_factor=4.0 <"),
        (dict(original_max_position_embeddings=0), "original_max_position_embeddings=0"),
        (dict(factor=math.inf), "factor=inf must be a finite"),
    ],
)
def test_hf_rope_scaling_refusals_name_the_hf_key(key, values, match):
    # RopeScaling's own errors ("self.factor=0.5 must be >= 1") said nothing of config.json.
    scaling = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    hf = hf_config_dict(small_config(), **{key: {**scaling, **values}})
    with pytest.raises(ValueError, match=rf"^Hugging Face {key}: (?!.*self\.).*{match}"):
        LlamaConfig.from_hf_dict(hf)


@pytest.mark.parametrize("bad", [None, [("vocab_size", 64)], "{}"])
def test_from_dict_refuses_what_is_not_a_dict_by_name(bad):
    # None raised TypeError ("not iterable"), a list of pairs "unknown LlamaConfig fields
    # [('vocab_size', 64)]", a str one field per character.
    with pytest.raises(ValueError, match=f"d={type(bad).__name__} must be a dict of LlamaConfig"):
        LlamaConfig.from_dict(bad)


def test_llama3_rope_scaling_keeps_high_and_divides_low_frequencies():
    base = small_config(head_dim=64, hidden_size=256, rope_theta=500000.0)
    scaled = dataclasses.replace(base, rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192))
    f0, f1 = rope_inv_freq(base), rope_inv_freq(scaled)
    wavelen = 2 * np.pi / f0
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    assert high.any() and low.any()
    np.testing.assert_allclose(f1[high], f0[high])
    np.testing.assert_allclose(f1[low], f0[low] / 32.0, rtol=1e-6)
    mid = ~high & ~low
    assert np.all((f1[mid] < f0[mid]) & (f1[mid] > f0[mid] / 32.0))


def test_llama3_low_band_starts_at_original_length_over_low_freq_factor():
    # With low_freq_factor 2 the low band is wavelength > 8192 / 2 (not 8192 * 2): every
    # wavelength past 4096 is divided by the factor whole, none smoothed.
    base = small_config(head_dim=64, hidden_size=256, rope_theta=500000.0)
    scaled = dataclasses.replace(base, rope_scaling=RopeScaling(32.0, 2.0, 4.0, 8192))
    f0, f1 = rope_inv_freq(base), rope_inv_freq(scaled)
    wavelen = 2 * np.pi / f0
    low = wavelen > 8192 / 2
    assert (low & (wavelen <= 8192 * 2)).any()
    np.testing.assert_allclose(f1[low], f0[low] / 32.0, rtol=1e-6)


def test_kv_cache_bytes_per_token_of_llama3_8b():
    # K and V, 32 layers, 8 KV heads of 128: the well-known 128 KiB per token in bfloat16.
    cfg = LlamaConfig.preset("llama3_8b")
    assert cfg.kv_cache_bytes_per_token() == 128 * 1024
    assert cfg.kv_cache_bytes_per_token(itemsize=4) == 256 * 1024
    assert cfg.kv_cache_bytes_per_token(itemsize=np.int64(1)) == 64 * 1024
    # "2" returned a str of 131072 "2"s, -1 a negative size, 2.5 a fractional one.
    for bad in ("2", -1, 0, 2.5, True, None):
        with pytest.raises(ValueError, match=f"itemsize={bad!r} must be an int >= 1"):
            cfg.kv_cache_bytes_per_token(itemsize=bad)


@pytest.mark.parametrize("tied", [False, True])
def test_a_bfloat16_model_returns_float32_logits(tied):
    model = random_model(small_config(dtype="bfloat16", tie_word_embeddings=tied))
    assert model.dense_forward(jnp.zeros((1, 4), jnp.int32)).dtype == jnp.float32


def test_llama3_scaling_band_is_inclusive_at_the_low_frequency_edge():
    # As in Hugging Face, a wavelength exactly at original_max / low_freq_factor is in the
    # band with smoothing 0, so divided by factor. inv_freq[0] = 1: wavelength 2 pi.
    low = 8 / (2 * math.pi)
    assert 8 / low == 2 * math.pi
    cfg = small_config(rope_scaling=RopeScaling(4.0, low, 4.0, 8))
    np.testing.assert_allclose(rope_inv_freq(cfg)[0], 1 / 4.0, rtol=1e-6)


def test_eos_token_ids_take_the_hugging_face_spellings_and_round_trip():
    # Hugging Face writes eos_token_id as an int, a list (Llama 3 instruct) or null.
    base = LlamaConfig.preset("tiny")
    assert base.eos_token_ids == ()
    for given, want in ((258, (258,)), ([1, 258], (1, 258)), (None, ()), (np.int64(7), (7,))):
        cfg = dataclasses.replace(base, eos_token_ids=given)
        assert cfg.eos_token_ids == want and all(type(t) is int for t in cfg.eos_token_ids)
        assert LlamaConfig.from_dict(json.loads(cfg.to_json())) == cfg
    hf = {"vocab_size": 259, "hidden_size": 128, "intermediate_size": 384,
          "num_hidden_layers": 4, "num_attention_heads": 4}  # fmt: skip
    assert LlamaConfig.from_hf_dict(hf).eos_token_ids == ()
    assert LlamaConfig.from_hf_dict({**hf, "eos_token_id": [257, 258]}).eos_token_ids == (257, 258)
    for bad in (259, -1, [True], "258", 2.0, np.array([1.0])):
        with pytest.raises(ValueError, match="eos_token_ids=.* must be token ids in"):
            dataclasses.replace(base, eos_token_ids=bad)


@pytest.mark.parametrize("given", [np.array(7), jnp.array(7), jnp.array([7, 8]), [jnp.int32(7)]])
def test_eos_token_ids_take_integer_arrays_as_every_integer_field_does(given):
    # Refused as "must be token ids in [0, vocab_size)", although they were: field_checks
    # takes a 0-d integer array of numpy or JAX for an int everywhere else.
    want = tuple(np.atleast_1d(np.asarray(given)).tolist())
    cfg = dataclasses.replace(LlamaConfig.preset("tiny"), eos_token_ids=given)
    assert cfg.eos_token_ids == want and all(type(t) is int for t in cfg.eos_token_ids)


@pytest.mark.parametrize(
    "theta", [10000, np.float32(1e4), np.float64(1e4), np.int64(10000), jnp.float32(1e4)]
)
def test_real_fields_are_stored_as_floats_so_equal_configs_write_and_fingerprint_alike(theta):
    # 10000 used to write as "10000" beside an equal config's "10000.0" (another model
    # fingerprint for the same model), numpy scalars failed json.dumps (to_json,
    # save_checkpoint, an Engine's fingerprint), and a JAX scalar was refused.
    plain = small_config(rope_theta=10000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64))
    given = small_config(rope_theta=theta, rope_scaling=RopeScaling(8, 1, 4, 64))
    assert type(given.rope_theta) is float and type(given.rope_scaling.factor) is float
    assert given.to_json() == plain.to_json()
    assert model_fingerprint(given.to_kv_dict(), []) == model_fingerprint(plain.to_kv_dict(), [])


def test_a_real_field_too_large_for_a_float_is_refused_by_name():
    with pytest.raises(ValueError, match="rope_theta=1000.* must be a finite real number"):
        small_config(rope_theta=10**400)  # used to raise OverflowError from math.isfinite


@pytest.mark.parametrize("theta", [1e-50, 5e-324, 0.0, -1.0, math.inf, math.nan])
def test_a_rope_theta_whose_angles_overflow_or_that_is_not_positive_is_refused(theta):
    # 1e-50 was accepted and gave NaN logits: its largest inverse frequency times a
    # position below max_position_embeddings overflows float32, and cos(inf) is NaN.
    with pytest.raises(ValueError, match=f"rope_theta={theta!r} (is so small|must be)"):
        small_config(rope_theta=theta)
    least = small_config(rope_theta=1.1e-47)  # just above the bound for head_dim 8, 2048
    positions = np.arange(least.max_position_embeddings, dtype=np.float32)
    assert np.isfinite(positions[:, None] * rope_inv_freq(least)).all()
    # head_dim 2 rotates by the position itself whatever rope_theta is.
    assert small_config(hidden_size=8, head_dim=2, rope_theta=1e-300).head_dim == 2


@pytest.mark.parametrize("eps", [1e-39, 1e-50, 5e-324])
def test_an_rms_norm_eps_that_float32_flushes_to_zero_is_refused(eps):
    # Positive, so accepted; but the norms add it in float32, where XLA flushes a
    # subnormal to 0: a zero row (a zeroed padding embedding, say) then normalised to NaN.
    with pytest.raises(ValueError, match=f"^rms_norm_eps={eps!r} is below float32's least"):
        small_config(rms_norm_eps=eps)
    least = small_config(rms_norm_eps=float(np.finfo(np.float32).tiny))
    norm = Llama(least, rngs=nnx.Rngs(0)).norm
    assert np.asarray(norm(jnp.zeros((1, least.hidden_size)))).tolist() == [[0.0] * 32]


def test_defaults_are_the_documented_ones():
    assert RopeScaling() == RopeScaling(8.0, 1.0, 4.0, 8192)  # Llama 3.1's scaling
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2,
    )  # fmt: skip
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e4, 1e-5, 2048)
    assert (cfg.rope_scaling, cfg.tie_word_embeddings, cfg.dtype) == (None, False, "float32")
    assert LlamaConfig.preset("llama3_8b").max_position_embeddings == 8192


def test_the_tiny_preset_is_the_shipped_checkpoints_config_and_writes_its_layout():
    # to_json is config.json as save_checkpoint writes it, less the weights' digest line.
    text = (TINY_CHECKPOINT / "config.json").read_text()
    tiny = LlamaConfig.preset("tiny", eos_token_ids=258)
    digest = [line for line in text.splitlines() if '"params_sha256"' in line]
    assert tiny.to_json() + "\n" == text.replace(digest[0] + "\n", "")


def test_the_kv_dict_is_the_dict_less_eos_token_ids():
    cfg = LlamaConfig.preset("tiny", eos_token_ids=(1, 2))
    fields = cfg.to_dict()
    assert fields.pop("eos_token_ids") == (1, 2)
    assert cfg.to_kv_dict() == fields and "eos_token_ids" in cfg.to_dict()


@pytest.mark.parametrize("bad", [None, small_config().to_dict()])
def test_check_config_refuses_what_is_not_a_llama_config_by_name(bad):
    check_config(small_config())
    with pytest.raises(ValueError, match=f"^config={type(bad).__name__} must be a jaxkv.models"):
        check_config(bad)


def test_llama3_scaling_matches_hugging_faces_formula_frequency_by_frequency():
    # transformers' _compute_llama3_parameters, one frequency at a time in float64: kept
    # below original / high_freq_factor, divided by factor past original / low_freq_factor,
    # and in between (1 - s) * f / factor + s * f, s = (original / wavelength - low) / (high - low).
    s = RopeScaling(8.0, 1.0, 4.0, 8192)
    cfg = small_config(head_dim=128, hidden_size=512, rope_theta=500000.0, rope_scaling=s)
    want = []
    for i in range(0, 128, 2):
        f = 1.0 / 500000.0 ** (i / 128)
        wavelength = 2 * math.pi / f
        if wavelength < 8192 / 4.0:
            want.append(f)
        elif wavelength > 8192 / 1.0:
            want.append(f / 8.0)
        else:
            smooth = (8192 / wavelength - 1.0) / (4.0 - 1.0)
            want.append((1 - smooth) * f / 8.0 + smooth * f)
    assert 0 < smooth < 1  # the band between holds frequencies
    np.testing.assert_allclose(rope_inv_freq(cfg), np.float32(want), rtol=1e-6)
