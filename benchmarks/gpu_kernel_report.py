"""The GPU kernel benchmark's report: its table, and the kernel's targets read off it.

Used by benchmarks/gpu_kernel.py on the rows bench_config measures: per (B, P, S) and
cache dtype each method's microseconds per call and bytes per second, and the methods'
differences from flat on the timed inputs.
"""

from __future__ import annotations


def ratios(row: dict, copy_bps: float) -> dict:
    """The figures the table derives from a row's timings, for its JSON as for its line:
    flat_unique's and cascade's bandwidths (the bytes each must move over its time) as
    fractions of the copy bandwidth `copy_bps`, the bound, cascade's speedup over flat on
    the same shared pages (flat_shared us / cascade us), and JAX's kernel's time over
    flat_unique's (above 1: the kernel is faster)."""
    return {
        "flat_unique_fraction_of_copy": row["flat_unique_bytes_per_s"] / copy_bps,
        "cascade_fraction_of_copy": row["cascade_bytes_per_s"] / copy_bps,
        "flat_shared_over_cascade": row["flat_shared_us"] / row["cascade_us"],
        "jax_paged_over_flat_unique": row["jax_paged_us"] / row["flat_unique_us"],
    }


def kv_dtype_costs(rows: list[dict], base_kv_dtype: str) -> list[dict]:
    """Per row over another cache dtype than `base_kv_dtype` whose (B, P, S) was also
    timed over that one: each method's time over its time there (above 1: the other
    cache costs more), and its KV bytes over the base's."""
    base = {(r["B"], r["P"], r["S"]): r for r in rows if r["kv_dtype"] == base_kv_dtype}
    costs = []
    for r in rows:
        b = base.get((r["B"], r["P"], r["S"]))
        if r["kv_dtype"] == base_kv_dtype or b is None:
            continue
        cost = {"B": r["B"], "P": r["P"], "S": r["S"], "kv_dtype": r["kv_dtype"]}
        for method in ("flat_unique", "flat_shared", "cascade", "jax_paged"):
            cost[f"{method}_time_ratio"] = r[f"{method}_us"] / b[f"{method}_us"]
        cost["flat_kv_bytes_ratio"] = r["flat_kv_bytes"] / b["flat_kv_bytes"]
        costs.append(cost)
    return costs


def print_table(rows: list[dict], copy_bps: float) -> None:
    """One line per row: its cache dtype, flat over unique pages (us, GB/s, % of the copy
    bandwidth), flat over shared pages, cascade (us, GB/s, % of the copy bandwidth,
    flat_shared / cascade), JAX's kernel (us, and its time over flat_unique's), and the
    worst differences from flat of cascade / JAX.
    The ratios are `ratios`' (which the JSON's rows hold too)."""
    head = (
        f"{'B':>4} {'P':>5} {'S':>5} {'kv':>8} | "
        f"{'flat_uniq us':>12} {'GB/s':>6} {'%copy':>5} | "
        f"{'flat_shr us':>11} | {'cascade us':>10} {'GB/s':>6} {'%copy':>5} {'shr/casc':>8} | "
        f"{'jax us':>9} {'jax/flat':>8} | {'err c/j':>15}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        x = ratios(r, copy_bps)
        print(
            f"{r['B']:>4} {r['P']:>5} {r['S']:>5} {r['kv_dtype']:>8} | "
            f"{r['flat_unique_us']:>12.1f} "
            f"{r['flat_unique_bytes_per_s'] / 1e9:>6.0f} "
            f"{100 * x['flat_unique_fraction_of_copy']:>5.0f} | {r['flat_shared_us']:>11.1f} | "
            f"{r['cascade_us']:>10.1f} {r['cascade_bytes_per_s'] / 1e9:>6.0f} "
            f"{100 * x['cascade_fraction_of_copy']:>5.0f} {x['flat_shared_over_cascade']:>8.2f} | "
            f"{r['jax_paged_us']:>9.1f} "
            f"{x['jax_paged_over_flat_unique']:>8.2f} | "
            f"{r['cascade_vs_flat_max_abs']:.1e}/{r['jax_vs_flat_max_abs']:.1e}"
        )


def goals(rows: list[dict], copy_bps: float) -> dict:
    """The three targets of the GPU kernel, read off the table (a target whose
    configuration was not measured is left out); its ratios are `ratios`'."""
    rows = [r | ratios(r, copy_bps) for r in rows]
    pick = {(r["B"], r["P"], r["S"]): r for r in rows}
    g = {}
    r = pick.get((64, 8192, 128))
    if r:
        g["flat_decode_fraction_of_copy_B64_P8192_S128"] = r["flat_unique_fraction_of_copy"]
    r = pick.get((128, 8192, 128))
    if r:
        g["cascade_speedup_vs_flat_shared_B128_P8192_S128"] = r["flat_shared_over_cascade"]
        g["cascade_speedup_vs_flat_unique_B128_P8192_S128"] = r["flat_unique_us"] / r["cascade_us"]
    if rows:
        g["min_flat_speedup_vs_jax_paged"] = min(r["jax_paged_over_flat_unique"] for r in rows)
    return g
