"""SamplingParams' bool flags refuse anything but a bool, naming the field."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams

FLAGS = ("ignore_eos", "include_stop_str_in_output", "stream_text", "skip_special_tokens")


@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("value", ["no", 0, None])
def test_a_flag_that_is_not_a_bool_is_refused_by_name(name, value):
    """A flag read from text ("no") or given as 0 or None would switch by its truthiness."""
    with pytest.raises(ValueError, match=f"^{name}=.* must be a bool"):
        SamplingParams(**{name: value})
