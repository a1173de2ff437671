"""Test harness shared by every kernel test: random paged cases, a dense oracle, checks.

The oracle shares no paging logic with any kernel: it walks each sequence's page table
in plain Python to rebuild contiguous K/V, then runs softmax attention in float64 numpy.
Cases are poisoned: padding query rows, unused pages, slots past kv_len in a sequence's
last page and the null page 0 (the fill of padded page-table entries) hold NaN (int8
caches, which have no NaN, hold -128 there), and page tables are shuffled, so a kernel
that reads anything it should not read shows NaN or a wrong value in a valid row.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def interpret_unless_on(platform: str) -> bool:
    """The kernels' `interpret` flag in tests: False where JAX's default backend is
    `platform` ("gpu" or "tpu"), so the same tests run the compiled kernel on that
    device; True elsewhere (the Pallas interpreter, e.g. on the CPU)."""
    return jax.default_backend() != platform


INTERPRET_GPU = interpret_unless_on("gpu")
INTERPRET_TPU = interpret_unless_on("tpu")


@dataclasses.dataclass(frozen=True)
class Case:
    """One ragged paged-attention input with the layouts of kernels_pallas.reference."""

    q: jnp.ndarray  # [max_num_tokens, num_q_heads, head_dim]
    kv_pages: jnp.ndarray  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jnp.ndarray  # i32[max_num_seqs]
    page_indices: jnp.ndarray  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jnp.ndarray  # i32[max_num_seqs + 1]
    num_seqs: jnp.ndarray  # i32[1]
    seq_lens: tuple[tuple[int, int], ...]  # (q_len, kv_len) per valid sequence

    @property
    def num_valid_tokens(self) -> int:
        return sum(q for q, _ in self.seq_lens)

    @property
    def page_size(self) -> int:
        return self.kv_pages.shape[1]

    def args(self) -> tuple[jnp.ndarray, ...]:
        """Positional arguments of every kernel with the reference's contract."""
        return (
            self.q,
            self.kv_pages,
            self.kv_lens,
            self.page_indices,
            self.cu_q_lens,
            self.num_seqs,
        )

    def replace(self, **changes) -> Case:
        return dataclasses.replace(self, **changes)


def _poison_value(dtype) -> float:
    return -128.0 if jnp.dtype(dtype) == jnp.dtype(jnp.int8) else float("nan")


