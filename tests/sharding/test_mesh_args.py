"""Mesh arguments checked in this process, on whatever devices it has (one CPU is enough)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxkv import sharding
from jaxkv.router import engine_replicas
from tests.models.conftest import random_model, small_config


@pytest.mark.parametrize("tp", [0, -1, -2])
def test_a_tensor_parallel_size_below_one_is_refused_by_name(tp):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={tp}"):
        sharding.replica_meshes(tp)
    with pytest.raises(ValueError, match=f"tensor_parallel_size={tp}"):
        sharding.make_mesh(tp)


@pytest.mark.parametrize("tp", [True, 1.0])
def test_a_tensor_parallel_size_that_is_not_an_int_is_refused(tp):
    # True divides every device count and would make a 1-device mesh; 1.0 a TypeError.
    with pytest.raises(ValueError, match="must be an int"):
        sharding.replica_meshes(tp)
    with pytest.raises(ValueError, match="must be an int"):  # compared equal to 1 before
        sharding.mesh_for(sharding.make_mesh(1), tp)


def test_mesh_for_takes_the_mesh_or_the_size_and_refuses_them_disagreeing():
    mesh = sharding.make_mesh(1)
    assert mesh.shape == {sharding.DEFAULT_AXIS: 1}
    assert sharding.mesh_for(None, None) is None
    assert sharding.mesh_for(mesh) is mesh and sharding.mesh_for(mesh, 1) is mesh
    assert sharding.mesh_for(None, 1).shape == mesh.shape
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        sharding.mesh_for(mesh, 2)
    other_axis = Mesh(np.array(jax.devices()[:1]), ("data",))
    with pytest.raises(ValueError, match="'model'"):
        sharding.mesh_for(other_axis)


@pytest.mark.parametrize("extra", [1, 2])
def test_more_replicas_than_device_groups_is_refused_before_any_engine_is_built(extra):
    n = len(jax.devices()) + extra
    with pytest.raises(ValueError, match=f"num_replicas={n} needs {n} groups"):
        engine_replicas(None, num_replicas=n)  # the model is never touched
    with pytest.raises(ValueError, match="num_replicas=0"):
        engine_replicas(None, num_replicas=0)


@pytest.mark.parametrize("num_replicas", [0, -1])
def test_num_replicas_below_one_is_refused_as_below_one(num_replicas):
    """Named as needing "0 groups" (or "-1 groups") of devices before, not as below one."""
    with pytest.raises(
        ValueError, match=rf"^num_replicas={num_replicas} must be None or an int >= 1$"
    ):
        engine_replicas(None, num_replicas=num_replicas)


def test_num_replicas_given_as_a_numpy_integer_is_named_as_an_int():
    # Checked and used as the Python int as_int makes of it, not as numpy's repr.
    n = len(jax.devices()) + 1
    for num_replicas in (np.int64(n), np.array(n)):
        with pytest.raises(ValueError, match=f"^num_replicas={n} needs {n} groups"):
            engine_replicas(None, num_replicas=num_replicas)


def test_a_config_that_is_no_engine_config_is_refused_before_any_engine_is_built():
    with pytest.raises(ValueError, match="config=.* must be None or an EngineConfig"):
        engine_replicas(None, {"seed": 1})  # AttributeError on config.seed before


def test_every_projection_is_split_megatron_style_when_kv_heads_are_not_replicated():
    # Checked through the recorded PartitionSpecs, which a 1-device mesh keeps too: the
    # multi-device checks compare logits and a few shard shapes, which k and v kernels
    # silently replicated on every device would pass.
    sharded = sharding.shard_model(random_model(small_config()), sharding.make_mesh(1))
    tp = sharding.tensor_parallel_of(sharded)
    assert tp.kv_replicas == 1
    # Every layer's attention runs per shard, not only the first (the mesh checks' models
    # have one layer).
    assert len(sharded.layers) > 1
    assert all(layer.self_attn.tensor_parallel is tp for layer in sharded.layers)
    ax = sharding.DEFAULT_AXIS
    attn, mlp = sharded.layers[0].self_attn, sharded.layers[0].mlp
    for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
        assert linear.kernel[...].sharding.spec == P(None, ax)
    for linear in (attn.o_proj, mlp.down_proj):
        assert linear.kernel[...].sharding.spec == P(ax, None)
    assert sharded.embed_tokens.embedding[...].sharding.spec == P()


def test_k_and_v_projections_stay_whole_on_every_device_when_kv_heads_are_replicated():
    # With TP above the KV heads each device repeats all KV heads from whole K and V
    # projections; split ones would need an all-gather before the repeat. The logits are
    # the same either way, so only the recorded PartitionSpecs show it.
    graphdef, state = nnx.split(random_model(small_config()))
    tp = sharding.TensorParallel(sharding.make_mesh(1), kv_replicas=2)
    sharded = nnx.merge(graphdef, sharding.shard_params(state, tp))
    ax = sharding.DEFAULT_AXIS
    attn, mlp = sharded.layers[0].self_attn, sharded.layers[0].mlp
    for linear in (attn.k_proj, attn.v_proj):
        assert linear.kernel[...].sharding.spec == P()
    for linear in (attn.q_proj, mlp.gate_proj, mlp.up_proj):
        assert linear.kernel[...].sharding.spec == P(None, ax)
    for linear in (attn.o_proj, mlp.down_proj):
        assert linear.kernel[...].sharding.spec == P(ax, None)


@pytest.mark.parametrize("bad", ["model", jax.devices()[:1]])
def test_a_mesh_that_is_no_mesh_is_refused_by_name(bad):
    # Read as a Mesh it raised AttributeError on .shape.
    with pytest.raises(ValueError, match="must be None or a jax.sharding.Mesh"):
        sharding.mesh_for(bad)


def test_shard_model_refuses_a_model_or_mesh_of_another_type_by_name():
    # Each raised AttributeError (.config, .shape), naming neither argument.
    model = random_model(small_config())
    with pytest.raises(ValueError, match="model=NoneType must be a jaxkv.models.Llama"):
        sharding.shard_model(None, sharding.make_mesh(1))
    for bad in ("model", jax.devices()[:1]):
        with pytest.raises(ValueError, match=f"mesh={type(bad).__name__} must be a jax.sharding"):
            sharding.shard_model(model, bad)
        with pytest.raises(ValueError, match="must be a jax.sharding.Mesh"):
            sharding.plan_tensor_parallel(4, 2, bad)
    assert model.layers[0].self_attn.tensor_parallel is None


def test_shard_params_splits_only_the_kernels_of_megatron_layers():
    # A bias under q_proj and a kernel at the top of the tree are replicated (a kernel
    # path needs its layer's name); a plain dict's keys name the path as nnx's do.
    tp = sharding.TensorParallel(sharding.make_mesh(1))
    state = {
        "kernel": jnp.zeros((4, 4)),
        "q_proj": {"kernel": jnp.zeros((4, 8)), "bias": jnp.zeros(8)},
        "o_proj": {"kernel": jnp.zeros((8, 4))},
    }
    placed = sharding.shard_params(state, tp)
    ax = sharding.DEFAULT_AXIS
    assert placed["kernel"].sharding.spec == P()
    assert placed["q_proj"]["kernel"].sharding.spec == P(None, ax)
    assert placed["q_proj"]["bias"].sharding.spec == P()
    assert placed["o_proj"]["kernel"].sharding.spec == P(ax, None)


def test_a_sharded_model_makes_one_split_cache_per_layer():
    # The mesh checks' models have one layer, which hides a cache list cut to one.
    cfg = small_config()
    sharded = sharding.shard_model(random_model(cfg), sharding.make_mesh(1))
    caches = sharded.init_kv_caches(5, 4)
    assert cfg.num_layers == 2 and len(caches) == cfg.num_layers
    for c in caches:
        assert c.shape == (5, 4, 2 * cfg.num_kv_heads, cfg.head_dim)
        assert c.sharding.spec == P()  # one device: no split, as jit returns them


@pytest.mark.parametrize("devices", ["cpu", [None], jax.devices()[0], 3])
def test_devices_that_are_no_jax_devices_are_refused_by_name(devices):
    # "cpu" gave a mesh of the characters c, p and u (three replica meshes), [None] a mesh
    # whose first use raised AttributeError; one Device (not in a list) or an int raised
    # TypeError from list().
    for build in (sharding.make_mesh, sharding.replica_meshes):
        with pytest.raises(ValueError, match="devices=.* must be (a sequence of )?jax Devices"):
            build(1, devices=devices)


@pytest.mark.parametrize("tp", [True, 1.0])
def test_make_mesh_refuses_a_tensor_parallel_size_that_is_not_an_int(tp):
    """make_mesh names the size as no int, not a TypeError comparing None with the count."""
    with pytest.raises(ValueError, match="must be an int"):
        sharding.make_mesh(tp)


@pytest.mark.parametrize("axis_name", [None, 0, ["tp"], np.array("tp")])
def test_an_axis_name_that_is_no_str_is_refused_by_name(axis_name):
    # A list or array raised TypeError "unhashable type" from Mesh or the mesh lookup.
    match = "^axis_name=.* must be a mesh axis name \\(a str\\)$"
    with pytest.raises(ValueError, match=match):
        sharding.make_mesh(1, axis_name=axis_name)
    with pytest.raises(ValueError, match=match):
        sharding.replica_meshes(1, axis_name=axis_name)
    with pytest.raises(ValueError, match=match):
        sharding.shard_model(random_model(small_config(), seed=0), sharding.make_mesh(1),
                             axis_name=axis_name)  # fmt: skip


def test_a_mesh_that_names_an_axis_twice_is_refused_by_name():
    # jax's Mesh takes ("model", "model"); its shape then lists one "model" axis, and an
    # engine over 2 x 2 such devices failed at placement with an XLA reshape error.
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("model", "model"))
    model = random_model(small_config(), seed=0)
    match = r"^mesh.axis_names=\('model', 'model'\) must be distinct$"
    for use in (
        lambda: sharding.mesh_for(mesh),
        lambda: sharding.plan_tensor_parallel(4, 2, mesh),
        lambda: sharding.shard_model(model, mesh),
        lambda: sharding.kv_cache_sharding(mesh),
    ):
        with pytest.raises(ValueError, match=match):
            use()
    assert model.layers[0].self_attn.tensor_parallel is None


def test_meshes_are_built_on_the_axis_name_given():
    """replica_meshes and make_mesh name their one axis axis_name, not DEFAULT_AXIS."""
    [mesh] = sharding.replica_meshes(1, jax.devices()[:1], axis_name="tp")
    assert mesh.axis_names == ("tp",)
    assert sharding.make_mesh(1, jax.devices()[:1], axis_name="tp").axis_names == ("tp",)


def test_make_mesh_over_no_devices_is_refused_as_empty():
    """An empty device list is named as empty, not as fewer devices than TP."""
    with pytest.raises(ValueError, match="^devices must not be empty$"):
        sharding.make_mesh(2, devices=[])


def test_a_platform_name_for_devices_is_refused_as_given():
    """A str was listed into its characters: make_mesh(1, "cpu") named devices=['c']."""
    for build in (sharding.make_mesh, sharding.replica_meshes):
        with pytest.raises(ValueError, match=r"^devices='cpu' must be a sequence of jax Dev"):
            build(1, "cpu")


def test_make_mesh_refuses_more_devices_than_it_is_given_naming_both_counts():
    """TP past the devices is named with the count, not as failing to divide it."""
    d = jax.devices()[0]
    for tp, devices in ((len(jax.devices()) + 1, None), (3, [d])):
        count = len(jax.devices()) if devices is None else len(devices)
        with pytest.raises(
            ValueError, match=rf"^tensor_parallel_size={tp} exceeds the device count={count}$"
        ):
            sharding.make_mesh(tp, devices=devices)


def test_make_mesh_takes_only_the_first_tp_devices():
    """Devices past the first TP are not looked at, as vLLM's tensor_parallel_size."""
    d = jax.devices()[0]
    mesh = sharding.make_mesh(1, devices=[d, d])
    assert list(mesh.devices.flat) == [d]


