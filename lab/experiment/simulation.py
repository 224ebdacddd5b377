"""Run an experiment: build its pools (lab/experiment/build.py), route the arrivals (open loop, closed-loop clients or
sessions) through the front end to the instances, run the SimPy clock, and return every request and step
(:class:`SimResult`).

The names of lab/experiment/build.py and resolve.py that users and tests import from here (``build_deployment``,
``Deployment``, ``build_cost_model``, ``batch_defaults``, ...) are re-exported.
"""

from __future__ import annotations

import gc
import math
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import simpy

from lab.cluster.cluster import Cluster, HandOff, Pool
from lab.cluster.frontend import FrontEnd, FrontEndCost, shift_to_engine
from lab.cluster.lockstep import LockStepGroup
from lab.core.request import Request, RequestStatus
from lab.core.samples import WeightedSamples
from lab.core.sched_api import EngineStall
from lab.core.step_log import SpillFolder, rows_per_log
from lab.engine.instance import Instance
from lab.engine.jump import KnownArrivals
from lab.experiment import speculative as spec_setup
from lab.experiment.build import (Deployment, RunSettings, build_cost_model, build_deployment, build_instances,
                                  build_pool_deployment, kv_transfer)
from lab.experiment.resolve import (VERSION_DEFAULTS, batch_defaults, closed_loop_concurrency, frontend_cost,
                                    lock_step)
from lab.experiment.schema import Experiment, pool_experiments
from lab.experiment.support import check_composition
from lab.workload import loaders, synthetic
from lab.workload.closed_loop import ClosedLoopClients, SessionClients, warmup_copies
from policies import make_router

# names defined in build.py / resolve.py, importable from here as before the split
__all__ = ["SimResult", "simulate", "build_requests", "build_sessions", "route_open_loop", "next_arrival_times",
           "Deployment", "build_deployment", "build_cost_model", "batch_defaults", "closed_loop_concurrency",
           "frontend_cost", "lock_step", "VERSION_DEFAULTS"]


@dataclass
class SimResult:
    """What a run produced. ``requests`` keeps every request of the trace, in arrival order."""

    experiment: Experiment
    deployment: Deployment
    requests: list[Request]
    instances: list[Instance]
    itl_samples: WeightedSamples
    sim_end: float
    wall_time_s: float
    info: dict = field(default_factory=dict)
    pools: list = field(default_factory=list)  # (pool name, Deployment), configuration order
    groups: list = field(default_factory=list)  # lock-step groups of DP ranks
    cluster: Cluster | None = None
    spill_folder: SpillFolder | None = None  # the step logs' spill folder (simulation.step_log: spill) until cleanup()

    def cleanup(self) -> None:
        """Remove the step log's spill folder, once the outputs are written (the step log cannot be read after).
        ``with simulate(exp) as result:`` calls it at the end of the block. Raises nothing."""
        for inst in self.instances:
            inst.steps.close()
        if self.spill_folder is not None:
            self.spill_folder.remove()

    def __enter__(self) -> "SimResult":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()


class _RouterView:
    """What a router gets for each instance: reading any attribute first brings an instance that is inside a
    fast-forward jump up to date, so routers see exactly the state of step-by-step simulation, and routers that
    read nothing (round robin) do not cut jumps short."""

    __slots__ = ("_inst",)

    def __init__(self, inst: Instance) -> None:
        self._inst = inst

    def __getattr__(self, name: str):
        inst = self._inst
        inst.jump.materialize()
        return getattr(inst, name)


def build_requests(exp: Experiment) -> list[Request]:
    """Load or generate the experiment's workload, apply ``max_requests`` and ``time_scale``.

    Raises:
        lab.workload.loaders.WorkloadError: a bad trace file.
    """
    with _collecting_rarely():
        return _build_requests(exp)