def make_case(
    seed: int,
    seq_lens: list[tuple[int, int]],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype=jnp.float32,
    kv_dtype=None,
    max_num_seqs: int | None = None,
    max_num_tokens: int | None = None,
    pages_per_seq: int | None = None,
    num_pages: int | None = None,
    poison: bool = True,
) -> Case:
    """Builds a random case; each (q_len, kv_len) needs 1 <= q_len <= kv_len (q_len 0 allowed)."""
    rng = np.random.default_rng(seed)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    for q_len, kv_len in seq_lens:
        assert 0 <= q_len <= kv_len, (q_len, kv_len)
    needed = [math.ceil(kv / page_size) for _, kv in seq_lens]
    total_q = sum(q for q, _ in seq_lens)
    max_num_seqs = max_num_seqs or len(seq_lens) + 1
    max_num_tokens = max_num_tokens or total_q + 3
    pages_per_seq = pages_per_seq or max(needed, default=0) + 1
    num_pages = num_pages or sum(needed) + 5
    assert len(seq_lens) <= max_num_seqs and total_q <= max_num_tokens
    assert max(needed, default=0) <= pages_per_seq and sum(needed) < num_pages

    q = rng.standard_normal((max_num_tokens, num_q_heads, head_dim)).astype(np.float32)
    kv_shape = (num_pages, page_size, 2 * num_kv_heads, head_dim)
    if jnp.dtype(kv_dtype) == jnp.dtype(jnp.int8):
        kv = rng.integers(-127, 128, kv_shape).astype(np.float32)
    else:
        kv = rng.standard_normal(kv_shape).astype(np.float32)

    # Shuffled page table: valid pages drawn at random from 1..num_pages-1, never the
    # null page 0, which is the fill of every padded entry.
    pool = rng.permutation(np.arange(1, num_pages))
    page_indices = np.zeros((max_num_seqs, pages_per_seq), np.int32)
    used = np.zeros(num_pages, bool)
    used_slots = np.zeros((num_pages, page_size), bool)
    start = 0
    for i, ((_, kv_len), n) in enumerate(zip(seq_lens, needed, strict=True)):
        pages = pool[start : start + n]
        start += n
        page_indices[i, :n] = pages
        used[pages] = True
        for j in range(kv_len):
            used_slots[pages[j // page_size], j % page_size] = True

    kv_lens = np.zeros(max_num_seqs, np.int32)
    kv_lens[: len(seq_lens)] = [kv for _, kv in seq_lens]
    cu_q_lens = np.zeros(max_num_seqs + 1, np.int32)
    cu_q_lens[1 : len(seq_lens) + 1] = np.cumsum([ql for ql, _ in seq_lens])
    cu_q_lens[len(seq_lens) + 1 :] = total_q
    if poison:
        q[total_q:] = np.nan
        kv[~used_slots] = _poison_value(kv_dtype)
        # Padded sequence rows carry garbage lengths: only num_seqs rows may be read.
        kv_lens[len(seq_lens) :] = pages_per_seq * page_size
        # And garbage offsets, not even sorted: only cu_q_lens[: num_seqs + 1] may be read.
        cu_q_lens[len(seq_lens) + 1 :] = np.resize(
            [max_num_tokens, 0], max_num_seqs - len(seq_lens)
        )
    return Case(
        q=jnp.asarray(q, dtype),
        kv_pages=jnp.asarray(kv).astype(kv_dtype),
        kv_lens=jnp.asarray(kv_lens),
        page_indices=jnp.asarray(page_indices),
        cu_q_lens=jnp.asarray(cu_q_lens),
        num_seqs=jnp.asarray([len(seq_lens)], jnp.int32),
        seq_lens=tuple((int(a), int(b)) for a, b in seq_lens),
    )


def dense_kv(case: Case, seq: int, k_scale=None, v_scale=None) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous (K, V) float64 [kv_len, num_kv_heads, head_dim] of one valid sequence."""
    kv_pages = np.asarray(case.kv_pages.astype(jnp.float32), np.float64)
    page_size = case.page_size
    table = np.asarray(case.page_indices)[seq]
    _, kv_len = case.seq_lens[seq]
    rows = [kv_pages[table[j // page_size], j % page_size] for j in range(kv_len)]
    dense = np.stack(rows) if rows else np.zeros((0,) + kv_pages.shape[2:])
    k, v = dense[:, 0::2], dense[:, 1::2]
    return k * (k_scale or 1.0), v * (v_scale or 1.0)


def dense_oracle(
    case: Case,
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(out f64[num_valid_tokens, Hq, D], lse f64[num_valid_tokens, Hq]) by plain softmax."""
    q_all = np.asarray(case.q.astype(jnp.float32), np.float64)
    num_q_heads = q_all.shape[1]
    outs, lses = [], []
    token = 0
    for seq, (q_len, kv_len) in enumerate(case.seq_lens):
        k, v = dense_kv(case, seq, k_scale, v_scale)
        group = num_q_heads // k.shape[1]
        k = np.repeat(k, group, axis=1)
        v = np.repeat(v, group, axis=1)
        q = q_all[token : token + q_len]
        token += q_len
        logits = np.einsum("qhd,khd->hqk", q, k) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        q_pos = kv_len - q_len + np.arange(q_len)[:, None]
        k_pos = np.arange(kv_len)[None, :]
        visible = np.ones((q_len, kv_len), bool)
        if causal:
            visible &= k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        logits = np.where(visible[None], logits, -np.inf)
        m = (
            logits.max(axis=-1, keepdims=True)
            if kv_len
            else np.full((num_q_heads, q_len, 1), -np.inf)
        )
        m_safe = np.where(np.isfinite(m), m, 0.0)
        p = np.where(visible[None], np.exp(logits - m_safe), 0.0)
        denom = p.sum(axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.einsum("hqk,khd->qhd", p, v) / np.where(denom > 0, denom, 1.0).T[..., None]
            lse = np.where(denom > 0, m_safe[..., 0] + np.log(denom), -np.inf).T
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


# Per-element bounds |got - want| <= atol + rtol * |want| for outputs, by output dtype.
# bfloat16 keeps 8 significant bits, so rounding the output alone costs up to 2**-8
# relative; float32 inputs and outputs stay within 1e-5 of the float64 oracle.
_TOLERANCES = {
    jnp.dtype(jnp.float32): (1e-5, 1e-5),
    jnp.dtype(jnp.bfloat16): (1e-2, 1e-2),
    jnp.dtype(jnp.float16): (2e-3, 2e-3),
}
# lse is float32 in every kernel: bounded by the accumulation, not the output dtype.
_LSE_TOLERANCES = {
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.bfloat16): 2e-3,
    jnp.dtype(jnp.float16): 2e-3,
}


def tolerance(dtype) -> tuple[float, float]:
    """(atol, rtol) per element of out for a kernel whose output dtype is `dtype`."""
    return _TOLERANCES[jnp.dtype(dtype)]


def assert_close_to_oracle(
    case: Case,
    out,
    lse,
    expected: tuple[np.ndarray, np.ndarray],
    *,
    dtype=None,
    atol: float | None = None,
    rtol: float | None = None,
    lse_atol: float | None = None,
) -> None:
    """Compares every valid row of (out, lse) with the oracle; names the worst row on failure.

    Rows are compared one by one: a single wrong element of a single row fails, so a
    metric normalised by the whole tensor cannot hide a wrong row. Non-finite values in
    valid rows fail unless the oracle has the same (-inf lse of a row with no keys).
    """
    dtype = jnp.dtype(case.q.dtype if dtype is None else dtype)
    d_atol, d_rtol = tolerance(dtype)
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    lse_atol = _LSE_TOLERANCES[dtype] if lse_atol is None else lse_atol
    want_out, want_lse = expected
    n = case.num_valid_tokens
    got_out = np.asarray(jnp.asarray(out)[:n].astype(jnp.float32), np.float64)
    got_lse = np.asarray(jnp.asarray(lse)[:n], np.float64)
    assert got_out.shape == want_out.shape, (got_out.shape, want_out.shape)

    out_err = np.abs(got_out - want_out) - (atol + rtol * np.abs(want_out))
    out_err = np.where(np.isnan(out_err), np.inf, out_err).max(axis=(1, 2))  # a row: [Hq, D]
    both_inf = np.isneginf(want_lse) & np.isneginf(got_lse)
    with np.errstate(invalid="ignore"):  # -inf - -inf where both are -inf: masked below
        lse_err = np.abs(got_lse - want_lse) - lse_atol * (1.0 + np.abs(np.nan_to_num(want_lse)))
    lse_err = np.where(both_inf, -1.0, np.where(np.isnan(lse_err), np.inf, lse_err)).max(axis=-1)
    bad = np.flatnonzero((out_err > 0) | (lse_err > 0))
    if bad.size:
        worst = int(bad[np.argmax(np.maximum(out_err, lse_err)[bad])])
        raise AssertionError(
            f"{bad.size} of {n} rows differ from the oracle (atol={atol}, rtol={rtol}, "
            f"lse_atol={lse_atol}); worst row {worst}: out excess {out_err[worst]:.3g}, "
            f"lse got {got_lse[worst]} want {want_lse[worst]}"
        )


def assert_padding_is_empty(case: Case, out, lse) -> None:
    """Rows past cu_q_lens[num_seqs] give out 0 and lse -inf (the reference's guarantee)."""
    n = case.num_valid_tokens
    assert np.all(np.asarray(jnp.asarray(out)[n:].astype(jnp.float32)) == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[n:]))


def drop_one_key(case: Case) -> Case:
    """The same case with the last key of the first sequence missing from its kv_len."""
    kv_lens = np.asarray(case.kv_lens).copy()
    kv_lens[0] -= 1
    return case.replace(kv_lens=jnp.asarray(kv_lens))


def swap_kv(case: Case) -> Case:
    """The same case with K and V exchanged in every combined head pair."""
    kv = case.kv_pages
    swapped = jnp.stack([kv[:, :, 1::2], kv[:, :, 0::2]], axis=3).reshape(kv.shape)
    return case.replace(kv_pages=swapped)


def scale_queries(case: Case, factor: float) -> Case:
    """The same case with every query multiplied by `factor`: factor 100 on unit-variance
    data gives logits of a few hundred, past 88.7, where exp overflows float32, so only a
    softmax (and an LSE merge) that subtracts its running maximum stays finite."""
    return case.replace(q=(case.q.astype(jnp.float32) * factor).astype(case.q.dtype))


def nan_in_key(case: Case, seq: int, key: int) -> Case:
    """The same case with element 0 of the K of kv head 0, key `key` of sequence `seq`
    (a key some queries see), set to NaN: a data fault that must show, not vanish."""
    page = int(np.asarray(case.page_indices)[seq, key // case.page_size])
    kv = np.asarray(case.kv_pages.astype(jnp.float32)).copy()
    kv[page, key % case.page_size, 0, 0] = np.nan
    return case.replace(kv_pages=jnp.asarray(kv).astype(case.kv_pages.dtype))


def assert_nan_where_the_key_is_seen(out, lse, rows: slice, heads: slice) -> None:
    """A NaN key gives NaN out and lse in every row and head that sees it: a NaN lse read
    as -inf ("no keys") would make a cascade merge drop that part silently."""
    got_out = np.asarray(jnp.asarray(out)[rows, heads].astype(jnp.float32))
    got_lse = np.asarray(lse)[rows, heads]
    assert np.isnan(got_out).all(), "a row that sees a NaN key has a non-NaN output"
    assert np.isnan(got_lse).all(), f"lse of rows that see a NaN key: {got_lse}"


def unread_pages_out_of_range(case: Case) -> Case:
    """The same case with every page-table entry no valid sequence reads (past a valid
    sequence's ceil(kv_len / page_size) pages, and every entry of a padded sequence) set
    to a page past the cache: a kernel that copies or loads one reads out of bounds, which
    the TPU interpreter refuses, where the null page it would otherwise read is masked."""
    table = np.asarray(case.page_indices).copy()
    bogus = case.kv_pages.shape[0] + 7
    for seq in range(table.shape[0]):
        kv_len = case.seq_lens[seq][1] if seq < len(case.seq_lens) else 0
        table[seq, math.ceil(kv_len / case.page_size) :] = bogus
    return case.replace(page_indices=jnp.asarray(table))


def keys_seen(cu_q_lens, kv_lens, seq: int, tokens, *, causal: bool, window: int | None) -> set:
    """The key positions of sequence `seq` that some query token in `tokens` sees, one
    (token, key) pair at a time: every key below kv_len, or with causal masking those up
    to the token's position (token t at t + kv_len - q_end) and, with a sliding window,
    the `window` keys ending there."""
    q_end, kv_len = int(cu_q_lens[seq + 1]), int(kv_lens[seq])
    seen = set()
    for t in tokens:
        pos = t + kv_len - q_end
        for key in range(kv_len):
            if not causal or (key <= pos and (window is None or key > pos - window)):
                seen.add(key)
    return seen
