"""The cascade cost model: whether reading a shared prefix once pays, per backend.

Plain Python arithmetic on bytes of KV, no JAX; CascadePlanner (jaxkv.cascade) asks it
about the global level and about each candidate group of the groups level: as a call
of its own, and by its own merge, the groups kept paying the level's one call together.
Tables of defaults are keyed by attention backend name.
"""

from __future__ import annotations

import dataclasses
import math

from jaxkv.field_checks import (
    as_float,
    as_int,
    bool_fields,
    checked_int,
    int_fields,
    positive_int_fields,
)


@dataclasses.dataclass(frozen=True)
class CascadeCostModel:
    """Decides per level whether reading a prefix once pays for the extra call and merge.

    Cascade saves reading (R - 1) copies of the prefix's KV; it costs one more kernel
    call (`launch_overhead_bytes`, the fixed cost of a call expressed as bytes of KV that
    could be read in the same time) and a merge that reads two float32 partial outputs
    and writes one per query token and head (times `merge_cost_factor`). Cascade is
    planned where saved bytes exceed that cost and are at least `min_saved_fraction`
    of what flat attention would read for those requests (their whole contexts, so
    long own suffixes make a shared prefix matter less; for a group under a global
    level, their contexts past it, which the suffix pass the group shortens reads).
    Defaults per backend come from benchmarks/attention.py (see DEFAULT_COST_MODELS);
    pass your own to override. The costs are finite numbers >= 0, `min_saved_fraction`
    is in [0, 1) and `min_requests` an int >= 2 (one request has no copy to save).
    """

    launch_overhead_bytes: float = 1 << 20
    merge_cost_factor: float = 1.0
    min_requests: int = 2
    min_saved_fraction: float = 0.0
    # The backend's work follows each pass's padded page width, not the keys it holds
    # (the xla reference path gathers and scores every padded page). Then cascade pays
    # only if its suffix pass pads to fewer pages than flat attention would; the planner
    # checks that when it knows the page buckets (CascadePlanner(page_buckets=...)).
    reads_padded_pages: bool = False

    def __post_init__(self) -> None:
        """Checks every field: a NaN cost would turn cascade off silently, a str would
        fail inside the planner at every step of an engine built with it. The costs are
        stored as Python floats (a 0-d array left the model unhashable; an int too large
        for a float failed in every pays())."""
        for name in ("launch_overhead_bytes", "merge_cost_factor", "min_saved_fraction"):
            raw = getattr(self, name)
            value = as_float(raw)  # NaN for a non-number and for an int past a float
            if not 0 <= value < math.inf:
                raise ValueError(f"{name}={raw!r} must be a finite number >= 0")
            object.__setattr__(self, name, value)
        # Cascade saves (R - 1) of R copies of the prefix, less than flat attention reads
        # (each request's context holds the whole prefix): a fraction of 1 or more never
        # pays, and would turn cascade off silently.
        if self.min_saved_fraction >= 1:
            raise ValueError(
                f"min_saved_fraction={self.min_saved_fraction!r} must be in [0, 1) (cascade "
                "always saves less than flat attention reads)"
            )
        # One request saves nothing: cascade needs two requests to read a prefix once.
        int_fields(self, "min_requests", minimum=2)
        bool_fields(self, "reads_padded_pages")

    def saved_bytes(self, num_requests: int, prefix_tokens: int, kv_bytes_per_token: int) -> int:
        return max(num_requests - 1, 0) * prefix_tokens * kv_bytes_per_token

    def cost_bytes(self, num_query_tokens: int, num_q_heads: int, head_dim: int) -> float:
        merge_bytes = num_query_tokens * num_q_heads * (head_dim + 1) * 4 * 3
        return self.launch_overhead_bytes + self.merge_cost_factor * merge_bytes

    def pays(
        self,
        *,
        num_requests: int,
        prefix_tokens: int,
        num_query_tokens: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_itemsize: int,
        context_tokens: int | None = None,
    ) -> bool:
        """Whether reading `prefix_tokens` once for `num_requests` requests pays.

        context_tokens: the requests' whole contexts summed (what flat attention reads;
        the planner passes a group under a global level its contexts past that level);
        None skips the min_saved_fraction test.

        Raises ValueError naming the argument unless the counts are ints >= 0 (numpy's
        too, not bools), the head shapes and kv_itemsize ints >= 1, and context_tokens
        None or at least num_requests * prefix_tokens (each context holds the prefix; a
        smaller one made the saving seem a larger share of flat attention's reads).
        """
        counts = {
            name: checked_int(name, value, minimum=minimum)
            for name, value, minimum in (
                ("num_requests", num_requests, 0),
                ("prefix_tokens", prefix_tokens, 0),
                ("num_query_tokens", num_query_tokens, 0),
                ("num_q_heads", num_q_heads, 1),
                ("num_kv_heads", num_kv_heads, 1),
                ("head_dim", head_dim, 1),
                ("kv_itemsize", kv_itemsize, 1),
            )
        }
        if context_tokens is not None:
            least = counts["num_requests"] * counts["prefix_tokens"]
            context_tokens = checked_int("context_tokens", context_tokens, minimum=0)
            if context_tokens < least:
                raise ValueError(
                    f"context_tokens={context_tokens!r} must be None or at least "
                    f"num_requests * prefix_tokens = {least} (each context holds the prefix)"
                )
        return self.pays_unchecked(**counts, context_tokens=context_tokens)

    def pays_unchecked(
        self,
        *,
        num_requests: int,
        prefix_tokens: int,
        num_query_tokens: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_itemsize: int,
        context_tokens: int | None = None,
    ) -> bool:
        """pays without its argument checks, for callers whose arguments are right by
        construction (the cascade planner, once per candidate group: its counts come from
        the scheduled batch, its head shapes from an AttentionShape)."""
        if num_requests < self.min_requests or prefix_tokens <= 0:
            return False
        kv_bytes_per_token = 2 * num_kv_heads * head_dim * kv_itemsize
        saved = self.saved_bytes(num_requests, prefix_tokens, kv_bytes_per_token)
        if context_tokens is not None and self._short_of_fraction(
            saved, context_tokens, kv_bytes_per_token
        ):
            return False
        return saved > self.cost_bytes(num_query_tokens, num_q_heads, head_dim)

    def max_context_tokens(
        self,
        *,
        num_requests: int,
        prefix_tokens: int,
        num_query_tokens: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_itemsize: int,
    ) -> int:
        """The largest context_tokens in [0, 2**63 - 1] for which pays_unchecked()
        holds with these arguments, or -1 where it holds for none, whatever the context.
        Where this is >= 0, it holds for every context_tokens at most this (negative ones
        too) and for none above it: its min_saved_fraction test only fails more often for
        more context tokens. Unchecked, as pays_unchecked (the planner's counts are right
        by construction). Cost: a few pays()' worth of arithmetic (63 more where its float
        estimate misses)."""
        shape = dict(
            num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            kv_itemsize=kv_itemsize,
        )  # fmt: skip
        if not self.pays_unchecked(
            num_requests=num_requests, prefix_tokens=prefix_tokens,
            num_query_tokens=num_query_tokens, **shape,
        ):  # fmt: skip
            return -1  # not even without the min_saved_fraction test
        kv_bytes_per_token = 2 * num_kv_heads * head_dim * kv_itemsize
        saved = self.saved_bytes(num_requests, prefix_tokens, kv_bytes_per_token)

        def fits(context: int) -> bool:
            return not self._short_of_fraction(saved, context, kv_bytes_per_token)

        most = 2**63 - 1
        if fits(most):  # min_saved_fraction 0, or too small to matter
            return most
        # Here min_saved_fraction > 0 and fits(0): saved >= 0 = the fraction of nothing.
        estimate = saved / (self.min_saved_fraction * kv_bytes_per_token)
        guess = int(estimate) if estimate < most - 1 else most - 1
        if fits(guess) and not fits(guess + 1):
            return guess
        low, high = 0, most  # fits(low), not fits(high)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low

    def _short_of_fraction(self, saved: int, context_tokens: int, kv_bytes_per_token: int) -> bool:
        """Whether `saved` bytes fall short of min_saved_fraction of the contexts' KV
        (pays()' test; never for fewer context tokens where it is not for more: the
        product only grows with them, float rounding included)."""
        return saved < self.min_saved_fraction * (context_tokens * kv_bytes_per_token)


