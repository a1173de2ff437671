"""What the GPU kernel's default tilings need per block, from Triton's compile, no GPU.

For each kind of call the engine makes (decode, prefill, cascade prefix pass), each head
layout and each query/KV dtype pair, lowers `kernels_pallas.gpu.ragged_paged_attention`
for CUDA with its default tiling (`kernels_pallas.gpu.tuning.default_config`), compiles
the Triton module to a cubin with the `triton` package for each compute capability
(kernels_pallas.gpu.aot), and reports shared memory per block against the GPU's limit,
registers per thread, and stack bytes per thread (registers ptxas spilled to local
memory; a few bytes can be a local array). Static figures: nothing runs, so they hold
on any machine with the same jax and triton. Prints a table and writes JSON.

    python benchmarks/gpu_compile_report.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

# Run as a script, only benchmarks/ is on sys.path: `import benchmarks` then failed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli_args import out_dir  # noqa: E402
from benchmarks.json_report import write_json  # noqa: E402
from kernels_pallas.gpu.aot import SHARED_BYTES_PER_BLOCK as SHARED_LIMIT  # noqa: E402
from kernels_pallas.gpu.aot import compile_triton_call, lower_kernel_call  # noqa: E402
from kernels_pallas.gpu.tuning import default_config  # noqa: E402
from kernels_pallas.precision import compute_dtype  # noqa: E402

KINDS = {  # tokens, sequences, kernel keywords
    "decode": (256, 256, {"max_q_len": 1}),
    "prefill": (2048, 8, {}),
    "prefix": (256, 1, {"causal": False}),
}
HEADS = {  # query heads, KV heads, head_dim
    "llama3-8b": (32, 8, 128),
    "llama3.2-1b": (32, 8, 64),
    "gqa8": (8, 1, 128),
    "mha-d256": (16, 16, 256),
}
DTYPES = {
    "bf16": (jnp.bfloat16, jnp.bfloat16),
    "f32": (jnp.float32, jnp.float32),
    "bf16/int8": (jnp.bfloat16, jnp.int8),
    "bf16/fp8": (jnp.bfloat16, jnp.float8_e4m3fn),
    "bf16/f32": (jnp.bfloat16, jnp.float32),  # a float32 cache under a bfloat16 model
}
PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES = 16, 64, 256


def tiling(kind: str, heads: str, dtypes: str):
    """The default tiling the kernel takes for this point: default_config sized, as the
    kernel sizes it, by the dots' dtype (kernels_pallas.precision.compute_dtype: float32
    for bfloat16 queries over a float32 cache), not the queries'."""
    tokens, seqs, kw = KINDS[kind]
    num_q_heads, num_kv_heads, head_dim = HEADS[heads]
    q_dtype, kv_dtype = DTYPES[dtypes]
    return default_config(
        max_num_tokens=tokens, max_num_seqs=seqs, max_q_len=kw.get("max_q_len"),
        num_kv_heads=num_kv_heads, group=num_q_heads // num_kv_heads, head_dim=head_dim,
        q_itemsize=compute_dtype(q_dtype, kv_dtype).itemsize,
        kv_itemsize=jnp.dtype(kv_dtype).itemsize,
        page_size=PAGE_SIZE, pages_per_seq=PAGES_PER_SEQ,
    )  # fmt: skip


def compile_point(kind: str, heads: str, dtypes: str, cc: int) -> dict:
    tokens, seqs, kw = KINDS[kind]
    num_q_heads, num_kv_heads, head_dim = HEADS[heads]
    q_dtype, kv_dtype = DTYPES[dtypes]
    call = lower_kernel_call(
        cc, num_tokens=tokens, num_seqs=seqs, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype,
        num_pages=NUM_PAGES, page_size=PAGE_SIZE, pages_per_seq=PAGES_PER_SEQ, **kw,
    )  # fmt: skip
    start = time.perf_counter()
    binary = compile_triton_call(call, cc)
    return dict(
        kind=kind, heads=heads, dtypes=dtypes, cc=cc, **tiling(kind, heads, dtypes)._asdict(),
        shared_bytes=binary.shared_bytes, shared_limit=SHARED_LIMIT[cc],
        fits=binary.shared_bytes <= SHARED_LIMIT[cc], registers=binary.registers,
        stack_bytes=binary.stack_bytes, compile_s=time.perf_counter() - start,
    )  # fmt: skip


