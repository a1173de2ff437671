"""The context in which the engine's deliberate host-device transfers run.

The engine's step hands its inputs to the jitted program and fetches the sampled tokens;
the KV copier moves blocks between device and host. Serving stacks set
jax.transfer_guard("disallow") (or "log") to catch accidental transfers, so these run
inside jax.transfer_guard("allow"), but only when a guard is set: entering and leaving
it costs about 10 us of CPU per step, and over 100 us in a step that follows an idle
wait for the device.
"""

from __future__ import annotations

import contextlib

import jax

__all__ = ["allowing_transfers"]

# Every setting a guard can come from (flag, environment or context, thread-local too).
_GUARD_SETTINGS = (
    "jax_transfer_guard",
    "jax_transfer_guard_host_to_device",
    "jax_transfer_guard_device_to_device",
    "jax_transfer_guard_device_to_host",
)


def allowing_transfers() -> contextlib.AbstractContextManager:
    """jax.transfer_guard("allow") if any transfer guard is set to other than "allow",
    else a context that does nothing."""
    if all(getattr(jax.config, name) in (None, "allow") for name in _GUARD_SETTINGS):
        return contextlib.nullcontext()
    return jax.transfer_guard("allow")
