"""The Triton modules the Pallas GPU kernel lowers to, captured while lowering for CUDA.

Lowering needs no GPU: `cuda_lowering_target` names the GPU it is for. Each Pallas call
becomes one `__gpu$xla.gpu.triton` custom call that carries a Triton dialect module,
which XLA's Triton compiles when the program is compiled on a GPU.
"""

from __future__ import annotations

import dataclasses
import re

import jax

from kernels_pallas.gpu import cuda_lowering_target


@dataclasses.dataclass(frozen=True)
class TritonCall:
    """One Triton kernel of a lowered program."""

    ir: str  # the Triton dialect module as text, without debug locations
    verified: bool  # whether the module passes the Triton dialect verifier
    num_warps: int
    num_stages: int


def lower_for_cuda(
    fn, args, monkeypatch, device_kind: str = "NVIDIA H200"
) -> tuple[str, list[TritonCall]]:
    """The StableHLO text of `jax.jit(fn)` lowered for CUDA on `device_kind`, and its
    Triton calls in program order."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    lower = registration.lowering.lower_jaxpr_to_triton_module
    modules = []

    def lower_and_capture(*a, **kw):
        result = lower(*a, **kw)
        op = result.module.operation
        modules.append((op.get_asm(enable_debug_info=False), op.verify()))
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", lower_and_capture)
    with cuda_lowering_target(device_kind):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == len(modules), (len(calls), len(modules))
    out = []
    for line, (ir, verified) in zip(calls, modules, strict=True):
        (num_warps,) = re.findall(r"num_warps = (\d+)", line)
        (num_stages,) = re.findall(r"num_stages = (\d+)", line)
        out.append(TritonCall(ir, verified, int(num_warps), int(num_stages)))
    return text, out