def _build_requests(exp: Experiment) -> list[Request]:
    w = exp.workload
    if w.source == "sessions":
        sessions, _ = build_sessions(exp)
        return [r for convo in sessions for r in convo]
    if w.source == "synthetic":
        burst = w.rate == math.inf  # vllm bench serve --request-rate inf: every request sent at once
        reqs = synthetic.generate(
            w.num_requests, 1.0 if burst else w.rate,
            synthetic.LengthDist(**w.prompt_tokens.model_dump()),
            synthetic.LengthDist(**w.output_tokens.model_dump()),
            seed=exp.seed, cv=w.cv, num_priorities=w.num_priorities)
        if burst or (w.concurrency is not None and "rate" not in w.model_fields_set):
            for r in reqs:  # all ready at once (closed loop without a rate: the clients pace the sends)
                r.arrival_time = 0.0
    else:
        path = exp.path(w.path, "workload.path")  # type: ignore[arg-type]
        if w.source == "azure":
            reqs = loaders.load_azure(path)
        elif w.source == "mooncake":
            reqs = loaders.load_mooncake(path, jitter_s=w.jitter_s, seed=exp.seed)
        elif w.source == "llmservingsim":
            reqs = loaders.load_llmservingsim(path)
        elif w.source == "vllm_bench":
            reqs = loaders.load_vllm_bench(path, seed=exp.seed)
        else:
            reqs = loaders.load_csv(path)
        if not reqs:
            raise loaders.WorkloadError(f"{path}: no requests in the trace")
    if w.arrival_times is not None:
        reqs = loaders.override_arrivals(reqs, exp.path(w.arrival_times.path, "workload.arrival_times.path"),
                                         w.arrival_times.column)
    if w.source != "synthetic" or w.arrival_times is not None:
        loaders.check_requests(exp.path(w.path, "workload.path") if w.arrival_times is None else
                               exp.path(w.arrival_times.path, "workload.arrival_times.path"), reqs)
    if w.max_requests is not None:
        reqs = reqs[: w.max_requests]
    if w.time_scale != 1.0:
        for r in reqs:
            r.arrival_time *= w.time_scale
    return reqs


def build_sessions(exp: Experiment) -> tuple[list[list[Request]], list[float]]:
    """The multi-turn conversations of ``source: sessions`` (lab/workload/synthetic.py ``generate_sessions``):
    ``num_requests`` sessions starting at ``rate`` sessions/s."""
    w = exp.workload
    dist = lambda spec: synthetic.LengthDist(**spec.model_dump())  # noqa: E731
    return synthetic.generate_sessions(w.num_requests, w.rate, dist(w.turns), dist(w.prompt_tokens),
                                       dist(w.turn_tokens), dist(w.output_tokens), seed=exp.seed, cv=w.cv)


def _group_sessions(reqs: list[Request]) -> tuple[list[list[Request]], list[float]]:
    """Requests grouped by ``session_id`` (trace order within a session), and each session's first arrival."""
    groups: dict[str, list[Request]] = {}
    for r in reqs:
        groups.setdefault(r.session_id or f"#{r.index}", []).append(r)
    sessions = list(groups.values())
    return sessions, [convo[0].arrival_time for convo in sessions]



