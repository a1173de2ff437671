"""Device-mesh checks of the KV copier (registered into mesh_common.CHECKS).

Imported by tests/sharding/mesh_checks.py after it has set XLA_FLAGS (8 CPU host
devices); see there for how the checks run.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxkv import sharding
from jaxkv.kv_copy import DeviceKVCopier
from tests.sharding.mesh_common import BLOCK_SIZE, check, model_config, shard_shapes


def _copier(state: dict, kv_replicas: int) -> DeviceKVCopier:
    """A copier of the caches in state["caches"], as an engine's reads and replaces its own."""
    return DeviceKVCopier(
        lambda: state["caches"],
        lambda caches: state.update(caches=caches),
        max_blocks=8,
        kv_replicas=kv_replicas,
    )


@check
def kv_loads_stay_on_the_engine_devices():
    """A load's blocks go to the devices of the caches they are written into, split along
    heads as the caches are when those hold each KV head once: an engine on devices 4-7 (a
    replica beside one on 0-3) staged every load whole on device 0, the other replica's.
    The blocks loaded read back as written."""
    devices = jax.devices()
    for num_kv_heads, tp, first in ((8, 4, 4), (2, 4, 4), (8, 1, 3)):
        mesh = sharding.make_mesh(tp, devices[first : first + tp])
        plan = sharding.plan_tensor_parallel(8, num_kv_heads, mesh)
        state = {
            "caches": sharding.init_kv_caches(model_config(num_kv_heads), plan, 16, BLOCK_SIZE)
        }
        copier = _copier(state, plan.kv_replicas)
        blocks = np.random.default_rng(0).standard_normal((3, *copier.block_shape))
        blocks = blocks.astype(copier.dtype)
        staged = copier.start_load([2, 5, 7], blocks).result()
        want = set(mesh.devices.flat)
        where = sorted(d.id for d in staged.sharding.device_set)
        print(
            f"  {num_kv_heads} KV heads, TP={tp} on {sorted(d.id for d in want)}: staged on {where}"
        )
        assert staged.sharding.device_set == want, where
        assert state["caches"][0].sharding.device_set == want
        heads = copier.block_shape[2] // (tp if plan.kv_replicas == 1 else 1)
        assert {s[3] for s in shard_shapes(staged)} == {heads}, shard_shapes(staged)
        np.testing.assert_array_equal(copier.start_save([2, 5, 7]).result(), blocks)
        copier.close()


@check
def kv_loads_into_caches_of_another_sharding_kind_stay_on_their_devices():
    """Caches of several devices under a sharding that is no NamedSharding (jax's
    GSPMDSharding, which jax's public API no longer makes but an array may carry): a
    load's blocks are staged whole on each of those devices, not on device 0."""
    from jax._src.sharding_impls import GSPMDSharding

    devices = jax.devices()[4:8]
    where = GSPMDSharding.get_replicated(devices)
    state = {"caches": [jax.device_put(np.zeros((16, BLOCK_SIZE, 4, 8), np.float32), where)]}
    copier = _copier(state, 1)
    blocks = np.random.default_rng(1).standard_normal((3, *copier.block_shape))
    blocks = blocks.astype(copier.dtype)
    staged = copier.start_load([2, 5, 7], blocks).result()
    on = sorted(d.id for d in staged.sharding.device_set)
    print(f"  caches under {type(where).__name__} on 4-7: staged on {on}")
    assert staged.sharding.device_set == set(devices), on
    assert set(shard_shapes(staged)) == {staged.shape}, shard_shapes(staged)  # whole on each
    np.testing.assert_array_equal(copier.start_save([2, 5, 7]).result(), blocks)
    copier.close()


@check
def kv_loads_into_caches_of_one_or_two_other_devices_stay_on_them():
    """Caches on one device that is not jax's default one (an engine replica of one
    device), or replicated on two: a load's blocks are staged on those devices, not on
    device 0 nor on one of the two only."""
    from jax._src.sharding_impls import GSPMDSharding

    devices = jax.devices()
    for where in (
        jax.sharding.SingleDeviceSharding(devices[5]),
        GSPMDSharding.get_replicated(devices[6:8]),
    ):
        state = {"caches": [jax.device_put(np.zeros((16, BLOCK_SIZE, 4, 8), np.float32), where)]}
        copier = _copier(state, 1)
        blocks = np.random.default_rng(2).standard_normal((2, *copier.block_shape))
        blocks = blocks.astype(copier.dtype)
        staged = copier.start_load([3, 9], blocks).result()
        on = sorted(d.id for d in staged.sharding.device_set)
        ids = sorted(d.id for d in where.device_set)
        print(f"  caches under {type(where).__name__} on {ids}: staged on {on}")
        assert staged.sharding.device_set == where.device_set, on
        assert set(shard_shapes(staged)) == {staged.shape}, shard_shapes(staged)
        np.testing.assert_array_equal(copier.start_save([3, 9]).result(), blocks)
        copier.close()
