"""Flat vs cascade decode attention vs JAX's own reference, on the current backend.

For decode batches of B requests sharing a P-token prefix, each with an S-token suffix of
its own, times (in the same run, on the same inputs):

- flat: jaxkv.attention.paged_attention with a flat plan (each request reads P + S keys);
- cascade: the same dispatch with a one-level cascade plan (prefix read once);
- jax_ref: jax.experimental.pallas.ops.tpu.ragged_paged_attention.ref_ragged_paged_attention
  (a Python loop over sequences, run eagerly: it cannot be jitted).

Reports the KV bytes read per step (flat: B*(P+S) tokens; cascade: P + B*S tokens; times
2 * num_kv_heads * head_dim * itemsize) and all the bytes each call moves
(benchmarks/attention_bytes.py: also queries, outputs and cascade's partial results),
the speedup next to both bytes ratios, achieved bandwidth (all bytes over time), its
fraction of the machine's measured read bandwidth (the `%read` columns, flat's and
cascade's; a jitted sum over 256 MiB: reads only, so no output buffer is allocated and
page-faulted in on every call), and whether the planner's default cost model picks
cascade there. Before a point's figures count, its outputs are compared on the timed
inputs (benchmarks/output_agreement.py): cascade against flat, and flat against JAX's
reference where that ran; the `agree` column says whether they agree, and a run with a
point that does not exits with status 1 (after writing its JSON). Prints a table, writes
JSON, and draws the speedup as a heatmap (prefix length x batch size) when matplotlib is
installed (the bench extra).

    python benchmarks/attention.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_bytes import decode_bytes, kv_bytes  # noqa: E402
from benchmarks.cli_args import (  # noqa: E402
    RESULTS_DIR,
    add_decode_grid_args,
    check_head_groups,
    check_whole_pages,
    out_dir,
    positive_int,
)
from benchmarks.decode_units import units_of  # noqa: E402
from benchmarks.device_timing import median_s  # noqa: E402
from benchmarks.json_report import write_json, write_whole  # noqa: E402
from benchmarks.kv_memory import gathered_kv_overflow  # noqa: E402
from benchmarks.output_agreement import agreement  # noqa: E402
from jaxkv.attention import default_backend, paged_attention  # noqa: E402
from jaxkv.batch import build_attention_metadata  # noqa: E402
from jaxkv.buckets import BucketConfig  # noqa: E402
from jaxkv.cascade import AttentionShape, CascadePlan, CascadePlanner  # noqa: E402
from jaxkv.cascade_plan import make_level  # noqa: E402


def read_bandwidth(nbytes: int = 1 << 28) -> float:
    """Bytes per second read by a jitted sum over `nbytes` (a copy would measure the
    CPU's page faults on its fresh output buffer more than memory bandwidth)."""
    x = jnp.ones(nbytes // 4, jnp.float32)
    return nbytes / median_s(jax.jit(jnp.sum), x, reps=5)


def make_inputs(rng, batch, prefix, suffix, *, block_size, shape: AttentionShape, dtype):
    """A block table where every row starts with the same prefix blocks, then its own."""
    prefix_blocks = prefix // block_size
    suffix_blocks = -(-suffix // block_size)
    num_blocks = 1 + prefix_blocks + batch * suffix_blocks
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    table = np.zeros((batch, prefix_blocks + suffix_blocks), np.int32)
    table[:, :prefix_blocks] = ids[:prefix_blocks]
    table[:, prefix_blocks:] = ids[prefix_blocks:].reshape(batch, suffix_blocks)
    kv_shape = (num_blocks, block_size, 2 * shape.num_kv_heads, shape.head_dim)
    kv_pages = jnp.asarray(rng.standard_normal(kv_shape, np.float32), dtype)
    return table, kv_pages


def metadata(table, batch, prefix, suffix, *, block_size, cascade: bool):
    prefix_blocks = prefix // block_size if cascade else 0
    rows = np.arange(batch, dtype=np.int32)
    levels = ()
    if cascade:
        levels = (make_level("global", [0], [batch], [0], [prefix_blocks], [0]),)
    plan = CascadePlan(
        rows, rows, np.full(batch, prefix_blocks, np.int32), levels, prefix // block_size
    )
    pages = table.shape[1]
    buckets = BucketConfig(
        max_num_tokens=max(batch, 8), max_num_seqs=batch, max_pages_per_seq=pages,
        min_num_tokens=max(batch, 8), min_num_seqs=batch, min_pages_per_seq=1,
    )  # fmt: skip
    return build_attention_metadata(
        block_table=table,
        plan=plan,
        query_lens=np.ones(batch, np.int64),
        num_computed_tokens=np.full(batch, prefix + suffix - 1),
        block_size=block_size,
        buckets=buckets,
        backend=default_backend(),
    )


def jax_reference(q, kv_pages, md, table, prefix, suffix, sm_scale):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

    batch = table.shape[0]
    return kernel.ref_ragged_paged_attention(
        q[:batch],
        kv_pages,
        jnp.full((batch,), prefix + suffix, jnp.int32),
        jnp.asarray(table),
        jnp.arange(batch + 1, dtype=jnp.int32),
        jnp.array([batch], jnp.int32),
        sm_scale=sm_scale,
    )


def figures(batch, prefix, suffix, t_flat, t_casc, bandwidth, sizes) -> dict:
    """One point's bytes (KV only, and all a call moves: benchmarks/attention_bytes.py),
    their flat / cascade ratios, the speedup and the achieved bandwidths (all bytes over
    time), each also as a fraction of the measured read `bandwidth`: the bound."""
    kv = dict(kv_per_token=2 * sizes["num_kv_heads"] * sizes["head_dim"] * sizes["kv_itemsize"])
    flat_kv = kv_bytes(batch, prefix, suffix, **kv, cascade=False)
    casc_kv = kv_bytes(batch, prefix, suffix, **kv, cascade=True)
    flat_bytes = decode_bytes(batch, prefix, suffix, **sizes, cascade=False)
    casc_bytes = decode_bytes(batch, prefix, suffix, **sizes, cascade=True)
    return dict(
        flat_bytes=flat_kv, cascade_bytes=casc_kv,  # KV only
        flat_total_bytes=flat_bytes, cascade_total_bytes=casc_bytes,
        speedup=t_flat / t_casc, bytes_ratio=flat_kv / casc_kv,
        total_bytes_ratio=flat_bytes / casc_bytes,
        flat_bandwidth=flat_bytes / t_flat, cascade_bandwidth=casc_bytes / t_casc,
        flat_fraction_of_read=flat_bytes / t_flat / bandwidth,
        cascade_fraction_of_read=casc_bytes / t_casc / bandwidth,
    )  # fmt: skip


def run(args) -> list[dict]:
    shape = AttentionShape(
        args.q_heads, args.kv_heads, args.head_dim, jnp.dtype(args.dtype).itemsize
    )
    planner = CascadePlanner(shape, backend=default_backend())
    sizes = dict(
        num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, kv_itemsize=shape.kv_itemsize, q_itemsize=shape.kv_itemsize,
    )  # fmt: skip
    bandwidth = read_bandwidth()
    print(f"backend {jax.default_backend()} ({default_backend()}), read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    rng = np.random.default_rng(0)
    sm_scale = shape.head_dim**-0.5
    results = []
    header = (
        f"{'B':>4} {'P':>5} {'S':>5} | {'flat ms':>8} {'casc ms':>8} {'jaxref ms':>9} | "
        f"{'speedup':>7} {'KV x':>7} {'all x':>7} | {'flat GB/s':>9} {'%read':>5} "
        f"{'casc GB/s':>9} {'%read':>5} | model   | agree"
    )
    print(header)
    print("-" * len(header))
    for batch in args.batch:
        for prefix in args.prefix:
            for suffix in args.suffix:
                table, kv_pages = make_inputs(
                    rng, batch, prefix, suffix, block_size=args.block_size, shape=shape,
                    dtype=args.dtype,
                )  # fmt: skip
                md_flat = metadata(
                    table, batch, prefix, suffix, block_size=args.block_size, cascade=False
                )
                md_casc = metadata(
                    table, batch, prefix, suffix, block_size=args.block_size, cascade=True
                )
                q = jnp.asarray(
                    rng.standard_normal(
                        (md_flat.max_num_tokens, shape.num_q_heads, shape.head_dim)
                    ),
                    args.dtype,
                )
                attn = jax.jit(lambda q, kv, md: paged_attention(q, kv, md, sm_scale=sm_scale))
                t_flat = median_s(attn, q, kv_pages, md_flat, reps=args.reps)
                t_casc = median_s(attn, q, kv_pages, md_casc, reps=args.reps)
                out_f = attn(q, kv_pages, md_flat)[:batch]
                checks = dict(cascade=agreement(attn(q, kv_pages, md_casc)[:batch], out_f, q.dtype))
                t_ref = None
                if args.jax_ref and batch * (prefix + suffix) <= args.jax_ref_max_tokens:
                    ref_args = (q, kv_pages, md_flat, table, prefix, suffix, sm_scale)
                    t_ref = median_s(jax_reference, *ref_args, reps=max(1, args.reps // 2))
                    checks["jax_ref"] = agreement(out_f, jax_reference(*ref_args), q.dtype)
                agrees = all(c["agrees"] for c in checks.values())
                chooses = planner.pays(batch, prefix, batch, batch * (prefix + suffix))
                row = dict(
                    batch=batch, prefix=prefix, suffix=suffix,
                    flat_s=t_flat, cascade_s=t_casc, jax_ref_s=t_ref,
                    **figures(batch, prefix, suffix, t_flat, t_casc, bandwidth, sizes),
                    cost_model_chooses_cascade=chooses,
                    max_abs_diff=checks["cascade"]["max_abs_diff"],  # cascade vs flat
                    jax_ref_max_abs_diff=checks.get("jax_ref", {}).get("max_abs_diff"),
                    outputs_agree=agrees,
                )  # fmt: skip
                results.append(row)
                ref = f"{t_ref * 1e3:9.2f}" if t_ref is not None else f"{'-':>9}"
                print(
                    f"{batch:>4} {prefix:>5} {suffix:>5} | {t_flat * 1e3:8.2f} "
                    f"{t_casc * 1e3:8.2f} {ref} | {row['speedup']:7.2f} "
                    f"{row['bytes_ratio']:7.1f} {row['total_bytes_ratio']:7.1f} | "
                    f"{row['flat_bandwidth'] / 1e9:9.2f} "
                    f"{100 * row['flat_fraction_of_read']:5.1f} "
                    f"{row['cascade_bandwidth'] / 1e9:9.2f} "
                    f"{100 * row['cascade_fraction_of_read']:5.1f} | "
                    f"{'cascade' if chooses else 'flat':<7} | {'yes' if agrees else 'NO'}"
                )
    return [dict(r, read_bandwidth=bandwidth) for r in results]


def heatmap(results: list[dict], path: Path) -> None:
    """Draws the speedup of `results`, a panel per suffix length, into the PNG `path`,
    written whole or not at all (a run stopped mid-write keeps the previous plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suffixes = sorted({r["suffix"] for r in results})
    batches = sorted({r["batch"] for r in results})
    prefixes = sorted({r["prefix"] for r in results})
    fig, axes = plt.subplots(1, len(suffixes), figsize=(4.2 * len(suffixes), 3.6), squeeze=False)
    for ax, suffix in zip(axes[0], suffixes, strict=True):
        grid = np.full((len(prefixes), len(batches)), np.nan)
        for r in results:
            if r["suffix"] == suffix:
                grid[prefixes.index(r["prefix"]), batches.index(r["batch"])] = r["speedup"]
        im = ax.imshow(grid, cmap="viridis", origin="lower")
        for (i, j), value in np.ndenumerate(grid):
            ax.text(j, i, f"{value:.1f}x", ha="center", va="center", color="w", fontsize=9)
        ax.set_xticks(range(len(batches)), batches)
        ax.set_yticks(range(len(prefixes)), prefixes)
        ax.set_xlabel("batch size")
        ax.set_ylabel("shared prefix length")
        ax.set_title(f"flat ms / cascade ms, suffix {suffix}")  # above 1: cascade is faster
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    write_whole(path, lambda tmp: fig.savefig(tmp, dpi=110))


def main(argv=None) -> int:
    """Runs the grid; 0, or 1 when a point's outputs disagree (see the module)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_grid_args(parser, heads=(8, 2, 64), page_flag="--block-size")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=positive_int, default=5)
    parser.add_argument("--no-jax-ref", dest="jax_ref", action="store_false")
    parser.add_argument(
        "--jax-ref-max-tokens", type=positive_int, default=1 << 17,
        help="skip JAX's eager reference above this many KV tokens per step (it is slow)",
    )  # fmt: skip
    parser.add_argument(
        "--out",
        type=out_dir,
        default=RESULTS_DIR,
        help="folder for the JSON and plot (%(default)s)",
    )
    args = parser.parse_args(argv)
    check_whole_pages(parser, args.prefix, args.block_size, "--prefix")
    check_head_groups(parser, args.q_heads, args.kv_heads)
    args.dtype = jnp.dtype(args.dtype)
    # The grid's largest point, checked before the first: past the device's memory it
    # failed mid-grid, and the points measured before it were lost with it.
    kv_per_token = 2 * args.kv_heads * args.head_dim * args.dtype.itemsize
    context = max(args.prefix) + max(args.suffix)
    if overflow := gathered_kv_overflow(max(args.batch), context, kv_per_token):
        parser.error(f"--batch, --prefix and --suffix: {overflow}")
    try:  # the plot's only dependency, in jaxkv's bench extra: without it, the JSON alone
        import matplotlib  # noqa: F401

        plot = args.out / "attention_speedup.png"
    except ImportError:
        plot = None
        print("matplotlib is not installed (jaxkv's bench extra): no plot, the JSON only")
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        machine=platform.machine(), processor=platform.processor(), jax=jax.__version__,
        backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
        q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        block_size=args.block_size, dtype=str(args.dtype),
    )  # fmt: skip
    units = units_of(meta, *results)
    write_json(args.out / "attention.json", dict(meta=meta, units=units, results=results))
    if plot is None:
        print(f"wrote {args.out / 'attention.json'}")
    else:
        heatmap(results, plot)
        print(f"wrote {args.out / 'attention.json'} and {plot}")
    wrong = [(r["batch"], r["prefix"], r["suffix"]) for r in results if not r["outputs_agree"]]
    if wrong:
        print(f"FAIL: outputs disagree at (B, P, S) {wrong}: their timings compare nothing")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
