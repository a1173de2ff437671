"""When DeviceKVCopier's Futures are done: a load's once its scatter has run (the blocks
in the caches), not once its blocks reached the device; a scatter that fails there
fails the load."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import kv_copy
from jaxkv.kv_copy import DeviceKVCopier

BLOCK_SHAPE = (2, 2, 4)  # block_size, 2 * num_kv_heads, head_dim


class _Written:
    """Stands for a scatter's scalar on the device: ready once `ready` is set, then
    raising `error` if one is given, as a program that failed on the device does."""

    def __init__(self, error: Exception | None = None) -> None:
        self.ready = threading.Event()
        self.error = error

    def block_until_ready(self):
        self.ready.wait()
        if self.error is not None:
            raise self.error
        return self


def _load_with(monkeypatch, written: _Written):
    """(copier, Future of its load of two blocks whose scatter reports `written`, the
    blocks, the caches' holder); the real scatter still writes the caches."""
    scatter = kv_copy._scatter

    def reported_by_written(*args, **kwargs):
        caches, _ = scatter(*args, **kwargs)
        return caches, written

    monkeypatch.setattr(kv_copy, "_scatter", reported_by_written)
    state = {"caches": [jnp.zeros((8, *BLOCK_SHAPE), jnp.float32)]}
    copier = DeviceKVCopier(lambda: state["caches"], lambda c: state.update(caches=c), max_blocks=8)
    blocks = np.random.default_rng(0).standard_normal((2, 1, *BLOCK_SHAPE)).astype(np.float32)
    return copier, copier.start_load([3, 5], blocks), blocks, state


def test_a_load_is_done_only_once_its_scatter_has_run(monkeypatch):
    # It was done once the blocks were on the device, with the scatter still to run.
    written = _Written()
    copier, future, blocks, state = _load_with(monkeypatch, written)
    try:
        assert not future.done()
        (cache,) = state["caches"]  # set at once: later steps read them after the scatter
        np.testing.assert_array_equal(np.asarray(cache)[[3, 5]], blocks[:, 0])
        written.ready.set()
        staged = future.result(timeout=60)
        np.testing.assert_array_equal(np.asarray(staged)[:2], blocks)
    finally:
        written.ready.set()
        copier.close()


def test_a_scatter_that_fails_on_the_device_fails_the_load(monkeypatch):
    # Its failure showed only as the next step's error; the load was reported landed.
    written = _Written(RuntimeError("scatter failed on the device"))
    written.ready.set()
    copier, future, _, _ = _load_with(monkeypatch, written)
    try:
        with pytest.raises(RuntimeError, match="scatter failed on the device"):
            future.result(timeout=60)
    finally:
        copier.close()