class _TwoWide(sharding.TensorParallel):
    size = 2  # on one device: the split check runs before anything is placed


def test_shard_params_checks_only_the_split_dimension_against_tp():
    """A kernel whose unsplit dimension TP does not divide is placed; the split one is checked."""
    tp = _TwoWide(sharding.make_mesh(1))  # a TensorParallel: shard_params refuses others
    placed = sharding.shard_params({"q_proj": {"kernel": jnp.zeros((3, 4))}}, tp)
    assert placed["q_proj"]["kernel"].shape == (3, 4)
    with pytest.raises(ValueError, match="must divide dimension 1 .size 3. of parameter q_proj"):
        sharding.shard_params({"q_proj": {"kernel": jnp.zeros((4, 3))}}, tp)


def test_shard_model_places_the_params_given_not_the_model_weights():
    """params replaces the model's own weights; the model is left as it was."""

    cfg = small_config()
    model, other = random_model(cfg, seed=0), random_model(cfg, seed=1)
    sharded = sharding.shard_model(model, sharding.make_mesh(1), params=nnx.state(other))
    want = other.layers[0].self_attn.q_proj.kernel[...]
    got = sharded.layers[0].self_attn.q_proj.kernel[...]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(model.layers[0].self_attn.q_proj.kernel[...]), want)


