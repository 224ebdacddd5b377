"""Routers over a cluster of instances: which instance each request goes to, and the per-instance report."""

import pytest

from lab.experiment.config import parse_experiment
from lab.report.run_summary import collect
from lab.core.request import Request
from lab.experiment.simulation import simulate
from policies import make_router
from policies.routers import SessionAffinityRouter


def cluster(router: str, n: int = 2, **router_options):
    return parse_experiment({"name": "c", "engine": {"num_gpu_blocks": 4000, "max_num_batched_tokens": 2048},
                             "cluster": {"num_instances": n, "router": router, "router_options": router_options},
                             "simulation": {"progress": False}})


class FakeInstance:
    """Just enough of an InstanceView for routing decisions."""

    def __init__(self, running=0, waiting=0, tokens=0):
        self.running = [None] * running
        self.waiting = [None] * waiting
        self.num_outstanding_tokens = tokens

    @property
    def num_outstanding_requests(self) -> int:
        return len(self.running) + len(self.waiting)


def test_prefix_aware_routing_sends_a_repeated_prefix_to_the_instance_that_cached_it():
    prefix = list(range(1000, 1512))
    reqs = [Request(0, 0.0, 600, 50),                                                 # -> 0 (tie)
            Request(1, 0.01, 600, 5, prompt_token_ids=prefix + list(range(88))),      # -> 1 (0 is busier)
            Request(2, 30.0, 600, 5, prompt_token_ids=prefix + list(range(5000, 5088)))]  # all idle again
    res = simulate(cluster("prefix_aware"), requests=reqs)
    assert [r.instance_id for r in reqs] == [0, 1, 1]
    assert reqs[2].prefix_hit_tokens == 512  # it hit the prefix request 1 cached on instance 1
    reqs = [Request(r.index, r.arrival_time, r.prompt_len, r.max_tokens, prompt_token_ids=r.prompt_token_ids)
            for r in reqs]
    simulate(cluster("round_robin"), requests=reqs)
    assert [r.instance_id for r in reqs] == [0, 1, 0] and reqs[2].prefix_hit_tokens == 0
    assert res.instances[1].kv.prefix_hits == 512


def test_prefix_aware_balances_the_prefix_against_load():
    router = make_router("prefix_aware", options={"prefix_weight": 1.0, "queue_weight": 2.0})

    class KV:
        def __init__(self, hit):
            self.hit = hit

        def get_computed_blocks(self, r):
            return [], self.hit

    a, b = FakeInstance(running=9), FakeInstance(running=1)
    a.kv, b.kv = KV(400), KV(0)
    r = Request(0, 0.0, 500, 5)
    # a holds 80 % of the prompt but is the most loaded: 1 x 0.8 + 2 x 0 < 1 x 0 + 2 x 1
    assert router.route(r, [a, b], 0.0) == 1
    router = make_router("prefix_aware")  # llm-d defaults 3 / 2: 3 x 0.8 = 2.4 > 2
    assert router.route(r, [a, b], 0.0) == 0


def test_load_routers_pick_the_least_loaded_instance():
    insts = [FakeInstance(running=3, tokens=100), FakeInstance(running=1, waiting=1, tokens=900),
             FakeInstance(running=2, tokens=50)]
    r = Request(0, 0.0, 10, 10)
    assert make_router("least_requests").route(r, insts, 0.0) == 1
    assert make_router("least_tokens").route(r, insts, 0.0) == 2
    rr = make_router("round_robin")
    assert [rr.route(r, insts, 0.0) for _ in range(4)] == [0, 1, 2, 0]


def test_power_of_two_is_seeded_and_picks_the_less_loaded_of_its_two_draws():
    insts = [FakeInstance(running=i) for i in (5, 0, 3, 7)]
    r = Request(0, 0.0, 10, 10)
    p1 = make_router("power_of_two", seed=7)
    p2 = make_router("power_of_two", seed=7)
    picks = [p1.route(r, insts, 0.0) for _ in range(50)]
    assert picks == [p2.route(r, insts, 0.0) for _ in range(50)]
    assert picks != [make_router("power_of_two", seed=8).route(r, insts, 0.0) for _ in range(50)]
    assert 3 not in picks  # the most loaded instance never wins a draw
    assert picks.count(1) > picks.count(0)


