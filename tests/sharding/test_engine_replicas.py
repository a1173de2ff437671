"""engine_replicas builds exactly num_replicas engines over the first device groups (all
of them allowed), and replica seeds wrap within EngineConfig's 64-bit range."""

from __future__ import annotations

import pytest

import jaxkv.engine
import jaxkv.sharding
from jaxkv.config import EngineConfig
from jaxkv.router import engine_replicas


class _Engine:
    def __init__(self, model, params, config, mesh, tokenizer):
        self.config, self.mesh, self.tokenizer = config, mesh, tokenizer
        self.params = params


@pytest.fixture
def three_groups(monkeypatch):
    """Three device groups, named m0 m1 m2, and engines that only record their inputs."""
    monkeypatch.setattr(jaxkv.sharding, "replica_meshes", lambda tp, devices: ["m0", "m1", "m2"])
    monkeypatch.setattr(jaxkv.engine, "Engine", _Engine)


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_num_replicas_engines_over_the_first_groups(three_groups, num_replicas):
    engines = engine_replicas(None, EngineConfig(seed=5), num_replicas=num_replicas)
    assert [e.mesh for e in engines] == ["m0", "m1", "m2"][:num_replicas]
    assert [e.config.seed for e in engines] == [5, 6, 7][:num_replicas]


@pytest.mark.parametrize("seed", [2**64 - 1, -1])
def test_replica_seeds_wrap_at_2_to_the_64(three_groups, seed):
    engines = engine_replicas(None, EngineConfig(seed=seed))
    assert [e.config.seed for e in engines] == [2**64 - 1, 0, 1]


def test_each_engine_gets_the_params_and_tokenizer_and_the_groups_of_the_devices_given(
    monkeypatch,
):
    """devices go to replica_meshes; params and tokenizer go to every Engine."""
    calls = []

    def meshes(tp, devices):
        calls.append((tp, devices))
        return ["m0", "m1"]

    monkeypatch.setattr(jaxkv.sharding, "replica_meshes", meshes)
    monkeypatch.setattr(jaxkv.engine, "Engine", _Engine)
    params, tokenizer, devices = object(), object(), ["d0", "d1", "d2", "d3"]
    engines = engine_replicas(
        None, tensor_parallel_size=2, devices=devices, params=params, tokenizer=tokenizer
    )
    assert calls == [(2, devices)]
    assert [e.params for e in engines] == [params, params]
    assert [e.tokenizer for e in engines] == [tokenizer, tokenizer]


@pytest.mark.parametrize("m1_close_raises", [False, True])
def test_a_failed_engine_closes_the_engines_built_before_it(monkeypatch, m1_close_raises):
    """The third engine fails: the first two are closed, newest first, and the error is
    the third engine's. A close that raises (m1's) used to replace the build error and
    leave m0 open; it is noted on the build error."""
    closed = []

    class Engine(_Engine):
        def __init__(self, model, params, config, mesh, tokenizer):
            if mesh == "m2":
                raise MemoryError("KV pool does not fit on m2")
            super().__init__(model, params, config, mesh, tokenizer)

        def close(self):
            closed.append(self.mesh)
            if m1_close_raises and self.mesh == "m1":
                raise RuntimeError("m1 would not close")

    monkeypatch.setattr(jaxkv.sharding, "replica_meshes", lambda tp, devices: ["m0", "m1", "m2"])
    monkeypatch.setattr(jaxkv.engine, "Engine", Engine)
    with pytest.raises(MemoryError, match="m2") as raised:
        engine_replicas(None)
    assert closed == ["m1", "m0"]
    notes = "".join(getattr(raised.value, "__notes__", []))
    assert ("RuntimeError('m1 would not close')" in notes) == m1_close_raises