def test_place_model_places_params_given_with_a_sharded_model_on_its_mesh():
    """Without a mesh, params given with a model shard_model placed become its weights on
    that model's mesh and axis (not left whole on one device beside it), and no params
    are handed back; without params the model is returned as it is."""
    cfg = small_config()
    mesh = sharding.make_mesh(1, axis_name="tp")
    sharded = sharding.shard_model(random_model(cfg, seed=0), mesh, axis_name="tp")
    other = random_model(cfg, seed=1)
    assert sharding.place_model(sharded, None, None) == (sharded, None)
    placed, params = sharding.place_model(sharded, nnx.state(other), None)
    assert params is None and placed is not sharded
    tp = sharding.tensor_parallel_of(placed)
    assert (tp.mesh, tp.axis_name) == (mesh, "tp")
    got = placed.layers[0].self_attn.q_proj.kernel[...]
    assert got.sharding.mesh == mesh and got.sharding.spec == P(None, "tp")
    want = other.layers[0].self_attn.q_proj.kernel[...]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_shard_model_refuses_params_of_other_shapes_by_name():
    """Weights of a wider MLP were placed as they came: the model failed at its first call
    (or, with a larger vocabulary, served logits of more tokens than its config has)."""
    model, mesh = random_model(small_config()), sharding.make_mesh(1)
    for other in (small_config(intermediate_size=64), small_config(vocab_size=80)):
        with pytest.raises(ValueError, match=r"params\[.*: shape \(\d+, \d+\) must be"):
            sharding.shard_model(model, mesh, params=nnx.state(random_model(other)))
    with pytest.raises(ValueError, match="params: a dict with 1 leaves must be the model's state"):
        sharding.shard_model(model, mesh, params={"a": jnp.zeros(2)})
    assert model.layers[0].self_attn.tensor_parallel is None


