"""PromptLogprobList: the read-only sequence a request's prompt logprobs come in, its
dicts made on first read."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.logprobs import Logprob
from jaxkv.prompt_logprobs import PromptLogprobList, _Pending


def _list() -> PromptLogprobList:
    pending = _Pending((7, 8, 9), k=2)
    pending.logprob[:] = [-1.5, -0.25]
    pending.rank[:] = [3, 1]
    pending.top_ids[:] = [[4, 5], [9, 2]]
    pending.top_logprob[:] = [[-0.5, -1.0], [-0.25, -2.0]]
    pending.top_rank[:] = [[1, 2], [1, 2]]
    return PromptLogprobList(pending)


EXPECTED = [
    None,
    {8: Logprob(-1.5, 3), 4: Logprob(-0.5, 1), 5: Logprob(-1.0, 2)},
    {9: Logprob(-0.25, 1), 2: Logprob(-2.0, 2)},  # the prompt token is the top one
]


def test_entries_read_as_vllms_with_the_prompt_token_first():
    entries = _list()
    assert len(entries) == 3 and list(entries) == EXPECTED
    assert [list(e) for e in entries[1:]] == [[8, 4, 5], [9, 2]]
    assert entries[-1] == EXPECTED[2] and entries[0:2] == EXPECTED[:2]
    assert entries == EXPECTED and entries == tuple(EXPECTED) and entries != EXPECTED[:2]
    # Neither a number nor text is a sequence of its entries: unequal, and no TypeError.
    assert entries != 3 and entries != "abc" and entries.__eq__(None) is NotImplemented
    assert all(type(t) is int and type(lp.logprob) is float for t, lp in entries[1].items())
    with pytest.raises(IndexError, match="index 3 out of range for 3 tokens"):
        entries[3]


def test_negative_indices_read_as_a_lists_down_to_minus_its_length():
    """entries[-len] is entry 0 (None), as a list's; one further is out of range."""
    entries = _list()
    assert [entries[i] for i in (-3, -2, -1)] == EXPECTED
    with pytest.raises(IndexError, match="index -4 out of range for 3 tokens"):
        entries[-4]


def test_dicts_are_made_once_on_first_read():
    entries = _list()
    assert entries._entries == [None, None, None]
    first = entries[2]
    assert entries._entries[1] is None and entries[2] is first


def test_token_logprobs_are_a_copy_of_the_prompt_tokens_own():
    entries = _list()
    scores = entries.token_logprobs()
    assert scores.dtype == np.float32 and scores.tolist() == [-1.5, -0.25]
    scores[0] = 0.0
    assert entries[1][8].logprob == -1.5


def test_it_is_unhashable_as_the_lists_it_equals():
    with pytest.raises(TypeError):
        hash(_list())
    assert repr(_list()) == "PromptLogprobList(3 tokens)"
