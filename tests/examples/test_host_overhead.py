"""benchmarks/host_overhead.py: the setups it times are what its table says they are
(its asserts run here on a small grid, with the timing loop stubbed out)."""

from __future__ import annotations

import json

import numpy as np

from benchmarks import host_overhead as bench


def test_a_point_times_the_four_cases_on_requests_sharing_the_whole_prefix(monkeypatch):
    calls = []

    def fake_time_calls(fn, args_cycle):
        calls.append([fn(a) for a in args_cycle])  # what each timed call answers
        return 1.0, 2.0

    monkeypatch.setattr(bench, "best_us_per_call", fake_time_calls)
    setup = bench._Setup(4, 3, 1, np.random.default_rng(0))
    sched = [setup.add(4) for _ in range(3)]
    others = [setup.add(4)]
    rows = bench._time_point(setup, sched, len(others))
    assert [r["case"] for r in rows] == ["cold", "memo", "diverge", "rows"]
    assert all((r["R"], r["C"], r["T"]) == (3, 4, 1) for r in rows)
    # cold, memo and rows see 4 shared blocks; diverge's last request shares 2 of them.
    assert calls == [[4, 4], [4], [2, 2], [4, 4]]
    setup.m.check_integrity()
    assert setup.m.num_common_prefix_blocks(sched) == 4  # the half holder was freed
    assert sorted(setup.requests) == sorted(sched + others)  # alive while holding blocks
    setup.free(others[0])
    assert others[0] not in setup.requests and others[0] not in setup.m.request_ids


def test_a_holder_hits_exactly_the_prefix_blocks_it_asks_for():
    setup = bench._Setup(4, 2, 0, np.random.default_rng(0))
    first, second, half = setup.add(4), setup.add(4), setup.add(2)
    m = setup.m
    assert m.num_common_prefix_blocks([first, second]) == 4
    assert m.num_common_prefix_blocks([first, half]) == 2
    # Two blocks of its own each, the last partial (never cached): 4 + 3 * 2 blocks held.
    assert bench.OWN_TOKENS == 2 * bench.BLOCK_SIZE - 3
    assert m.pool.num_blocks - 1 - m.num_free_blocks == 4 + 3 * 2


def test_the_trace_admits_decodes_and_frees_every_request():
    trace = bench.bench_trace(np.random.default_rng(0), num_requests=40)
    assert trace["num_requests"] == 40
    assert trace["lookup"]["count"] == trace["alloc_prefill"]["count"] == 40
    assert trace["free"]["count"] == 40
    assert trace["alloc_decode"]["count"] >= 40 * 8  # 8 to 64 decode steps each
    assert 0 < trace["prefix_cache_hit_rate"] < 1


