"""Default tuning knobs of the TPU ragged paged attention kernel, by TPU generation.

The table asks no device anything: the kernel takes `tpu_generation` as a static
argument (default "default"), so lowering on a machine without a TPU uses the same table
as running on one. Only `detect_tpu_generation()` asks the runtime: the kernel calls it
for `tpu_generation="auto"` (which jaxkv.attention passes when it runs on a TPU), and
scripts on a TPU VM can call it to pass the key explicitly.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tiling of one kernel call."""

    num_queries_per_block: int  # query tokens per q tile (rows of the matmul: this x group)
    # Query tokens per q tile of a non-causal call (the cascade prefix pass, where one
    # sequence holds the whole batch): each q tile reads every prefix page once, so
    # larger tiles read the prefix fewer times.
    num_queries_per_block_non_causal: int
    kv_tokens_per_block: int  # target keys per KV block; pages per block = this // page_size
    vmem_limit_bytes: int | None  # scoped VMEM limit handed to Mosaic; None: compiler default


# Key schema: TPU generation as returned by `generation_from_device_kind` ("v4", "v5e",
# "v5p", "v6e"), plus "default" for a caller that does not say (the smallest VMEM
# footprint: fits the 16 MiB default scoped VMEM of every generation). Value: BlockSizes.
# Each row compiles with Mosaic for its generation (ahead-of-time compile on a CPU host
# with libtpu, see tests/kernels/test_tpu_aot_compile.py) for Llama-3-8B decode, prefill
# and a 128-token prefix pass; v5e/v5p/v6e raise the scoped VMEM limit (they have 95 to
# 128 MiB of VMEM) so a prefix pass reads the shared pages once per 128 query tokens. The
# timings behind them are NOT measured yet: benchmarks/tpu_kernel.py is the tool to tune.
TUNED_BLOCK_SIZES: dict[str, BlockSizes] = {
    "default": BlockSizes(32, 32, kv_tokens_per_block=256, vmem_limit_bytes=None),
    "v4": BlockSizes(32, 64, kv_tokens_per_block=256, vmem_limit_bytes=None),
    "v5e": BlockSizes(32, 128, kv_tokens_per_block=256, vmem_limit_bytes=64 * 2**20),
    "v5p": BlockSizes(32, 128, kv_tokens_per_block=512, vmem_limit_bytes=64 * 2**20),
    "v6e": BlockSizes(32, 128, kv_tokens_per_block=512, vmem_limit_bytes=64 * 2**20),
}


def block_sizes(tpu_generation: str) -> BlockSizes:
    """The table entry for `tpu_generation`; ValueError naming the known keys otherwise."""
    try:
        return TUNED_BLOCK_SIZES[tpu_generation]
    except KeyError:
        raise ValueError(f"{tpu_generation=} must be one of {sorted(TUNED_BLOCK_SIZES)}") from None


def generation_from_device_kind(device_kind: str) -> str | None:
    """TPU generation key of a `device_kind` string, None if it is not a TPU.

    "TPU v4" -> "v4", "TPU v5 lite" -> "v5e", "TPU v5" / "TPU v5p" -> "v5p",
    "TPU v6 lite" / "TPU v6e" -> "v6e", "TPU7x" -> "7x".
    """
    kind = device_kind.lower()
    if not kind.startswith("tpu"):
        return None
    gen = kind.removeprefix("tpu").strip().replace(" lite", "e").replace(" ", "")
    return {"v5": "v5p", "v6": "v6e"}.get(gen, gen)


def detect_tpu_generation() -> str | None:
    """Generation key of the first JAX device, None off TPU. Asks the runtime (the kernel
    only for tpu_generation="auto")."""
    import jax

    return generation_from_device_kind(jax.devices()[0].device_kind)
