"""DeviceKVCopier.close: copies not yet begun are cancelled, and it returns once the one
running has ended."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np

from jaxkv import kv_copy
from jaxkv.kv_copy import DeviceKVCopier


def test_close_cancels_the_queued_copies_and_waits_for_the_running_one(monkeypatch):
    entered, release = threading.Event(), threading.Event()
    read_on_host = kv_copy._read_on_host

    def held_read(gathered, n):
        entered.set()
        release.wait()
        return read_on_host(gathered, n)

    monkeypatch.setattr(kv_copy, "_read_on_host", held_read)
    cache = jnp.arange(4 * 2 * 2 * 2, dtype=jnp.float32).reshape(4, 2, 2, 2)
    copier = DeviceKVCopier(lambda: [cache], lambda c: None, max_blocks=2)
    running = copier.start_save([1])
    assert entered.wait(30)  # the copy thread is reading it now
    queued = copier.start_save([2])
    timer = threading.Timer(0.5, release.set)  # lets the running copy end during close()
    timer.start()
    try:
        copier.close()
        assert running.done() and queued.cancelled()
        np.testing.assert_array_equal(running.result(), np.asarray(cache)[[1], None])
    finally:
        release.set()
        timer.cancel()
