"""Metric definitions (shared/specs/metrics.md) on a tiny trace whose answers are worked out by hand."""

import numpy as np
import pytest

from lab.report.metrics import describe, latency_samples, request_latencies, requests_frame, summarize
from tests.conftest import make_engine, req, submit


def tiny_run():
    # Constant 0.1 s steps, budget 16 tokens.
    # a: arrives 0.0, prompt 4, output 3  -> steps [0,.1] prefill, [.1,.2], [.2,.3]: tokens at .1, .2, .3
    # b: arrives 0.05, prompt 20, output 2 -> admitted at t=.1 with 15 tokens (a's decode takes 1 of 16),
    #    [.2,.3] its last 5 prompt tokens -> first token at .3; [.3,.4] -> second token at .4
    # c: arrives 0.25, prompt 4, output 1 -> admitted at t=.3, first (and last) token at .4
    env, inst, cost = make_engine(dt=0.1, max_num_batched_tokens=16)
    a, b, c = req(0, 4, 3, t=0.0), req(1, 20, 2, t=0.05), req(2, 4, 1, t=0.25)
    submit(env, inst, [a, b, c])
    env.run()
    return [a, b, c], inst


def test_per_request_metrics():
    rs, inst = tiny_run()
    df = requests_frame(rs).set_index("request_id")
    assert df.loc["0", "ttft"] == pytest.approx(0.1)
    assert df.loc["0", "e2el"] == pytest.approx(0.3)
    assert df.loc["0", "tpot"] == pytest.approx(0.1)
    assert df.loc["1", "first_scheduled_time"] == pytest.approx(0.1)
    assert df.loc["1", "queue_time"] == pytest.approx(0.05)
    assert df.loc["1", "ttft"] == pytest.approx(0.25)
    assert df.loc["1", "e2el"] == pytest.approx(0.35)
    assert df.loc["1", "tpot"] == pytest.approx(0.1)
    assert df.loc["2", "ttft"] == pytest.approx(0.15)
    assert np.isnan(df.loc["2", "tpot"])  # one output token: TPOT undefined
    assert (df["status"] == "finished").all()


def test_latency_samples_are_the_requests_table_values_of_finished_requests():
    rs, inst = tiny_run()
    df = requests_frame(rs)
    lat = latency_samples(rs)
    assert lat["ttft"].tolist() == df["ttft"].tolist() and lat["e2el"].tolist() == df["e2el"].tolist()
    assert lat["tpot"].tolist() == df["tpot"].dropna().tolist()  # c (one output token) has no TPOT
    assert request_latencies(rs[0]) == (df["ttft"][0], df["tpot"][0], df["e2el"][0])
    env, inst, cost = make_engine(dt=0.1)
    late = [req(0, 4, 50), req(1, 4, 2)]
    submit(env, inst, late)
    env.run(until=1.0)
    assert len(latency_samples(late)["e2el"]) == 1  # the unfinished request is left out
    ttft, tpot, e2el = request_latencies(late[0])
    assert ttft == pytest.approx(0.1) and np.isnan(tpot) and np.isnan(e2el)


def test_itl_pools_every_gap_between_outputs():
    rs, inst = tiny_run()
    # a: .1->.2->.3 (two gaps of .1); b: .3->.4 (one gap); c: none
    assert sorted(np.round(inst.itl.expand(), 9)) == [0.1, 0.1, 0.1]


def test_summary_counts_throughput_and_goodput():
    rs, inst = tiny_run()
    df = requests_frame(rs)
    s = summarize(df, inst.itl, slo={"ttft_s": 0.2, "tpot_s": 0.11, "e2el_s": None})
    assert (s["num_requests"], s["num_finished"], s["num_rejected"], s["num_unfinished"]) == (3, 3, 0, 0)
    assert s["duration_s"] == pytest.approx(0.4)  # last finish .4 - first arrival 0
    assert s["request_throughput"] == pytest.approx(3 / 0.4)
    assert s["output_token_throughput"] == pytest.approx(6 / 0.4)
    assert s["total_token_throughput"] == pytest.approx((28 + 6) / 0.4)
    assert s["ttft"]["mean"] == pytest.approx((0.1 + 0.25 + 0.15) / 3)
    assert s["ttft"]["median"] == pytest.approx(0.15)
    assert s["tpot"]["count"] == 2
    # SLO: a (ttft .1, tpot .1) ok; b ttft .25 > .2 fails; c ttft .15 ok, tpot counted as 0
    assert s["slo_attainment"] == pytest.approx(2 / 3)
    assert s["goodput"] == pytest.approx(2 / 0.4)


