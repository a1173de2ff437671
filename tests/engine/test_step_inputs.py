"""Token ids of one step laid out in the plan's batch order (jaxkv.step_inputs)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from jaxkv.step_inputs import gather_input_ids


def _metadata(query_lens_in_batch_order: np.ndarray, max_num_tokens: int):
    cu = np.zeros(len(query_lens_in_batch_order) + 3, np.int32)
    np.cumsum(query_lens_in_batch_order, out=cu[1 : len(query_lens_in_batch_order) + 1])
    cu[len(query_lens_in_batch_order) + 1 :] = cu[len(query_lens_in_batch_order)]
    return types.SimpleNamespace(max_num_tokens=max_num_tokens, cu_q_lens=cu)


@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_tokens_follow_the_batch_order(seed, decode_only):
    rng = np.random.default_rng(seed)
    num_requests = int(rng.integers(1, 20))
    lens = np.ones(num_requests, np.int32)
    if not decode_only:
        lens = rng.integers(1, 9, num_requests).astype(np.int32)
    per_request = [[1000 * (i + 1) + j for j in range(n)] for i, n in enumerate(lens)]
    token_ids = [t for tokens in per_request for t in tokens]
    order = (
        rng.permutation(num_requests).astype(np.int32)
        if seed % 3
        else np.arange(num_requests, dtype=np.int32)
    )
    total = int(lens.sum())
    md = _metadata(lens[order], total + 5)
    ids = gather_input_ids(token_ids, lens, order, md)
    expected = [t for i in order for t in per_request[i]]
    assert ids.dtype == np.int32 and ids.shape == (total + 5,)
    assert ids[:total].tolist() == expected
    assert not ids[total:].any()


def test_a_wrong_order_is_seen():
    # The same check rejects a layout that ignores the plan's order.
    lens = np.array([2, 1, 3], np.int32)
    token_ids = [10, 11, 20, 30, 31, 32]
    order = np.array([2, 0, 1], np.int32)
    ids = gather_input_ids(token_ids, lens, order, _metadata(lens[order], 8))
    assert ids[:6].tolist() == [30, 31, 32, 10, 11, 20]
    assert ids[:6].tolist() != token_ids
