"""Megatron placement of a sharded model's weights, and mesh axes checked by name.

With TP above the KV heads (each KV head replicated on TP / num_kv_heads devices) the
K/V projections stay whole on every device while Q, gate/up and o/down are split; with
TP dividing the KV heads K/V are split too. The placement runs on 2 CPU host devices in a
subprocess (the device count must be set before jax is imported). An axis name that the
mesh lacks is refused with ValueError naming it, on whatever devices this process has.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxkv import sharding
from tests.sharding.host_devices import ROOT, host_device_env

SCRIPT = """
import json
import jax
from flax import nnx
from jaxkv import sharding
from jaxkv.models import Llama, LlamaConfig

assert len(jax.devices()) == 2, jax.devices()
specs = {}
for kv_heads in (1, 2):
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2,
        num_kv_heads=kv_heads, head_dim=8, max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    model = sharding.shard_model(Llama(cfg, rngs=nnx.Rngs(0)), sharding.make_mesh(2))
    tp = sharding.tensor_parallel_of(model)
    specs[kv_heads] = {"kv_replicas": tp.kv_replicas}
    for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
        specs[kv_heads][jax.tree_util.keystr(path)] = [str(a) for a in x.sharding.spec]
print(json.dumps(specs))
"""


@pytest.fixture(scope="module")
def specs() -> dict:
    env = host_device_env(2)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _spec(specs, kv_heads, layer, name):
    return specs[str(kv_heads)][f"['layers'][0]['{layer}']['{name}']['kernel'].value"]


def test_kv_projections_stay_whole_when_kv_heads_are_replicated(specs):
    assert specs["1"]["kv_replicas"] == 2
    assert _spec(specs, 1, "self_attn", "k_proj") == []
    assert _spec(specs, 1, "self_attn", "v_proj") == []
    assert _spec(specs, 1, "self_attn", "q_proj") == ["None", "model"]
    assert _spec(specs, 1, "self_attn", "o_proj") == ["model", "None"]
    assert _spec(specs, 1, "mlp", "up_proj") == ["None", "model"]
    assert _spec(specs, 1, "mlp", "down_proj") == ["model", "None"]


def test_kv_projections_are_split_when_tp_divides_the_kv_heads(specs):
    assert specs["2"]["kv_replicas"] == 1
    for name in ("q_proj", "k_proj", "v_proj"):
        assert _spec(specs, 2, "self_attn", name) == ["None", "model"], name
    assert specs["2"]["['lm_head']['kernel'].value"] == []


def test_an_axis_name_the_mesh_lacks_is_refused_by_name():
    mesh = sharding.make_mesh(1)
    with pytest.raises(ValueError, match="axis_name='tp' is not an axis of mesh.shape"):
        sharding.plan_tensor_parallel(2, 1, mesh, axis_name="tp")
    assert sharding.plan_tensor_parallel(2, 1, mesh).kv_replicas == 1