def simulate(exp: Experiment, requests: list[Request] | None = None,
             progress: Callable[[int, int], None] | None = None, record_breakdown: bool = False) -> SimResult:
    """Run the experiment and return every request and step.

    Fast-forward jumps (lab/engine/jump/) are sized by each instance's ``arrival_hint``. It is the exact
    time of the instance's next arrival for an open-loop workload with one entry instance, or behind a router that
    declares ``routes_by_arrival_order`` (round robin) when the front end delays no request: the stream is then
    routed before the run (:func:`route_open_loop`), for the instances of entry pools without a hand-off. Otherwise
    (closed-loop clients and sessions, routers that read load, pools with a hand-off or fed by one) it is an
    estimate. Results do not depend on it.

    Args:
        exp: the validated experiment.
        requests: use these instead of building the workload (tests).
        progress: called as ``progress(done, total)`` when requests finish or are rejected.
        record_breakdown: keep each step's cost breakdown (``servelab validate``).

    Raises:
        ConfigError: features that do not compose (lab/experiment/support.py), before anything is built.
        ValueError: a model that does not fit, a bad profile folder, an unknown catalog name.
        lab.core.sched_api.SchedulerContractError: a scheduler broke the contract during the run.
        lab.core.sched_api.EngineStall: the run ran out of events with requests neither finished nor rejected.
    """
    t0 = time.perf_counter()
    check_composition(exp, own_requests=requests is not None)
    pd = exp.deployment.mode == "disaggregated"
    pools = [(cfg, sub, build_pool_deployment(cfg, i, sub, pd)) for i, (cfg, sub) in enumerate(pool_experiments(exp))]
    reqs = requests if requests is not None else build_requests(exp)
    horizon = exp.simulation.horizon_s
    if horizon is not None and reqs and horizon < min(r.arrival_time for r in reqs):
        raise ValueError(f"simulation.horizon_s ({horizon}) is before the first arrival "
                         f"({min(r.arrival_time for r in reqs):.6g} s): nothing would run")
    spec_setup.assign_request_rates(exp, reqs)
    env = simpy.Environment()
    itl = WeightedSamples()
    total = len(reqs)
    done = [0]

    clients: list[ClosedLoopClients] = []

    def on_done(r: Request) -> None:
        done[0] += 1
        if clients:
            clients[0].completed(r)
        if progress is not None:
            progress(done[0], total)

    big = len(reqs) > 200_000
    sim = exp.simulation
    summary_steps = exp.output.step_log == "summary"
    run = RunSettings(
        record_events=sim.record_events if sim.record_events is not None else not big,
        spill_folder=SpillFolder() if sim.step_log != "memory" and not summary_steps else None,
        record_breakdown=record_breakdown, horizon=sim.horizon_s, summary_steps=summary_steps,
        rows_per_log=rows_per_log(sum(sub.cluster.num_instances for _, sub, _ in pools)))
    # the spill folder goes with SimResult.cleanup(), when the run fails, else at the latest when the process exits
    spill = weakref.finalize(env, run.spill_folder.remove) if run.spill_folder is not None else None
    instances: list[Instance] = []
    built: list[Pool] = []
    groups: list[LockStepGroup] = []
    for cfg, sub, dep in pools:
        name = cfg.name if cfg is not None else ""
        members = build_instances(env, sub, dep, run, itl, on_done, len(instances), name)
        if lock_step(sub):
            dp = sub.hardware.data_parallel_size
            groups += [LockStepGroup(env, members[i:i + dp]) for i in range(0, len(members), dp)]
        instances += members
        router = make_router(sub.cluster.router, sub.base_dir, sub.cluster.router_options, sub.seed)
        rule = cfg.hand_off if cfg is not None else None
        hand_off = None
        if rule is not None:
            transfer, bandwidth = kv_transfer(exp, sub, dep, pools, rule.to)
            hand_off = HandOff(rule.to, rule.after_output_tokens, rule.delay_s, transfer, bandwidth)
        built.append(Pool(name, members, router, hand_off))
        if hand_off is not None:
            for inst in members:  # a hand-off enters another pool at its own instant: a jump ends right after it
                inst.jump.ends_at_hand_offs()
    cluster = Cluster(env, built, _RouterView)
    for inst in instances:
        inst.jump.expects_arrivals(inst.jump.expected_next_arrival)

    # one pool of one instance: arrivals go straight to it (no router, no hand-off)
    arrive = instances[0].add_request if len(built) == 1 and len(instances) == 1 else cluster.arrive
    frontend = frontend_cost(exp)
    concurrency = closed_loop_concurrency(exp)
    w = exp.workload
    open_loop = w.source != "sessions" and concurrency is None
    if not frontend.is_zero and not open_loop:  # the API server: requests reach the engines after it
        arrive = FrontEnd(env, frontend, arrive).submit

    if w.source == "sessions":
        sessions, starts = _group_sessions(reqs)
        clients.append(SessionClients(env, sessions, starts, arrive, w.think_time_s))
    elif concurrency is not None:
        if w.num_warmup and reqs:  # extra copies of the first request, as vllm bench serve --num-warmups sends
            reqs = warmup_copies(reqs[0], w.num_warmup, len(reqs)) + reqs
        clients.append(ClosedLoopClients(env, reqs, concurrency, arrive, w.think_time_s, w.num_warmup, itl.clear))
    if clients:
        for inst in instances:
            inst.jump.ends_at_completions()
            if len(instances) > 1:
                # a completion on one instance sends a request to another at that instant: hypothesis found a jump
                # on the receiving side that is not exact (swap + async), so these runs go step by step
                inst.jump.disable()
        env.process(clients[0].run())
    else:
        # an open-loop stream passes the front end before the run: the engines see it at its queue entries
        stream = shift_to_engine(list(reqs), frontend) if not frontend.is_zero else reqs
        routed = route_open_loop(cluster, stream, FrontEndCost())
        env.process(_open_loop_arrivals(env, stream, arrive, routed, cluster, True))
    try:
        _run_env(env, run.horizon)
    except BaseException:
        if spill is not None:
            spill()
        raise
    if clients and isinstance(clients[0], SessionClients):
        clients[0].mark_unsent()
    _mark_unfinished(reqs, run.horizon, float(env.now))
    return SimResult(exp, pools[0][2], reqs, instances, itl, float(env.now), time.perf_counter() - t0,
                     pools=[(cfg.name if cfg is not None else "", dep) for cfg, _, dep in pools], groups=groups,
                     cluster=cluster, spill_folder=run.spill_folder)