# Key: backend name as in jaxkv.attention ("xla", "pallas_tpu", "pallas_gpu").
# xla: from benchmarks/attention.py on the CPU (README table): cascade won wherever it
# saved over ~1.5 MiB and at least a third of flat's bytes. Where it saves only a sixth
# (P=256, S=1024) runs disagree: 0.84x in one, 1.2x in the latest, so min_saved_fraction
# keeps flat there rather than risk a loss. pallas_gpu: from benchmarks/gpu_kernel.py
# on an H200 against flat over prefix-cached pages (tests/attention/
# test_cascade_cost_measured.py holds the timings): cascade lost where it saved ~30 MB
# (its extra call and merge cost ~15-20 us, ~64 MiB at 4 TB/s); where the prefix was
# half of each context it came within 10% of flat either way (L2 serves a small shared
# prefix to flat too), and it is planned there; it won by 1.06-3x wherever it saved
# more. The pallas_tpu row is an estimate (a call of a few microseconds at HBM
# bandwidth) until measured on a TPU.
DEFAULT_COST_MODELS: dict[str, CascadeCostModel] = {
    "xla": CascadeCostModel(
        launch_overhead_bytes=256 << 10,
        merge_cost_factor=2.0,
        min_saved_fraction=0.3,
        reads_padded_pages=True,
    ),
    "pallas_tpu": CascadeCostModel(
        launch_overhead_bytes=8 << 20, merge_cost_factor=1.0, min_saved_fraction=0.2
    ),
    "pallas_gpu": CascadeCostModel(
        launch_overhead_bytes=64 << 20, merge_cost_factor=1.0, min_saved_fraction=0.45
    ),
}


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Head shapes the cost model needs; independent of any batch.

    The cost model weighs the KV bytes one kernel call reads against that call's fixed
    cost, so under tensor parallelism give it one device's heads (`per_device`).
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_itemsize: int = 2

    def __post_init__(self) -> None:
        """Checks every field: ints >= 1, the query heads a multiple of the KV heads."""
        positive_int_fields(self, "num_q_heads", "num_kv_heads", "head_dim", "kv_itemsize")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads!r} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads!r}"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token holds across the KV heads."""
        return 2 * self.num_kv_heads * self.head_dim * self.kv_itemsize

    def per_device(self, tensor_parallel_size: int) -> AttentionShape:
        """The heads one device of a `tensor_parallel_size`-way mesh attends with, as
        jaxkv.sharding splits them: query heads evenly, KV heads evenly, or one KV head
        per device when there are fewer KV heads than devices (each then replicated).
        Raises ValueError unless the size is >= 1, divides the query heads, and divides the
        KV heads or is a multiple of them (as jaxkv.sharding.plan_tensor_parallel needs)."""
        tp = as_int(tensor_parallel_size)  # True is no size
        if tp is None or tp < 1 or self.num_q_heads % tp:
            raise ValueError(
                f"{tensor_parallel_size=} must be >= 1 and divide num_q_heads={self.num_q_heads!r}"
            )
        kv = self.num_kv_heads
        if kv % tp if tp <= kv else tp % kv:  # 6 KV heads over 4 devices: 1 each, silently
            raise ValueError(
                f"{tensor_parallel_size=} must divide num_kv_heads={kv!r} or be a multiple of it"
            )
        return dataclasses.replace(
            self, num_q_heads=self.num_q_heads // tp, num_kv_heads=max(self.num_kv_heads // tp, 1)
        )