def test_a_sharded_model_makes_caches_of_the_dtype_asked_for():
    """init_kv_caches on a sharded model takes its dtype argument over the config's."""
    sharded = sharding.shard_model(random_model(small_config()), sharding.make_mesh(1))
    caches = sharded.init_kv_caches(5, 4, "bfloat16")
    assert {c.dtype for c in caches} == {jnp.dtype("bfloat16")}


def test_a_mesh_that_lists_a_device_twice_is_refused_by_name():
    """jax.sharding.Mesh takes a device twice; placing the weights on it then raised a bare
    AssertionError inside jax.device_put, from Engine(mesh=...) and shard_model alike."""
    d = jax.devices()[0]
    twice = Mesh(np.array([d, d]), (sharding.DEFAULT_AXIS,))
    with pytest.raises(ValueError, match=r"mesh.devices must be distinct, got ids \[0, 0\]"):
        sharding.mesh_for(twice)
    model = random_model(small_config())
    with pytest.raises(ValueError, match=r"mesh.devices must be distinct"):
        sharding.shard_model(model, twice)


def test_an_engine_serves_on_a_mesh_of_explicit_axes_as_jax_make_mesh_builds():
    """jax.make_mesh gives Explicit axes by default; the engine's first step failed with
    ShardingTypeError on the row-parallel o_proj matmul (construction passed). It now runs
    on the mesh's Auto twin and gives the unsharded engine's greedy tokens."""
    from jax.sharding import AxisType

    from jaxkv import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig

    model = random_model(small_config())
    config = EngineConfig(
        cache=CacheConfig(num_blocks=16, block_size=4),
        scheduler=SchedulerConfig(max_model_len=32, max_num_batched_tokens=32, max_num_seqs=2),
    )
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    with Engine(model, config=config) as engine:
        want = [o.output_token_ids for o in engine.generate([[1, 2, 3]], greedy)]
    explicit = jax.make_mesh((1,), (sharding.DEFAULT_AXIS,), axis_types=(AxisType.Explicit,))
    with Engine(model, config=config, mesh=explicit) as engine:
        assert engine.mesh.axis_types == (AxisType.Auto,)
        assert list(engine.mesh.devices.flat) == list(explicit.devices.flat)
        assert [o.output_token_ids for o in engine.generate([[1, 2, 3]], greedy)] == want