def route_open_loop(cluster: Cluster, reqs: list[Request], frontend: FrontEndCost) -> list[int] | None:
    """Route an open-loop arrival stream before the run where that gives the same choices as routing at each
    arrival (lab/cluster/cluster.py ``Cluster.route_ahead``): one entry instance, or an entry router that declares
    ``routes_by_arrival_order`` (round robin) — the latter only when the front end delays no request
    (``frontend.request_s`` and ``per_prompt_token_s`` zero), since per-request delays may reorder the stream.

    Returns:
        per request (list order), the index in ``cluster.entry_instances`` of its instance, or None (the requests
        are routed at their arrivals).

    Raises:
        lab.cluster.cluster.RouterError: the router returned no valid index, or read instance state.
    """
    delays = frontend.request_s or frontend.per_prompt_token_s
    if delays and len(cluster.entry_instances) > 1:
        return None
    return cluster.route_ahead(reqs)


def next_arrival_times(reqs: list[Request], routed: list[int], num_instances: int) -> tuple[list[float], list[float]]:
    """Exact next-arrival times per instance of a routed stream.

    Args:
        reqs: the requests in arrival order; ``arrival_time`` in seconds.
        routed: per request, its instance index (0 .. num_instances - 1).
        num_instances: the number of instances routed to.

    Returns:
        (first, following): per instance, the arrival time of its first request (inf if none); per request, the
        arrival time of the next request routed to the same instance (inf if none). Seconds.
    """
    inf = float("inf")
    first = [inf] * num_instances
    following = [inf] * len(reqs)
    for j in range(len(reqs) - 1, -1, -1):
        k = routed[j]
        following[j] = first[k]
        first[k] = reqs[j].arrival_time
    return first, following


def _open_loop_arrivals(env: simpy.Environment, reqs: list[Request], arrive: Callable[[Request], None],
                        routed: list[int] | None, cluster: Cluster, direct: bool = False):
    """The open-loop arrival process (a generator of SimPy events for ``env.process``): each request is handed to
    ``arrive`` at its ``arrival_time``, in list order.

    With ``routed`` (:func:`route_open_loop`) the ``arrival_hint`` of every entry instance of a pool without a
    hand-off becomes, now, the exact time of its own next arrival, so its fast-forward jumps end where that request
    arrives and arrivals routed elsewhere never cut them; the other hints stay the instances' estimates
    (``JumpContext.expected_next_arrival``). Either way results are the same: the hint only sizes jumps. (A pool
    with a hand-off keeps the estimate: a request that leaves in the middle of a jump is handed on when the jump
    is applied, so longer jumps there would change when it arrives in the next pool.)

    With ``direct`` (no front end between the stream and the engines, so each request reaches its instance at
    exactly its ``arrival_time``) those instances also get the requests they will receive
    (``Instance.jump.known_arrivals``): a jump may then plan their admissions (lab/engine/jump/)."""
    if routed is None:
        return _deliver_at_arrival_times(env, reqs, arrive, None, None, None)
    entry = cluster.entry_instances
    nxt, following = next_arrival_times(reqs, routed, len(entry))
    per_instance: list[list[Request]] = [[] for _ in entry]
    if direct:
        for r, k in zip(reqs, routed):
            per_instance[k].append(r)
    for k, inst in enumerate(entry):
        if cluster.pools[inst.pool].hand_off is None:
            inst.jump.expects_arrivals(lambda k=k: nxt[k], KnownArrivals(per_instance[k]) if direct else None)
    return _deliver_at_arrival_times(env, reqs, arrive, routed, nxt, following)


