"""EngineMetrics: what a serving loop can read about its engine, as one frozen snapshot."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxkv.kv_transfer import TransferStats
    from jaxkv.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One step that ran the model (Engine.last_step)."""

    host_s: float  # schedule + plan + metadata + input arrays
    host_cpu_s: float  # the same, CPU time of the engine's thread (robust to contention)
    device_s: float  # jitted forward and sampler, until the tokens are on the host
    update_s: float  # appending tokens, stops, freeing or handing blocks over
    num_requests: int  # requests scheduled
    num_tokens: int  # tokens computed
    cascade_levels: str  # "" (flat), "global", "groups" or "global+groups"
    new_program: bool  # the step needed a program this engine had not used before
    # host_cpu_s split: scheduler, cascade planner, metadata + input arrays + program key
    schedule_cpu_s: float = 0.0
    plan_cpu_s: float = 0.0
    prepare_cpu_s: float = 0.0
    # KV blocks held while the step ran: once scheduled (its blocks allocated), before
    # the requests that finish in it free theirs.
    num_blocks_held: int = 0

    @property
    def step_s(self) -> float:
        """Wall seconds of the whole step: host_s + device_s + update_s."""
        return self.host_s + self.device_s + self.update_s


class StepTotals:
    """Running sums over the steps that ran the model: EngineMetrics' step fields."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.host_time_s = self.device_time_s = self.update_time_s = 0.0
        self.cascade_steps = self.cascade_tokens = 0
        self._by_levels: dict[str, int] = {}  # level names joined by '+' -> steps

    def record(self, step: StepStats) -> None:
        self.num_steps += 1
        self.host_time_s += step.host_s
        self.device_time_s += step.device_s
        self.update_time_s += step.update_s
        if step.cascade_levels:
            self.cascade_steps += 1
            self.cascade_tokens += step.num_tokens
            levels = step.cascade_levels
            self._by_levels[levels] = self._by_levels.get(levels, 0) + 1

    def fields(self) -> dict:
        """The EngineMetrics fields these totals fill, by name."""
        return dict(
            num_steps=self.num_steps,
            host_time_s=self.host_time_s,
            device_time_s=self.device_time_s,
            update_time_s=self.update_time_s,
            cascade_steps=self.cascade_steps,
            cascade_tokens=self.cascade_tokens,
            cascade_steps_by_levels=tuple(sorted(self._by_levels.items())),
        )


@dataclasses.dataclass(frozen=True)
class EngineMetrics:
    """Counters since the engine was built (times in seconds, KV in bytes of all layers).

    Step time splits into host (schedule + cascade plan + metadata + input arrays),
    device (dispatch of the jitted forward and sampler until the tokens are on the
    host) and update (appending tokens, stopping, freeing or handing blocks over).
    """

    num_steps: int = 0  # steps that ran the model
    # Prefill tokens computed (prefix-cache hits excluded), once per run: a preempted
    # request's recomputed context included, and a chunk run again because a tokenizer
    # interrupt stopped its step's update before it.
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    host_time_s: float = 0.0
    device_time_s: float = 0.0
    update_time_s: float = 0.0
    cascade_steps: int = 0  # steps whose plan had at least one cascade level
    cascade_tokens: int = 0  # query tokens of those steps
    # (levels, steps), sorted: levels "global", "groups" or "global+groups" (two levels)
    cascade_steps_by_levels: tuple[tuple[str, int], ...] = ()
    num_compiles: int = 0  # distinct step programs this engine needed
    # Tokens looked up in the device prefix cache, once per admission, and tokens found
    # there: since engine.manager.reset_prefix_cache_stats() if that was called.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks held now
    bytes_offloaded: int = 0  # KV copied device -> host (landed)
    bytes_reloaded: int = 0  # KV copied host -> device (landed)
    num_running: int = 0
    num_waiting: int = 0
    num_transferring: int = 0  # finished requests still holding blocks for a copy

    @property
    def step_time_s(self) -> float:
        return self.host_time_s + self.device_time_s + self.update_time_s

    @property
    def generation_tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.step_time_s if self.step_time_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        """num_prompt_tokens plus num_generated_tokens per second of step time: a
        throughput figure, not the tokens the model ran (each request's last generated
        token never runs through it)."""
        total = self.num_prompt_tokens + self.num_generated_tokens
        return total / self.step_time_s if self.step_time_s else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    @property
    def host_time_per_step_ms(self) -> float:
        """Mean wall ms per step before the program: StepStats.host_s (schedule, plan,
        metadata, input arrays). The work after it is update_time_s; the program's
        dispatch counts as device time."""
        return 1e3 * self.host_time_s / self.num_steps if self.num_steps else 0.0

    @property
    def device_time_per_step_ms(self) -> float:
        """Mean wall ms per step from the program's dispatch until the sampled tokens are
        on the host (StepStats.device_s)."""
        return 1e3 * self.device_time_s / self.num_steps if self.num_steps else 0.0

    def as_dict(self) -> dict:
        """Every field and derived rate, for logging or JSON."""
        d = dataclasses.asdict(self)
        d["cascade_steps_by_levels"] = dict(self.cascade_steps_by_levels)
        for name in (
            "step_time_s",
            "generation_tokens_per_s",
            "tokens_per_s",
            "prefix_cache_hit_rate",
            "host_time_per_step_ms",
            "device_time_per_step_ms",
        ):
            d[name] = getattr(self, name)
        return d


def engine_metrics(
    totals: StepTotals,
    scheduler: Scheduler,
    num_compiles: int,
    transfers: TransferStats,
    transfers_at_bind: TransferStats,
) -> EngineMetrics:
    """An engine's EngineMetrics: its step totals, its scheduler's counts and its KV
    manager's, and the KV copies of `transfers` (its connector's stats) made since
    `transfers_at_bind`."""
    s = scheduler.stats
    pc = scheduler.manager.prefix_cache_stats
    return EngineMetrics(
        **totals.fields(),
        num_prompt_tokens=s.num_prompt_tokens_computed,
        num_generated_tokens=s.num_generated_tokens,
        num_preemptions=s.num_preemptions,
        num_compiles=num_compiles,
        prefix_cache_queries=pc.queries,
        prefix_cache_hits=pc.hits,
        kv_usage=scheduler.manager.usage,
        bytes_offloaded=transfers.bytes_offloaded - transfers_at_bind.bytes_offloaded,
        bytes_reloaded=transfers.bytes_reloaded - transfers_at_bind.bytes_reloaded,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_transferring=len(scheduler.transferring),
    )