def test_the_trace_hit_rate_counts_each_admitted_lookup_once(monkeypatch):
    # A lookup whose allocation then failed (the pool full) was counted, and counted
    # again when the request was looked up anew: the rate was not that of the requests
    # served. Here each request's first prefill allocation fails, as on a full pool.
    made, refused = [], set()

    class FullOnce(bench.KVCacheManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def allocate_slots(self, request, num_new_tokens, **kwargs):
            if "new_computed_blocks" in kwargs and request.request_id not in refused:
                refused.add(request.request_id)
                return None
            return super().allocate_slots(request, num_new_tokens, **kwargs)

    monkeypatch.setattr(bench, "KVCacheManager", FullOnce)
    trace = bench.bench_trace(np.random.default_rng(0), num_requests=30)
    (m,) = made
    assert len(refused) == 30 and trace["lookup"]["count"] == 30
    assert m.prefix_cache_stats.requests == 30
    assert trace["prefix_cache_hit_rate"] == m.prefix_cache_stats.hit_rate > 0


def test_the_trace_reports_each_operations_own_interval_in_microseconds(monkeypatch):
    """On a clock that ticks 1000 ns a read, every timed interval spans one tick: an
    operation's mean, p50 and p99 are 1.0 us, the lookup's 2.0 (get_computed_blocks, and
    count_prefix_lookup once the allocation succeeded), not the lookup plus the
    allocation, nor a raw reading. Making a Request moves the clock 1 ms: no interval
    includes it."""
    clock = [0]

    def read_clock():
        clock[0] += 1000
        return clock[0]

    class SlowRequest(bench.Request):
        def __init__(self, *args, **kwargs):
            clock[0] += 10**6
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(bench.time, "thread_time_ns", read_clock)
    monkeypatch.setattr(bench, "Request", SlowRequest)
    trace = bench.bench_trace(np.random.default_rng(0), num_requests=20)
    for op, ticks in (
        ("lookup", 2.0),
        ("alloc_prefill", 1.0),
        ("alloc_decode", 1.0),
        ("free", 1.0),
    ):
        assert trace[op]["mean_us"] == trace[op]["p50_us"] == trace[op]["p99_us"] == ticks, op


def test_the_latency_summary_reads_the_median_and_the_99th_percentile():
    ns = [1000 * k for k in range(1, 101)]  # 1..100 us
    assert bench.latency_summary(ns) == {
        "count": 100,
        "mean_us": 50.5,
        "p50_us": 50.5,
        "p99_us": 99.01,
    }


def test_main_keeps_each_points_best_round_and_prints_1024_over_16(monkeypatch, tmp_path, capsys):
    """Two rounds whose times differ per point: the JSON keeps the lower of each, and the
    table prints R=16, 256, 1024 in order and their ratio 1024 / 16."""
    grid = [(c, t, case) for c in (128, 2048) for t in (0, 64) for case in bench.CASES]

    def fake_round(scale):
        return [
            dict(R=r, C=c, T=t, case=case, cpu_us=scale * r, wall_us=0.0)
            for c, t, case in grid
            for r in (16, 256, 1024)
        ]

    rounds = iter([fake_round(2.0), fake_round(1.0), fake_round(3.0)])
    monkeypatch.setattr(bench, "bench_prefix", lambda rng: next(rounds))
    summary = bench.latency_summary([1000])
    trace = {op: summary for op in ("lookup", "alloc_prefill", "alloc_decode", "free")}
    trace |= {"prefix_cache_hit_rate": 0.5, "num_requests": 1}
    monkeypatch.setattr(bench, "bench_trace", lambda rng, n: trace)
    out = tmp_path / "host.json"
    monkeypatch.setattr("sys.argv", ["host_overhead.py", "--out", str(out), "--rounds", "3"])
    bench.main()
    report = json.loads(out.read_text())
    rows = report["num_common_prefix_blocks"]
    assert len(rows) == len(grid) * 3
    assert all(r["cpu_us"] == r["R"] for r in rows)  # round 2's, the lowest
    # The table's ratio is in the JSON too (it held the times alone).
    assert report["num_common_prefix_blocks_1024_over_16"] == [
        dict(C=c, T=t, case=case, cpu_1024_over_16=64.0) for c, t, case in grid
    ]
    printed = capsys.readouterr().out.splitlines()
    header = next(line for line in printed if line.lstrip().startswith("C "))
    assert header.split("|")[1].split() == ["R=16", "R=256", "R=1024"]
    table = [line for line in printed if "1024/16=" in line]
    assert len(table) == len(grid)
    assert all(
        line.split("|")[1].split() == ["16.0", "256.0", "1024.0", "1024/16=64.00"] for line in table
    )


def test_the_prefix_grid_times_each_point_on_its_requests_and_other_holders(monkeypatch):
    # Smaller R are the first of the larger R's requests (the rest freed); each point's
    # T other holders of the prefix are alive while it is timed and freed after.
    points = []
    time_point = bench._time_point

    def recording(setup, sched, num_others):
        alive = [rid for rid in setup.requests if rid not in sched]
        holders = {setup.m.block_ids(rid)[0] for rid in [*sched, *alive]}
        points.append((setup.num_prefix, list(sched), len(alive), len(holders)))
        return time_point(setup, sched, num_others)

    monkeypatch.setattr(bench, "_time_point", recording)
    monkeypatch.setattr(bench, "best_us_per_call", lambda fn, args_cycle: (1.0, 2.0))
    rows = bench.bench_prefix(np.random.default_rng(0), (2, 4), (5, 3, 2), (0, 2))
    grid = [(c, r, t) for c in (2, 4) for r in (5, 3, 2) for t in (0, 2)]
    assert [(c, len(sched), t) for c, sched, t, _ in points] == grid
    assert all(shared == 1 for *_, shared in points)  # every one holds the same first block
    for first, later in zip(points, points[1:], strict=False):
        if first[0] == later[0]:
            assert later[1] == first[1][: len(later[1])]
    assert [(r["C"], r["R"], r["T"]) for r in rows] == [p for p in grid for _ in bench.CASES]
    assert [r["case"] for r in rows] == list(bench.CASES) * len(grid)
