"""The cascade cost model's units under tensor parallelism: one device's heads, one call."""

from __future__ import annotations

import pytest

from jaxkv.cascade import DEFAULT_COST_MODELS, AttentionShape, CascadePlanner

LLAMA_8B = AttentionShape(num_q_heads=32, num_kv_heads=8, head_dim=128, kv_itemsize=2)


@pytest.mark.parametrize(
    "tp, heads",
    [(1, (32, 8)), (2, (16, 4)), (8, (4, 1)), (16, (2, 1)), (32, (1, 1))],
)
def test_per_device_heads_follow_the_sharding(tp, heads):
    # jaxkv.sharding splits query and KV heads evenly over the mesh, and gives every
    # device one (replicated) KV head once the mesh has more devices than KV heads.
    shape = LLAMA_8B.per_device(tp)
    assert (shape.num_q_heads, shape.num_kv_heads) == heads
    assert (shape.head_dim, shape.kv_itemsize) == (128, 2)


@pytest.mark.parametrize("tp", [0, 3, 64, 2.0])
def test_per_device_refuses_a_size_that_cannot_split_the_query_heads(tp):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLAMA_8B.per_device(tp)


def test_a_prefix_that_pays_on_one_device_need_not_pay_per_device_of_eight():
    # Four requests sharing 1024 tokens save 3 * 1024 * 4 KiB = 12 MiB of KV reads on one
    # device, more than the 8 MiB a TPU call costs; split over 8 devices each saves
    # 1.5 MiB per call of its own, which does not pay.
    whole = CascadePlanner(LLAMA_8B, backend="pallas_tpu")
    per_device = CascadePlanner(LLAMA_8B.per_device(8), backend="pallas_tpu")
    assert DEFAULT_COST_MODELS["pallas_tpu"].launch_overhead_bytes == 8 << 20
    args = dict(num_requests=4, prefix_tokens=1024, num_query_tokens=4, context_tokens=4100)
    assert whole.pays(**args)
    assert not per_device.pays(**args)
