"""A tensor-parallel size below one is refused as such (must be >= 1), not as failing to
divide the device count; a positive one that does not divide is named with the count;
head counts that are no model's, and a tp that is no TensorParallel, are refused as such.
These run on whatever devices this process has (one CPU is enough)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxkv import sharding
from jaxkv.meshes import check_divides


@pytest.mark.parametrize("tp", [0, -1])
def test_a_size_below_one_is_refused_as_below_one(tp):
    for make in (sharding.replica_meshes, sharding.make_mesh):
        with pytest.raises(ValueError, match=rf"^tensor_parallel_size={tp} must be >= 1$"):
            make(tp)
    with pytest.raises(ValueError, match=rf"^tensor_parallel_size={tp} must be >= 1$"):
        check_divides(tp, "num_heads", 8)
    # Given with a mesh, it was named as disagreeing with the mesh's shape.
    with pytest.raises(ValueError, match=rf"^tensor_parallel_size={tp} must be >= 1$"):
        sharding.mesh_for(sharding.make_mesh(1), tp)


def test_a_size_that_is_not_the_mesh_axis_size_names_that_size():
    """Named with the size it must equal, not only with the mesh's shape (an OrderedDict)."""
    with pytest.raises(
        ValueError,
        match=r"^tensor_parallel_size=2 disagrees with the mesh: it must equal the size 1 of "
        r"its 'model' axis \(mesh.shape=\{'model': 1\}\)$",
    ):
        sharding.mesh_for(sharding.make_mesh(1), 2)


def test_a_size_that_does_not_divide_names_the_number():
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=3 must divide num_heads=8$"):
        check_divides(3, "num_heads", 8)
    check_divides(4, "num_heads", 8)  # divides: no error
    [mesh] = sharding.replica_meshes(1, jax.devices()[:1])
    assert mesh.shape == {"model": 1}


@pytest.mark.parametrize("counts", [(4, 0), (4, -2), ("4", 2), (4.0, 2), (0, 2), (3, 2), (True, 1)])
def test_plan_tensor_parallel_refuses_head_counts_that_are_not_a_model_by_name(counts):
    # (4, 0) raised ZeroDivisionError, ("4", 2) TypeError from str formatting, (4, -2) said
    # TP "exceeds num_kv_heads=-2"; (0, 2), (3, 2), (4.0, 2) and (True, 1) were planned.
    with pytest.raises(ValueError, match=r"^num_heads=.* and num_kv_heads=.* must be ints >= 1"):
        sharding.plan_tensor_parallel(*counts, sharding.make_mesh(1))
    assert sharding.plan_tensor_parallel(4, 2, sharding.make_mesh(1)).kv_replicas == 1


def test_shard_params_refuses_a_tp_that_is_no_tensor_parallel_by_name():
    # Each raised AttributeError (.axis_name, .shape) from inside the tree map.
    state = {"q_proj": {"kernel": jnp.zeros((4, 4))}}
    mesh = sharding.make_mesh(1)
    for bad in (mesh, None):
        with pytest.raises(ValueError, match=f"^tp={type(bad).__name__} must be a jaxkv.sharding"):
            sharding.shard_params(state, bad)
    with pytest.raises(ValueError, match="^mesh=str must be a jax.sharding.Mesh"):
        sharding.shard_params(state, sharding.TensorParallel("model"))
    placed = sharding.shard_params(state, sharding.TensorParallel(mesh))
    assert placed["q_proj"]["kernel"].shape == (4, 4)
