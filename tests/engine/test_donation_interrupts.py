"""A Ctrl-C that arrives while a jitted call donating the KV caches runs (the step
program, the copier's load scatter) leaves the engine its new caches: it used to be
raised just after the call returned, its result (the only live caches) dropped."""

from __future__ import annotations

import _thread
import pathlib
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import SamplingParams, held_interrupts, kv_copy, step_program
from jaxkv.held_interrupts import holding_interrupts
from jaxkv.kv_copy import DeviceKVCopier
from tests.engine._util import VOCAB, assert_all_blocks_free, dense_greedy, make_engine, tiny_model


def _interrupted_at_return(call):
    """`call`, with a SIGINT arriving while it runs (raised at its return, where the
    interpreter next looks for signals)."""

    def run(*args, **kwargs):
        result = call(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return result

    return run


def test_an_interrupt_during_a_load_scatter_keeps_the_loaded_caches(monkeypatch):
    shape = (2, 2, 4)  # block_size, 2 * num_kv_heads, head_dim
    rng = np.random.default_rng(0)
    host = rng.standard_normal((2, 8, *shape)).astype(np.float32)
    state = {"caches": [jnp.asarray(c) for c in host]}
    copier = DeviceKVCopier(lambda: state["caches"], lambda c: state.update(caches=c), max_blocks=8)
    try:
        blocks = rng.standard_normal((2, 2, *shape)).astype(np.float32)
        copier.start_load([1, 2], blocks).result()  # its scatter is compiled
        monkeypatch.setattr(kv_copy, "_scatter", _interrupted_at_return(kv_copy._scatter))
        with pytest.raises(KeyboardInterrupt):
            copier.start_load([3, 4], blocks)
        assert not any(c.is_deleted() for c in state["caches"])
        for layer, cache in enumerate(state["caches"]):
            np.testing.assert_array_equal(np.asarray(cache)[[3, 4]], blocks[:, layer])
    finally:
        copier.close()


def test_an_interrupt_during_a_load_scatter_into_one_layer_keeps_the_loaded_cache(monkeypatch):
    # One layer, one cache: the check of whether the caches were donated read a second.
    rng = np.random.default_rng(1)
    state = {"caches": [jnp.asarray(rng.standard_normal((8, 2, 2, 4)).astype(np.float32))]}
    copier = DeviceKVCopier(lambda: state["caches"], lambda c: state.update(caches=c), max_blocks=8)
    try:
        blocks = rng.standard_normal((2, 1, 2, 2, 4)).astype(np.float32)
        copier.start_load([1, 2], blocks).result()  # its scatter is compiled
        monkeypatch.setattr(kv_copy, "_scatter", _interrupted_at_return(kv_copy._scatter))
        with pytest.raises(KeyboardInterrupt):
            copier.start_load([3, 4], blocks)
        (cache,) = state["caches"]
        assert not cache.is_deleted()
        np.testing.assert_array_equal(np.asarray(cache)[[3, 4]], blocks[:, 0])
    finally:
        copier.close()


def test_an_interrupt_during_a_compiled_step_program_leaves_the_engine_serving():
    prompts = [np.random.default_rng(1).integers(0, VOCAB, 10).tolist()]
    with make_engine() as engine:
        engine.generate(prompts, SamplingParams(max_tokens=2), progress=False)  # compiled
        program = engine._program
        engine._program = _interrupted_at_return(program)
        request_id = engine.add_request(prompts[0], SamplingParams(max_tokens=4))
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        engine._program = program
        assert not any(c.is_deleted() for c in engine.kv_caches)
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [
                t for o in engine.step() for t in o.new_token_ids if o.request_id == request_id
            ]
        assert tokens == dense_greedy(prompts, 4)[0]
        assert_all_blocks_free(engine)


def test_a_held_interrupt_reaches_the_installed_handler_once_the_block_ends():
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with holding_interrupts(True):
            signal.raise_signal(signal.SIGINT)
            assert calls == []
        assert calls == [signal.SIGINT]
        with holding_interrupts(False):  # not held: handled at once
            signal.raise_signal(signal.SIGINT)
            assert len(calls) == 2
        assert signal.getsignal(signal.SIGINT) is not previous  # the test's handler is back
    finally:
        signal.signal(signal.SIGINT, previous)


# Loads held_interrupts.py by path (it imports only the standard library): the child
# process ends by the default SIGINT action, which no test may take in this process.
_DEFAULT_ACTION = """
import importlib.util, signal, sys
spec = importlib.util.spec_from_file_location("held", sys.argv[1])
held = importlib.util.module_from_spec(spec)
spec.loader.exec_module(held)
signal.signal(signal.SIGINT, signal.SIG_DFL)
with held.holding_interrupts(passes_on=lambda: True):
    signal.raise_signal(signal.SIGINT)
    print("held", flush=True)
print("lost", flush=True)
"""


def test_an_interrupt_passed_on_to_the_default_action_ends_the_process_on_leaving_the_block():
    # The default action cannot be called as a handler: it is taken once the block ends,
    # as under a held interrupt, not dropped.
    path = str(pathlib.Path(held_interrupts.__file__))
    proc = subprocess.run(
        [sys.executable, "-c", _DEFAULT_ACTION, path], capture_output=True, text=True, timeout=60
    )
    assert proc.stdout == "held\n" and proc.returncode == -signal.SIGINT, proc


def test_a_handler_installed_outside_python_is_left_in_place(monkeypatch):
    # getsignal answers None for a handler that C code installed: it could not be put
    # back after the block, so the block holds nothing and the signal goes to it at once.
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        monkeypatch.setattr(held_interrupts._signal, "getsignal", lambda signum: None)
        with holding_interrupts(True):
            signal.raise_signal(signal.SIGINT)
            assert calls == [signal.SIGINT]
        monkeypatch.undo()
        assert calls == [signal.SIGINT]  # not raised again on leaving the block
        assert signal.getsignal(signal.SIGINT) is not previous  # the test's handler stayed
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_interrupt_while_a_new_step_program_is_traced_is_raised_at_once(monkeypatch):
    # Held until the program had compiled and run, a Ctrl-C during a long compile would
    # wait for it: raised inside jax's tracing, it stops the compile before any donation.
    prompts = [np.random.default_rng(2).integers(0, VOCAB, 10).tolist()]
    traced = step_program.sample

    def interrupting(*args, **kwargs):
        _thread.interrupt_main()  # handled at the next call, still inside the trace
        return traced(*args, **kwargs)

    with make_engine() as engine:
        graphdef, state = nnx.split(tiny_model())
        # A jit of its own, which no other test compiled: its first step traces.
        engine._program = step_program.step_program.__wrapped__(graphdef, jax.tree.structure(state))
        engine.add_request(prompts[0], SamplingParams(max_tokens=3))
        monkeypatch.setattr(step_program, "sample", interrupting)
        with pytest.raises(KeyboardInterrupt) as raised:
            engine.step()
        # Raised where it was handled, in the trace, not once the program had run.
        assert any(entry.name == "interrupting" for entry in raised.traceback)
        monkeypatch.setattr(step_program, "sample", traced)
        assert not any(c.is_deleted() for c in engine.kv_caches)
        while engine.has_unfinished_requests():
            engine.step()
        assert_all_blocks_free(engine)
