"""The GPU kernel ahead of time, on a machine without a GPU: lowering and Triton's compile.

- `cuda_lowering_target` names the GPU to lower for.
- `lower_triton_calls` lowers a function for CUDA and returns the Triton module of each
  Pallas call in it: what XLA hands to its own Triton when it compiles the program on
  a GPU.
- `compile_triton_call` runs the `triton` package's compiler on such a module for a
  compute capability given by hand (GPU layouts, software pipelining, LLVM, PTX,
  ptxas), and reports what the binary needs per block: shared memory, registers and
  stack (spilled registers). XLA bundles a Triton build of its own, so this is the same
  pipeline, not the same build.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from kernels_pallas.gpu.ragged_paged_attention import ragged_paged_attention

DEFAULT_CUDA_DEVICE_KIND = "NVIDIA H200"
# A GPU of each compute capability, and the most dynamic shared memory one block may use
# there (CUDA C Programming Guide, compute capabilities table).
DEVICE_KIND = {80: "NVIDIA A100", 86: "NVIDIA A10", 89: "NVIDIA L4", 90: "NVIDIA H200"}
SHARED_BYTES_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


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


def kernel_arg_specs(
    *, num_tokens: int, num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
    q_dtype, kv_dtype, num_pages: int, page_size: int, pages_per_seq: int,
) -> tuple[jax.ShapeDtypeStruct, ...]:  # fmt: skip
    """Abstract arguments of `ragged_paged_attention` (q, kv_pages, kv_lens, page_indices,
    cu_q_lens, num_seqs), to lower it for given shapes without any data."""
    spec, i32 = jax.ShapeDtypeStruct, jnp.int32
    return (
        spec((num_tokens, num_q_heads, head_dim), q_dtype),
        spec((num_pages, page_size, 2 * num_kv_heads, head_dim), kv_dtype),
        spec((num_seqs,), i32),
        spec((num_seqs, pages_per_seq), i32),
        spec((num_seqs + 1,), i32),
        spec((1,), i32),
    )


@dataclasses.dataclass(frozen=True)
class TritonCall:
    """One Triton kernel of a program lowered for CUDA."""

    ir: str  # the Triton dialect module as text, without debug locations
    verified: bool  # whether the module passes the Triton dialect verifier
    num_warps: int
    num_stages: int


def lower_triton_calls(
    fn: Callable, args: Sequence, device_kind: str = DEFAULT_CUDA_DEVICE_KIND
) -> tuple[str, list[TritonCall]]:
    """The StableHLO text of `jax.jit(fn)(*args)` lowered for CUDA on `device_kind`, and
    its Triton calls in program order. `args` may be jax.ShapeDtypeStructs.

    Reads each module by wrapping JAX's Pallas-to-Triton lowering function for the
    duration of the call (a private JAX function; not thread-safe).
    """
    from jax._src.pallas.triton import pallas_call_registration as registration

    lowering = registration.lowering
    lower = lowering.lower_jaxpr_to_triton_module
    modules = []

    def lower_and_capture(*a, **kw):
        result = lower(*a, **kw)
        op = result.module.operation
        modules.append((op.get_asm(enable_debug_info=False), op.verify()))
        return result

    lowering.lower_jaxpr_to_triton_module = lower_and_capture
    try:
        with cuda_lowering_target(device_kind):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        lowering.lower_jaxpr_to_triton_module = lower
    lines = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    if len(lines) != len(modules):
        raise RuntimeError(f"{len(lines)} Triton custom calls but {len(modules)} modules")
    calls = []
    for line, (ir, verified) in zip(lines, modules, strict=True):
        (num_warps,) = re.findall(r"num_warps = (\d+)", line)
        (num_stages,) = re.findall(r"num_stages = (\d+)", line)
        calls.append(TritonCall(ir, verified, int(num_warps), int(num_stages)))
    return text, calls


def lower_kernel_call(
    compute_capability: int, *, num_tokens: int, num_seqs: int, num_q_heads: int,
    num_kv_heads: int, head_dim: int, q_dtype, kv_dtype, num_pages: int = 256,
    page_size: int = 16, pages_per_seq: int = 64, **kernel_kw,
) -> TritonCall:  # fmt: skip
    """The one Triton call of `ragged_paged_attention` for these shapes, lowered for the
    GPU of `compute_capability` (a key of DEVICE_KIND). `kernel_kw` goes to the kernel
    (causal, max_q_len, tiling knobs; default: its default tiling); 1-byte KV pages get
    k_scale = v_scale = 0.5."""
    args = kernel_arg_specs(
        num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype,
        num_pages=num_pages, page_size=page_size, pages_per_seq=pages_per_seq,
    )  # fmt: skip
    if jnp.dtype(kv_dtype).itemsize == 1:
        kernel_kw = {"k_scale": 0.5, "v_scale": 0.5, **kernel_kw}
    fn = functools.partial(ragged_paged_attention, sm_scale=head_dim**-0.5, **kernel_kw)
    _, (call,) = lower_triton_calls(fn, args, DEVICE_KIND[compute_capability])
    return call


@dataclasses.dataclass(frozen=True)
class TritonBinary:
    """What one compiled kernel needs per block; None where cuobjdump could not tell."""

    compute_capability: int
    shared_bytes: int
    registers: int | None  # per thread
    stack_bytes: int | None  # per thread: registers ptxas spilled, and local arrays


def compile_triton_call(call: TritonCall, compute_capability: int) -> TritonBinary:
    """Triton's compile of `call` to a cubin for `compute_capability` (80, 89, 90, ...).

    Needs the `triton` package (Linux); raises what Triton raises on a module it cannot
    compile. Compiles afresh: Triton's cache goes to a temporary folder, and the
    environment variables set for the compile are restored after it.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    options = {"num_warps": call.num_warps, "num_stages": call.num_stages}
    target = GPUTarget("cuda", compute_capability, 32)
    with tempfile.TemporaryDirectory() as tmp:
        saved = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TRITON_DEFAULT_FP_FUSION")}
        os.environ["TRITON_CACHE_DIR"] = str(Path(tmp) / "cache")
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, stated
        try:
            path = Path(tmp) / "kernel.ttir"
            path.write_text(call.ir)
            compiled = triton.compile(str(path), target=target, options=options)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        registers, stack = _resource_usage(triton, cubin)
    return TritonBinary(compute_capability, compiled.metadata.shared, registers, stack)


def _resource_usage(triton, cubin: Path) -> tuple[int | None, int | None]:
    """(registers, stack bytes) per thread from the cuobjdump that ships with Triton."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    try:
        out = subprocess.run(
            [str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None, None
    match = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(match[1]), int(match[2])) if match else (None, None)
