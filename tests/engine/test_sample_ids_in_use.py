"""IdsInUse: a request of n samples may not take an id any of whose sample ids is held."""

from __future__ import annotations

from jaxkv.parallel_sampling import IdsInUse


def test_every_sample_id_is_checked_not_only_the_first():
    """Under n = 3, "x" is in use while "2_x" (its last sample's id) is held, and while
    "1_x" is; under n = 1 only "x" itself counts."""
    assert "x" in IdsInUse({"2_x"}, n=3)
    assert "x" in IdsInUse(set(), {"1_x"}, n=3)
    assert "x" not in IdsInUse({"3_x"}, n=3)
    assert "x" not in IdsInUse({"0_x"}, n=1)
