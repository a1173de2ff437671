"""The environment of a subprocess that runs JAX on `n` CPU host devices (the device count
is fixed when JAX starts, so checks needing several devices run in a process of their
own), with this checkout importable."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def host_device_env(num_devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={num_devices}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env
