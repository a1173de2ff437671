"""Lowering the GPU kernel for a CUDA device this process does not have (ahead of time)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

DEFAULT_CUDA_DEVICE_KIND = "NVIDIA H200"


@contextlib.contextmanager
def cuda_lowering_target(device_kind: str = DEFAULT_CUDA_DEVICE_KIND) -> Iterator[None]:
    """Makes `jit(f).trace(...).lower(lowering_platforms=("cuda",))` target `device_kind`.

    The Triton backend asks the current device which GPU it compiles for; without a GPU,
    JAX 0.11 and later refuse to lower unless an abstract GPU device names one. JAX 0.10
    ignores the context and compiles for compute capability 9.0 (an H100 or H200).
    `device_kind` is a JAX device kind such as "NVIDIA H200" or "NVIDIA A100". Trace
    inside the context as well as lower: the target is read from the abstract mesh current
    while the function is traced. On a machine whose GPU has this device kind, the result
    is the same as without the context.
    """
    if not device_kind.startswith("NVIDIA"):
        raise ValueError(f"{device_kind=} must be an NVIDIA device kind such as 'NVIDIA H200'")
    device = AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    with use_abstract_mesh(AbstractMesh((1,), ("lowering",), abstract_device=device)):
        yield
