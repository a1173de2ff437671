"""checked_request_ids: the ids an abort is given, refused whole if any is no id."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.request_id_lists import checked_request_ids


def test_one_id_or_an_iterable_of_ids_in_order():
    assert checked_request_ids("a") == ["a"]
    assert checked_request_ids("req-1") == ["req-1"]  # one id, not its characters
    assert checked_request_ids(["b", "a"]) == ["b", "a"]
    assert checked_request_ids(iter(("x", "y"))) == ["x", "y"]
    assert checked_request_ids(()) == []


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (["a", 5], "holds 5 \\(int\\)"),
        (["a", 5, None, b"c"], "holds 5 \\(int\\): each"),  # the first of those that are no id
        (("a", None), "holds None"),
        ([b"a"], "holds b'a' \\(bytes\\)"),
        (b"ab", "must be a request id"),
        # Text as bytes is no id, nor a list of ids: b"" is not an empty list.
        (b"", "request_ids=b'' must be a request id"),
        (bytearray(b"ab"), "request_ids=bytearray\\(b'ab'\\) must be a request id"),
        (5, "must be a request id"),
        # Iterable by its type, not by its value: numpy's TypeError named nothing.
        (np.array("a"), "request_ids=array\\('a'.* must be a request id"),
    ],
)
def test_an_item_that_is_no_id_refuses_the_whole_list(ids, match):
    """Checked before any id is used, so a list with one bad item aborts nothing."""
    with pytest.raises(ValueError, match=match):
        checked_request_ids(ids)


@pytest.mark.parametrize("ids", ["a\ud800", ["a", "b\udc00"], iter(["\ud800"])])
def test_an_id_holding_a_lone_surrogate_refuses_the_whole_list(ids):
    """No request can hold such an id (Request refuses it, as it refuses the cache salt)."""
    with pytest.raises(ValueError, match="must be a request id \\(a str encodable as UTF-8\\)"):
        checked_request_ids(ids)
    assert checked_request_ids(["é", "日本"]) == ["é", "日本"]
