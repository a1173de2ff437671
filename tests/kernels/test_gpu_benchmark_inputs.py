"""The page tables of benchmarks/gpu_kernel.py share exactly what its table says they share."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernel.py"
_spec = importlib.util.spec_from_file_location("gpu_kernel_benchmark", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_shared_tables_share_the_prefix_pages_only():
    tables, pages_per_copy = bench.decode_tables(3, 64, 20, 16, shared=True, copies=2)
    assert tables.shape == (2, 3, 4 + 2)
    for copy in tables:
        assert np.all(copy[:, :4] == copy[0, :4])  # 64 prefix tokens = 4 shared pages
        own = copy[:, 4:]
        assert len(np.unique(own)) == own.size  # 20 own tokens = 2 pages, never shared
        assert not np.intersect1d(own, copy[0, :4]).size
    # Copies use disjoint pages, none of them the null page 0.
    assert not np.intersect1d(tables[0], tables[1]).size
    assert tables.min() >= 1 and tables.max() < 2 * pages_per_copy


def test_unique_tables_share_no_page():
    tables, pages_per_copy = bench.decode_tables(3, 64, 20, 16, shared=False, copies=1)
    assert len(np.unique(tables)) == tables.size == 3 * 6
    assert tables.min() >= 1 and tables.max() < pages_per_copy