def _deliver_at_arrival_times(env: simpy.Environment, reqs: list[Request], arrive: Callable[[Request], None],
                              routed: list[int] | None, nxt: list[float] | None, following: list[float] | None):
    """Hand each request to ``arrive`` at its ``arrival_time``; with ``routed``, first move its instance's next
    arrival time (``nxt``) on to the one after it (``following``). Yields SimPy events."""
    for j, r in enumerate(reqs):
        dt = r.arrival_time - env.now
        if dt > 0:
            yield env.timeout(dt)
        if routed is not None:
            nxt[routed[j]] = following[j]  # type: ignore[index]
        arrive(r)


def _run_env(env: simpy.Environment, horizon: float | None) -> None:
    # The run allocates many small objects and holds a large, stable set (requests, KV blocks): move what exists
    # now out of the cyclic collector's way and collect rarely, or collection time grows with the run (100,000
    # requests on 16 instances: 2 collections instead of 13 with a threshold of 50,000, ~10 % faster in paired runs,
    # the same peak memory). A run's own objects form cycles (its SimPy processes): a process that runs many should
    # collect between runs, as sweeps do (lab/report/sweep.py _collect_cycles).
    gc.freeze()
    try:
        with _collecting_rarely():
            env.run(until=horizon) if horizon else env.run()
    finally:
        gc.unfreeze()


# Young objects allocated (net) between cyclic collections during a run (Python's default is 700).
_GC_THRESHOLD = 1_000_000


@contextmanager
def _collecting_rarely():
    """Run the block with the cyclic collector run every ``_GC_THRESHOLD`` net new objects (and its older
    generations every 100 of those), then restore the thresholds. Building requests allocates millions of objects
    that all live on: at Python's default every collection re-traverses the ones built so far (1,000,000 synthetic
    requests: 6.0 s to build, 1.7 s so). On exit every object still young (the block's survivors among them) goes
    to the oldest generation unscanned (``gc.freeze`` then ``gc.unfreeze``, which also releases any earlier freeze):
    restoring the default thresholds would otherwise make the next allocation scan all of them at once as young
    objects (Azure conversation trace, 19,366 requests: 60 ms at the end of the
    run, a gen-0 collection), though they are the run's long-lived state. A cycle among them is freed by the next
    full collection (sweeps make one after each run: lab/report/sweep.py)."""
    thresholds = gc.get_threshold()
    gc.set_threshold(_GC_THRESHOLD, 100, 100)
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def _mark_unfinished(reqs: list[Request], horizon: float | None, end: float) -> None:
    """Give every request that neither finished nor was rejected its reason: it runs, waits or arrives after the
    horizon.

    Raises:
        EngineStall: the run ran out of events (no horizon, or before it, at ``end`` seconds) with such requests
            left: they would wait for ever, which is an engine or policy defect, not a result.
    """
    stuck = [r for r in reqs if r.status not in (RequestStatus.FINISHED, RequestStatus.REJECTED) and not r.reason]
    if stuck and (horizon is None or end < horizon):
        where = "; ".join(f"request {r.request_id} {r.status.name.lower()} on instance {r.instance_id}"
                          for r in stuck[:3])
        raise EngineStall(f"the run ran out of events at t = {end:.6f} s with {len(stuck)} request(s) neither "
                          f"finished nor rejected ({where}{'; ...' if len(stuck) > 3 else ''}): a mechanism waits "
                          "for an event that never comes")
    for r in stuck:
        if r.status == RequestStatus.RUNNING:
            r.reason = "still running at the horizon"
        elif horizon and r.arrival_time >= horizon:
            r.reason = "arrives after the horizon"
        else:
            r.reason = "still waiting at the horizon"