def test_describe_uses_linear_percentiles_and_ignores_nan():
    d = describe([1.0, 2.0, 3.0, 4.0, float("nan")], percentiles=(50, 90))
    assert d["count"] == 4 and d["mean"] == 2.5 and d["median"] == 2.5
    assert d["p90"] == pytest.approx(3.7)
    assert describe([])["mean"] is None


def test_unfinished_requests_are_counted_at_a_horizon():
    env, inst, cost = make_engine(dt=0.1)
    rs = [req(0, 4, 50), req(1, 4, 2)]
    submit(env, inst, rs)
    env.run(until=1.0)
    df = requests_frame(rs)
    s = summarize(df, np.array([]), horizon=1.0)
    assert s["num_unfinished"] == 1 and s["num_finished"] == 1
    assert s["duration_s"] == 1.0


def test_weighted_samples_are_exact_and_compact_on_long_runs(monkeypatch):
    import lab.core.samples as samples

    rng = np.random.default_rng(0)
    vals = rng.uniform(0.001, 0.05, 500)
    w = samples.WeightedSamples()
    expanded = []
    for v in vals:
        k = int(rng.integers(1, 5))
        w.add(float(v), k)
        expanded += [float(v)] * k
    d = w.describe((50, 90, 99))
    assert d["count"] == len(expanded)
    assert d["mean"] == pytest.approx(np.mean(expanded))
    for p in (50, 90, 99):
        assert d[f"p{p}"] == pytest.approx(np.percentile(expanded, p), rel=1e-12)
    monkeypatch.setattr(samples, "COMPACT_AT", 100)
    c = samples.WeightedSamples()
    for v in vals:
        c.add(float(round(v, 3)))  # few distinct values: compaction merges them
    assert c.compacted and len(c) <= 100 + 50  # bounded: distinct values + pairs added since
    assert c.describe((90,))["p90"] == pytest.approx(np.percentile(np.round(vals, 3), 90), abs=1e-7)


def test_itl_statistics_do_not_depend_on_the_order_or_grouping_samples_were_added_in():
    # a fast-forward adds (gap, batch size) pairs in bulk where step-by-step adds them one step at a time
    from lab.core.samples import WeightedSamples

    gaps = [0.0080182590544, 0.0079653, 0.0080666566, 0.0080723514]
    bulk, single = WeightedSamples(), WeightedSamples()
    bulk.extend_pairs(gaps, [37, 12, 5, 40])
    for g, n in zip(reversed(gaps), [40, 5, 12, 37]):
        for _ in range(n):
            single.add(g, 1)
    assert bulk.describe((50, 90, 99)) == single.describe((50, 90, 99))


def test_weighted_samples_keep_the_order_added_and_compact_again_only_after_doubling(monkeypatch):
    import lab.core.samples as samples

    w = samples.WeightedSamples()
    w.add(0.5, 2)
    w.extend_pairs(np.array([0.1, 0.2]), np.array([1, 3]))
    w.add(0.7)
    w.extend_pairs([0.9], [4])
    v, wt = w.arrays()
    assert v.tolist() == [0.5, 0.1, 0.2, 0.7, 0.9] and wt.tolist() == [2, 1, 3, 1, 4]
    assert len(w) == 5 and w.count == 11

    monkeypatch.setattr(samples, "COMPACT_AT", 10)
    c = samples.WeightedSamples()
    distinct = np.arange(40) * 1e-3  # 40 distinct values: a compaction keeps them all
    for x in distinct:
        c.extend_pairs(np.array([x]), np.array([1.0]))
    # compactions at 11 pairs (-> 11 kept, next at 22), then at 23 (next at 46): not after every pair
    assert c.compacted and len(c) == 40 and c.count == 40
    assert c._compact_at == 46
