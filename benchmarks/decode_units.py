"""Units of the figures the flat-vs-cascade decode benchmarks write to their JSON
(benchmarks/attention.py, benchmarks/tpu_kernel.py), written into it beside them: a
bandwidth key names no unit of its own, and a ratio says nothing of which way round it
is."""

from __future__ import annotations

BANDWIDTH = "bytes per second: the call's total bytes / its seconds"

UNITS = {
    "batch": "requests, one decode token each",
    "prefix": "tokens every request shares",
    "suffix": "tokens of each request's own",
    "flat_s": "seconds per call",
    "cascade_s": "seconds per call",
    "jax_ref_s": "seconds per call",
    "flat_bytes": "bytes of KV read per call",  # attention.py: KV only
    "cascade_bytes": "bytes of KV read per call",
    "flat_kv_bytes": "bytes of KV read per call",
    "cascade_kv_bytes": "bytes of KV read per call",
    "flat_total_bytes": "bytes read and written per call (benchmarks/attention_bytes.py)",
    "cascade_total_bytes": "bytes read and written per call (benchmarks/attention_bytes.py)",
    "speedup": "flat seconds / cascade seconds",
    "bytes_ratio": "flat KV bytes / cascade KV bytes",
    "total_bytes_ratio": "flat total bytes / cascade total bytes",
    "flat_bandwidth": BANDWIDTH,
    "cascade_bandwidth": BANDWIDTH,
    "read_bandwidth": "bytes per second, measured (a jitted sum: reads only)",
    "copy_bandwidth": "bytes per second, measured (an elementwise copy: read + write)",
    "peak_hbm_bandwidth": "bytes per second, the chip's datasheet peak",
    "flat_fraction_of_read": "flat_bandwidth / read_bandwidth",
    "cascade_fraction_of_read": "cascade_bandwidth / read_bandwidth",
    "flat_fraction_of_peak": "flat_bandwidth / peak_hbm_bandwidth",
    "flat_fraction_of_copy": "flat_bandwidth / copy_bandwidth",
    "cascade_vs_bytes_bound": "cascade seconds / (cascade total bytes / peak_hbm_bandwidth)",
    "max_abs_diff": "largest |cascade - flat| over the output's entries",
    "jax_ref_max_abs_diff": "largest |flat - JAX's reference| over the output's entries",
    "cascade_vs_flat_max_abs": "largest |cascade - flat| over the output's entries",
}


def units_of(*records: dict) -> dict[str, str]:
    """The unit of each key of `records` (the rows, the meta) that has one."""
    keys = {k for record in records for k in record}
    return {k: unit for k, unit in UNITS.items() if k in keys}
