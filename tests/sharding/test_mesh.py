"""Tensor parallelism and data-parallel replicas on 8 CPU host devices.

The checks live in tests/sharding/mesh_checks.py and the files it imports, and run in one
subprocess, because the host device count must be set before jax is imported and this
pytest process has imported jax already. Each test below asserts one check's result; a
failure shows that check's traceback and the subprocess's output.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.sharding.host_devices import ROOT, host_device_env

CHECKS = (
    "attention_flat_and_cascade",
    "pallas_backends_per_shard",
    "model_logits_and_shard_shapes",
    "attention_options_per_shard",
    "kv_heads_replicated_when_tp_exceeds_them",
    "model_on_a_mesh_axis_of_another_name",
    "tp8_collectives",
    "bad_tp_sizes",
    "replica_meshes_are_consecutive_device_groups",
    "engine_greedy_tp",
    "router_over_engine_replicas",
    "router_replicas_sample_independently",
    "offload_stores_replicated_kv_heads_once",
    "kv_loads_stay_on_the_engine_devices",
    "kv_loads_into_caches_of_another_sharding_kind_stay_on_their_devices",
    "kv_loads_into_caches_of_one_or_two_other_devices_stay_on_them",
    "sharded_step_lowers_for_tpu",
    "kv_caches_made_where_the_weights_lie",
    "weights_on_different_devices_are_refused_by_name",
    "weights_replicated_over_devices_serve_there",
    "prompt_logprobs_tp",
)
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("mesh") / "results.json"
    env = host_device_env(8)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sharding.mesh_checks", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    log = f"--- stdout\n{proc.stdout}\n--- stderr (tail)\n{proc.stderr[-4000:]}"
    if not out.exists():
        pytest.fail(f"mesh_checks exited {proc.returncode} without results\n{log}")
    return json.loads(out.read_text()), log


@pytest.mark.parametrize("name", CHECKS)
def test_mesh_check(mesh_results, name):
    results, log = mesh_results
    assert name in results, f"check {name} did not run\n{log}"
    result = results[name]
    assert result["ok"], f"{name} failed:\n{result['error']}\n{log}"


def test_every_check_is_listed(mesh_results):
    results, _ = mesh_results
    assert sorted(results) == sorted(CHECKS)