def test_session_affinity_keeps_a_session_on_one_instance():
    router = SessionAffinityRouter()
    insts = [FakeInstance(), FakeInstance()]
    s1 = [Request(i, 0.0, 1200, 5, hash_ids=[0, 77, 78 + i]) for i in range(3)]
    s2 = Request(9, 0.0, 1200, 5, hash_ids=[0, 55, 56])
    first = router.route(s1[0], insts, 0.0)
    insts[first].running.append(None)  # now busier: a new session goes elsewhere, the old one stays
    assert router.route(s2, insts, 0.0) != first
    assert [router.route(r, insts, 0.0) for r in s1[1:]] == [first, first]
    assert router.route(Request(5, 0.0, 10, 5, session_id="u1"), insts, 0.0) == \
        router.route(Request(6, 0.0, 10, 5, session_id="u1"), insts, 0.0)


def test_power_of_two_cluster_runs_are_deterministic():
    def once():
        reqs = [Request(i, i * 0.05, 300 + 37 * (i % 7), 20 + i % 5) for i in range(60)]
        simulate(cluster("power_of_two", n=3), requests=reqs)
        return [r.instance_id for r in reqs], [r.finish_time for r in reqs]

    assert once() == once()


def test_per_instance_metrics_are_in_the_summary():
    reqs = [Request(i, i * 0.1, 200, 10) for i in range(12)]
    res = simulate(cluster("round_robin", n=3), requests=reqs)
    req, summary = collect(res)
    inst = summary["instances"]
    assert [x["instance"] for x in inst] == [0, 1, 2] and [x["num_requests"] for x in inst] == [4, 4, 4]
    assert sum(x["num_finished"] for x in inst) == summary["num_finished"] == 12
    assert all(x["ttft_mean"] > 0 and 0 < x["busy_fraction"] <= 1 for x in inst)
    assert summary["deployment"]["router"] == "round_robin" and summary["deployment"]["num_instances"] == 3


def test_unknown_router_and_bad_router_options_fail_clearly():
    from lab.experiment.config import ConfigError

    with pytest.raises(ConfigError, match="cluster.router: unknown router 'fastest'"):
        parse_experiment({"name": "x", "cluster": {"router": "fastest"}})
    with pytest.raises(ConfigError, match="cluster.router_options: unknown option.*'weight'"):
        parse_experiment({"name": "x", "cluster": {"router": "prefix_aware", "router_options": {"weight": 1}}})
    with pytest.raises(ConfigError, match="cluster.router_options.queue_weight"):
        parse_experiment({"name": "x", "cluster": {"router": "prefix_aware", "router_options": {"queue_weight": -1}}})


def test_session_affinity_with_a_csv_session_column(tmp_path):
    from lab.workload.loaders import load_csv

    p = tmp_path / "t.csv"
    rows = ["arrival_time_s,prompt_tokens,output_tokens,session_id"]
    rows += [f"{i * 0.001},{200 + i},{10},{'user' + str(i % 3)}" for i in range(12)]
    p.write_text("\n".join(rows) + "\n")
    reqs = load_csv(p)
    assert reqs[4].session_id == "user1"
    simulate(cluster("session_affinity", n=3), requests=reqs)
    by_session = {}
    for r in reqs:
        by_session.setdefault(r.session_id, set()).add(r.instance_id)
    assert all(len(v) == 1 for v in by_session.values()) and len({next(iter(v)) for v in by_session.values()}) == 3


def test_least_requests_counts_requests_waiting_for_their_kv_read_on_a_decode_instance():
    # four requests prefilled in one step reach D at one instant: each waits for its KV read there (vLLM keeps it in
    # `waiting`), so least_requests spreads them two and two
    exp = parse_experiment({"name": "pd_router", "workload": {
        "num_requests": 4, "rate": float("inf"), "prompt_tokens": {"kind": "constant", "value": 256, "max": 256},
        "output_tokens": {"kind": "constant", "value": 50, "max": 50}},
        "deployment": {"mode": "disaggregated", "prefill": {"count": 1},
                       "decode": {"count": 2, "router": "least_requests"}}, "simulation": {"progress": False}})
    res = simulate(exp)
    assert sorted(r.served_by[-1] for r in res.requests) == [1, 1, 2, 2]