def print_table(rows: list[dict], ccs: list[int]) -> None:
    by_point = {}
    for r in rows:
        by_point.setdefault((r["kind"], r["heads"], r["dtypes"]), {})[r["cc"]] = r
    head = f"{'kind':8} {'heads':12} {'q/kv':10} {'bm':>4} {'bk':>4} {'wp':>3}"
    head += "".join(f" | sm_{cc}: KiB reg stack" for cc in ccs)
    print(head)
    for (kind, heads, dtypes), per_cc in by_point.items():
        first = next(iter(per_cc.values()))
        line = f"{kind:8} {heads:12} {dtypes:10} {first['block_m']:>4} {first['block_k']:>4}"
        line += f" {first['num_warps']:>3}"
        for cc in ccs:
            r = per_cc.get(cc)
            if r is None:
                line += f" | {'-':>21}"
                continue
            mark = "" if r["fits"] else "!"
            line += f" | {r['shared_bytes'] / 1024:>10.0f}{mark:1} {r['registers']!s:>3} "
            line += f"{r['stack_bytes']!s:>5}"
        print(line)


def summary(rows: list[dict], ccs: list[int]) -> dict:
    out = {}
    for cc in ccs:
        at = [r for r in rows if r["cc"] == cc]
        if not at:  # every point skipped (float8 pages below 8.9)
            out[f"sm_{cc}"] = dict(tilings=0, shared_limit_kib=SHARED_LIMIT[cc] / 1024)
            continue
        spills = [r for r in at if (r["stack_bytes"] or 0) > 16]
        out[f"sm_{cc}"] = dict(
            tilings=len(at), over_shared_limit=sum(not r["fits"] for r in at),
            max_shared_kib=max(r["shared_bytes"] for r in at) / 1024,
            shared_limit_kib=SHARED_LIMIT[cc] / 1024, spilling=len(spills),
            max_stack_bytes=max((r["stack_bytes"] or 0) for r in at),
        )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", type=int, nargs="+", default=[80, 89, 90],
                        choices=sorted(SHARED_LIMIT), help="compute capabilities")  # fmt: skip
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    results = Path(__file__).resolve().parent / "results"  # whatever the working directory
    parser.add_argument("--out", type=out_dir, default=results, help="folder (%(default)s)")
    args = parser.parse_args()
    try:  # fail early: the report needs the triton package
        import triton
    except ImportError as e:  # was a ModuleNotFoundError traceback
        parser.error(
            f"needs the triton package ({e}): pip install 'triton==3.9.*' (Linux x86_64 "
            "wheels; jaxkv's test extra installs it)"
        )

    rows = []
    for kind, heads, dtypes, cc in itertools.product(args.kinds, args.heads, args.dtypes, args.cc):
        if dtypes == "bf16/fp8" and cc < 89:
            continue  # float8_e4m3fn needs compute capability 8.9; the kernel refuses it below
        rows.append(compile_point(kind, heads, dtypes, cc))
        print(".", end="", flush=True)
    print()
    print_table(rows, args.cc)
    totals = summary(rows, args.cc)
    for cc, s in totals.items():
        print(f"{cc}: {s}")
    meta = dict(
        machine=platform.machine(), jax=jax.__version__, triton=triton.__version__,
        page_size=PAGE_SIZE, pages_per_seq=PAGES_PER_SEQ,
        kinds={k: v[:2] for k, v in KINDS.items()},
    )  # fmt: skip
    path = args.out / "gpu_compile_report.json"
    write_json(path, dict(meta=meta, summary=totals, results=rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
