"""The benchmarks compare what they time: benchmarks/output_agreement.py's verdict, and
benchmarks/attention.py failing a run whose cascade computes something else."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.output_agreement import TOLERANCE, agreement


def test_equal_outputs_agree_and_the_tolerance_is_relative():
    want = np.linspace(-3.0, 3.0, 24, dtype=np.float32).reshape(2, 3, 4)
    assert agreement(want, want, np.float32) == {"max_abs_diff": 0.0, "agrees": True}
    near = want + 0.9 * TOLERANCE["float32"] * (1 + np.abs(want))
    assert agreement(near, want, np.float32)["agrees"]
    far = want.copy()
    far[1, 2, 3] += 1e-3  # one entry of one row
    got = agreement(far, want, np.float32)
    assert not got["agrees"] and got["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert agreement(far, want, "bfloat16")["agrees"]  # within bfloat16's rounding


def test_a_nan_never_agrees_and_shapes_must_match():
    want = np.zeros((2, 2), np.float32)
    got = want.copy()
    got[0, 1] = np.nan
    assert agreement(got, want, np.float32) == {"max_abs_diff": float("inf"), "agrees": False}
    with pytest.raises(ValueError, match="shapes differ"):
        agreement(want[:1], want, np.float32)


@pytest.mark.parametrize("broken", [False, True])
def test_the_attention_benchmark_fails_a_point_whose_cascade_output_is_wrong(
    broken, tmp_path, monkeypatch, capsys
):
    # It timed and reported such a point (speedup and all) and exited 0: the difference
    # went to the JSON only, and JAX's reference was timed but never compared.
    from benchmarks import attention

    real = attention.paged_attention

    def paged_attention(q, kv, md, **kw):
        out = real(q, kv, md, **kw)
        return out + 1.0 if broken and md.num_levels else out

    monkeypatch.setattr(attention, "paged_attention", paged_attention)
    argv = ["--batch", "2", "--prefix", "16", "--suffix", "3", "--reps", "1"]
    status = attention.main([*argv, "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "attention.json").read_text())["results"]
    assert status == (1 if broken else 0) and row["outputs_agree"] is not broken
    assert row["jax_ref_max_abs_diff"] < 1e-4  # flat against JAX's reference, both runs
    assert (row["max_abs_diff"] >= 1.0) is broken
    assert ("FAIL: outputs disagree at (B, P, S) [(2, 16, 3)]" in capsys.readouterr().out) is broken


def test_bfloat16_allows_2e_2_relative_to_the_wanted_value_not_to_the_output():
    """The bfloat16 tolerance is 2e-2 * (1 + |want|): 0.05 off 0 disagrees, and an
    output 2.04 above a wanted 100 is past 2.02 even though 2.04 <= 2e-2 * (1 + |got|)."""
    assert TOLERANCE["bfloat16"] == 2e-2
    zero = np.zeros(3, np.float32)
    assert not agreement(zero + 0.05, zero, "bfloat16")["agrees"]
    want = np.full(3, 100.0, np.float32)
    assert not agreement(want + 2.04, want, "bfloat16")["agrees"]
    assert agreement(want + 2.0, want, "bfloat16")["agrees"]
