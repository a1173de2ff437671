"""benchmarks/attention_bytes.py: the bytes one decode call moves, counted by hand for a
small shape, and the figures benchmarks/attention.py derives from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.attention_bytes import decode_bytes, kv_bytes

# 2 requests sharing 32 tokens, 16 of their own; 4 query heads over 2 KV heads of 8 dims;
# 1-byte KV (fp8) and 2-byte queries, so a count that mixes the two itemsizes shows.
B, P, S = 2, 32, 16
SIZES = dict(num_q_heads=4, num_kv_heads=2, head_dim=8, kv_itemsize=1, q_itemsize=2)
KV_PER_TOKEN = 2 * 2 * 8 * 1  # K and V, 2 heads of 8 dims, 1 byte: 32
QUERIES = 2 * 4 * 8 * 2  # 2 tokens x 4 heads x 8 dims x 2 bytes: 128
OUT, LSE = 2 * 4 * 8 * 2, 2 * 4 * 4  # output in the query dtype; lse in float32
PARTIAL = 2 * 4 * (8 + 1) * 4  # one pass's float32 output and lse: 288


def test_flat_reads_every_requests_whole_context_and_writes_out_and_lse():
    kv = B * (P + S) * KV_PER_TOKEN  # 96 tokens: 3072
    assert kv_bytes(B, P, S, kv_per_token=KV_PER_TOKEN, cascade=False) == kv == 3072
    assert decode_bytes(B, P, S, **SIZES, cascade=False) == kv + QUERIES + OUT + LSE == 3360


def test_cascade_reads_the_prefix_once_and_pays_for_two_passes_and_a_merge():
    kv = (P + B * S) * KV_PER_TOKEN  # 64 tokens: 2048
    assert kv_bytes(B, P, S, kv_per_token=KV_PER_TOKEN, cascade=True) == kv == 2048
    passes = 2 * (QUERIES + PARTIAL)  # each reads the queries, writes a partial: 832
    merge = 2 * PARTIAL + OUT + LSE  # reads both partials, writes the result: 736
    assert decode_bytes(B, P, S, **SIZES, cascade=True) == kv + passes + merge == 3616


def test_at_a_large_batch_and_short_suffix_cascade_moves_more_bytes_than_flat():
    # 256 requests sharing 16 tokens, 1 token each of their own. Per request: queries 64
    # bytes, output 64, lse 16, one pass's partial 144.
    flat = 256 * 17 * KV_PER_TOKEN + 256 * (64 + 64 + 16)  # 139264 + 36864
    cascade = (16 + 256) * KV_PER_TOKEN + 256 * (2 * (64 + 144) + 2 * 144 + 64 + 16)
    assert decode_bytes(256, 16, 1, **SIZES, cascade=False) == flat == 176128
    assert decode_bytes(256, 16, 1, **SIZES, cascade=True) == cascade == 209408
    # KV alone would call cascade 16 times cheaper: its partials weigh more than the KV.
    kv = dict(kv_per_token=KV_PER_TOKEN)
    assert kv_bytes(256, 16, 1, **kv, cascade=False) == 16 * kv_bytes(
        256, 16, 1, **kv, cascade=True
    )


@pytest.mark.parametrize(
    "change,match",
    [
        ({"batch": 0}, "batch=0 must be an int >= 1"),
        ({"batch": True}, "batch=True must be an int"),
        ({"prefix": -32}, "prefix=-32 must be an int >= 0"),
        ({"suffix": 16.5}, "suffix=16.5 must be an int"),
        ({"num_q_heads": -4}, "num_q_heads=-4 must be an int >= 1"),
        ({"num_kv_heads": 0}, "num_kv_heads=0 must be an int >= 1"),
        ({"head_dim": 8.0}, "head_dim=8.0 must be an int"),
        ({"kv_itemsize": 0.5}, "kv_itemsize=0.5 must be an int"),
        ({"q_itemsize": -2}, "q_itemsize=-2 must be an int >= 1"),
        ({"cascade": None}, "cascade=None must be a bool"),
    ],
)
def test_decode_bytes_refuses_a_size_that_is_no_count_by_its_name(change, match):
    # A negative prefix or a fractional suffix gave a bound of bytes no call moves.
    args = dict(batch=B, prefix=P, suffix=S, **SIZES, cascade=True) | change
    with pytest.raises(ValueError, match=match):
        decode_bytes(**args)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"batch": -2}, "batch=-2 must be an int >= 1"),
        ({"prefix": 0.5}, "prefix=0.5 must be an int"),
        ({"suffix": -1}, "suffix=-1 must be an int >= 0"),
        ({"kv_per_token": 0}, "kv_per_token=0 must be an int >= 1"),
        ({"cascade": "no"}, "cascade='no' must be a bool"),
    ],
)
def test_kv_bytes_refuses_a_size_that_is_no_count_by_its_name(change, match):
    args = dict(batch=B, prefix=P, suffix=S, kv_per_token=KV_PER_TOKEN, cascade=False) | change
    with pytest.raises(ValueError, match=match):
        kv_bytes(**args)


def test_a_prefix_or_suffix_of_no_tokens_and_numpy_sizes_are_counted():
    import numpy as np

    assert kv_bytes(B, 0, S, kv_per_token=KV_PER_TOKEN, cascade=True) == B * S * KV_PER_TOKEN
    assert kv_bytes(B, P, 0, kv_per_token=KV_PER_TOKEN, cascade=True) == P * KV_PER_TOKEN
    sizes = {k: np.int64(v) for k, v in SIZES.items()}
    assert decode_bytes(np.int32(B), np.int64(P), S, **sizes, cascade=True) == 3616


def test_the_attention_benchmarks_figures_for_one_point():
    from benchmarks.attention import figures

    # Flat took 2 us, cascade 1 us, on a machine that reads 1 GB/s.
    row = figures(B, P, S, 2e-6, 1e-6, 1e9, SIZES)
    assert (row["flat_bytes"], row["cascade_bytes"]) == (3072, 2048)  # KV only
    assert (row["flat_total_bytes"], row["cascade_total_bytes"]) == (3360, 3616)
    assert row["speedup"] == pytest.approx(2.0)
    assert row["bytes_ratio"] == pytest.approx(1.5)  # flat over cascade
    assert row["total_bytes_ratio"] == pytest.approx(3360 / 3616)
    assert row["flat_bandwidth"] == pytest.approx(3360 / 2e-6)  # bytes per second
    assert row["cascade_bandwidth"] == pytest.approx(3616 / 1e-6)
    assert row["flat_fraction_of_read"] == pytest.approx(1.68)  # 1.68 GB/s of 1 GB/s
    assert row["cascade_fraction_of_read"] == pytest.approx(3.616)  # of 1 GB/s


def test_the_attention_benchmarks_table_holds_both_methods_against_the_read_bound(
    tmp_path, monkeypatch, capsys
):
    # The table printed GB/s alone, no figure against the measured read bandwidth, and
    # cascade's fraction of it was in neither the table nor the JSON.
    import json

    from benchmarks import attention

    monkeypatch.setattr(attention, "read_bandwidth", lambda: 1e9)
    monkeypatch.setattr(attention, "median_s", lambda fn, *args, reps: 1e-3)
    argv = ["--batch", "2", "--prefix", "16", "--suffix", "3", "--reps", "1", "--no-jax-ref"]
    assert attention.main([*argv, "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "attention.json").read_text())["results"]
    # 8 query heads over 2 KV heads of 64 dims, float32: 1024 bytes of KV a token.
    flat = 2 * 19 * 1024 + 4096 + 4160  # KV, queries, output and lse: 47168 bytes
    cascade = 22 * 1024 + 2 * (4096 + 4160) + 3 * 4160  # KV, two passes, merge: 51520
    assert row["flat_fraction_of_read"] == pytest.approx(flat / 1e-3 / 1e9)
    assert row["cascade_fraction_of_read"] == pytest.approx(cascade / 1e-3 / 1e9)
    lines = capsys.readouterr().out.splitlines()
    (header,) = [line for line in lines if line.lstrip().startswith("B ")]
    (printed,) = [line for line in lines if line.split()[:3] == ["2", "16", "3"]]
    assert header.split("|")[3].split() == ["flat", "GB/s", "%read", "casc", "GB/s", "%read"]
    assert printed.split("|")[3].split() == ["0.05", "4.7", "0.05", "5.2"]


def test_the_attention_benchmarks_tables_share_the_prefix_pages_only():
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.attention import make_inputs
    from jaxkv.cascade import AttentionShape

    shape = AttentionShape(4, 2, 8, 4)
    rng = np.random.default_rng(0)
    table, kv = make_inputs(rng, 3, 32, 20, block_size=16, shape=shape, dtype=jnp.float32)
    assert table.shape == (3, 2 + 2)  # 32 prefix tokens: 2 pages; 20 own: 2 pages
    assert np.all(table[:, :2] == table[0, :2])
    own = table[:, 2:]
    assert len(np.unique(own)) == own.size and not np.intersect1d(own, table[0, :2]).size
    assert table.min() >= 1 and kv.shape == (1 + 2 + 3 * 2, 16, 4, 8)


def test_every_figure_in_the_attention_json_has_its_unit(tmp_path, monkeypatch):
    # Its bandwidths (bytes per second) and ratios (which way round) named no unit.
    import json

    from benchmarks import attention

    monkeypatch.setattr(attention, "read_bandwidth", lambda: 1e9)
    monkeypatch.setattr(attention, "median_s", lambda fn, *args, reps: 1e-3)
    argv = ["--batch", "2", "--prefix", "16", "--suffix", "3", "--reps", "1"]
    assert attention.main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "attention.json").read_text())
    (row,) = report["results"]
    figures = {k for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert figures - set(report["units"]) == set()
    assert report["units"]["flat_bandwidth"].startswith("bytes per second")
    assert report["units"]["speedup"] == "flat seconds / cascade seconds"


def test_the_heatmap_says_which_way_round_its_speedup_is(tmp_path):
    # Its panels were titled "cascade / flat speedup": read as the README reads its other
    # ratios ("JAX / flat" is JAX's time over flat's), that is the inverse of what is drawn.
    import matplotlib.pyplot as plt

    from benchmarks import attention

    rows = [dict(batch=b, prefix=64, suffix=16, speedup=2.0 * b) for b in (2, 4)]
    attention.heatmap(rows, tmp_path / "speedup.png")
    (ax, _colorbar) = plt.gcf().axes
    plt.close("all")
    assert ax.get_title() == "flat ms / cascade ms, suffix 16"
    assert [t.get_text() for t in ax.texts] == ["4.0x", "8.0x"]  # flat took 4x cascade's time
    assert (tmp_path / "speedup.png").exists()


def test_each_heatmap_panel_draws_only_its_own_suffix(tmp_path):
    # One panel per suffix length: a point of another suffix at the same (batch, prefix)
    # cell must not overwrite this panel's figure.
    import matplotlib.pyplot as plt

    from benchmarks import attention

    rows = [
        dict(batch=b, prefix=64, suffix=s, speedup=float(b * s)) for s in (16, 32) for b in (2, 4)
    ]
    attention.heatmap(rows, tmp_path / "speedup.png")
    short, long = (ax for ax in plt.gcf().axes if ax.get_label() != "<colorbar>")
    plt.close("all")
    assert short.get_title().endswith("suffix 16") and long.get_title().endswith("suffix 32")
    assert [t.get_text() for t in short.texts] == ["32.0x", "64.0x"]
    assert [t.get_text() for t in long.texts] == ["64.0x", "128.0x"]


def test_a_plot_cut_midway_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    # savefig wrote the PNG in place: a run stopped mid-write left a cut file.
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    from benchmarks import attention

    rows = [dict(batch=b, prefix=64, suffix=16, speedup=2.0 * b) for b in (2, 4)]
    out = tmp_path / "speedup.png"
    attention.heatmap(rows, out)
    before = out.read_bytes()

    def cut_midway(self, fname, **kwargs):
        Path(fname).write_bytes(before[: len(before) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", cut_midway)
    with pytest.raises(KeyboardInterrupt):
        attention.heatmap([dict(r, speedup=3.0) for r in rows], out)
    plt.close("all")
    assert out.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["speedup.png"]


def test_without_matplotlib_the_attention_benchmark_writes_its_json_and_no_plot(
    tmp_path, monkeypatch, capsys
):
    # It ran the whole grid, wrote the JSON, then died on ModuleNotFoundError drawing the
    # plot (matplotlib is in the bench extra only).
    import sys

    from benchmarks import attention

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    monkeypatch.setattr(attention, "read_bandwidth", lambda: 1e9)
    monkeypatch.setattr(attention, "median_s", lambda fn, *args, reps: 1e-3)
    argv = ["--batch", "2", "--prefix", "16", "--suffix", "3", "--reps", "1"]
    assert attention.main([*argv, "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attention.json"]
    assert "matplotlib is not installed" in capsys.readouterr().out
