"""ByteTokenizer round trips: any text exactly, any bytes as ids, invalid UTF-8 as U+FFFD."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.models import ByteTokenizer, LlamaConfig

TOK = ByteTokenizer()
SPECIALS = (TOK.pad_id, TOK.bos_id, TOK.eos_id)


@settings(max_examples=80, deadline=None)
@given(st.text(), st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS))))
def test_any_text_round_trips_and_specials_anywhere_are_dropped(text, inserts):
    ids = TOK.encode(text, bos=True, eos=True)
    assert ids[1:-1] == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids[1:-1])
    assert TOK.encode_array(text).tolist() == ids[1:-1]
    for where, special in inserts:  # specials may split a multi-byte character
        ids.insert(where % (len(ids) + 1), special)
    assert TOK.decode(ids) == text
    assert TOK.decode(np.asarray(ids, np.int64)) == text


@settings(max_examples=200, deadline=None)
@given(st.binary())
def test_any_bytes_are_ids_exactly_and_decode_like_utf8_with_replacement(data):
    ids = TOK.encode_array(data)
    assert ids.dtype == np.int32 and bytes(ids.astype(np.uint8)) == data
    assert TOK.decode(ids) == data.decode("utf-8", errors="replace")


def test_invalid_utf8_cases_by_hand():
    # A character cut mid-way, a lone continuation byte, an overlong "/", a UTF-16 surrogate
    # encoded in UTF-8: each maximal invalid subpart becomes one U+FFFD.
    assert TOK.decode(list("é".encode())[:1] + [ord("a")]) == "\ufffda"
    assert TOK.decode([0x80]) == "\ufffd"
    assert TOK.decode([0xC0, 0xAF]) == "\ufffd\ufffd"
    assert TOK.decode([0xED, 0xA0, 0x80]) == "\ufffd" * 3
    assert TOK.decode([]) == ""
    # A str holding a lone surrogate is not Unicode text: refused, not mangled.
    with pytest.raises(ValueError):
        TOK.encode("\ud800")
    # Not a str at all: refused by name (None raised AttributeError, bytes too).
    for bad in (None, b"abc", 97):
        with pytest.raises(ValueError, match=f"text must be a str, got {type(bad).__name__}"):
            TOK.encode(bad)


def test_encode_array_and_decode_refuse_what_is_not_text_or_ids_by_name():
    # None, an int or a list raised numpy's TypeError, and an int32 array of ids was
    # read as its bytes: [72, 105] became [72, 0, 0, 0, 105, 0, 0, 0].
    for bad in (None, 97, [72, 105], np.array([72, 105], np.int32)):
        with pytest.raises(
            ValueError, match=f"text must be a str or bytes, got {type(bad).__name__}"
        ):
            TOK.encode_array(bad)
    for data in (b"Hi", bytearray(b"Hi"), memoryview(b"Hi"), np.frombuffer(b"Hi", np.uint8)):
        assert TOK.encode_array(data).tolist() == [72, 105]
    for bad in (None, 72):  # a TypeError from iterating them
        with pytest.raises(ValueError, match=f"ids must be an iterable of token ids, got {bad}"):
            TOK.decode(bad)


def test_encode_array_reads_buffers_whose_bytes_are_not_contiguous():
    # A stepped slice or a transposed array raised BufferError or "ndarray is not
    # C-contiguous"; their bytes in order are the text, as bytes(data) reads them.
    rows = np.frombuffer(b"HxiyHxiy", np.uint8).reshape(2, 4)
    for data, want in (
        (memoryview(b"Hxi")[::2], [72, 105]),
        (rows[0, ::2], [72, 105]),
        (rows[:, ::2], [72, 105, 72, 105]),
        (rows.T, [72, 72, 120, 120, 105, 105, 121, 121]),
    ):
        assert TOK.encode_array(data).tolist() == want == list(bytes(data))


def test_bos_and_eos_are_added_independently():
    assert TOK.encode("a", bos=True) == [TOK.bos_id, 97]
    assert TOK.encode("a", eos=True) == [97, TOK.eos_id]
    assert TOK.encode("") == [] and TOK.encode("", bos=True, eos=True) == [TOK.bos_id, TOK.eos_id]
    # By truthiness, "false" added the token and None left it out, without a word.
    for flag in ("bos", "eos"):
        for bad in ("false", None, 1, np.True_):
            with pytest.raises(ValueError, match=f"{flag}={bad!r} must be a bool"):
                TOK.encode("a", **{flag: bad})


def test_special_ids_and_vocab_are_the_documented_ones():
    # Checkpoints trained on these ids depend on them, and every id the tokenizer emits
    # must be a row of the embedding of a model of its vocab size (the tiny preset).
    tok = ByteTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.vocab_size == LlamaConfig.preset("tiny").vocab_size


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 258), st.integers(-(2**70), 2**70))))
def test_a_list_of_ints_decodes_as_any_other_iterable_of_them(ids):
    # A list of plain ints takes a path of its own: the same text, out-of-range ids
    # (negative, specials, past 64 bits) dropped as on the checked path of a tuple.
    want = bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
    assert TOK.decode(ids) == TOK.decode(tuple(ids)) == want


def test_a_list_holding_a_bool_a_float_or_numpy_ints_is_checked_per_id():
    for bad in ([104, True], [False], [104, 1.0]):
        with pytest.raises(ValueError, match="ids must be integer token ids, got"):
            TOK.decode(bad)
    assert TOK.decode([np.int64(104), np.int32(105)]) == "hi"
