"""A deployment at run time: named pools of instances behind a router, and hand-offs between pools.

A pool is a set of instances alike in hardware, parallelism, engine limits, scheduler and cost model; pools may
differ from each other in all of those. Arrivals go to the entry pools (those no other pool hands on to), where
the router picks an instance. A pool with a hand-off rule serves each request until it has produced
``after_output_tokens`` tokens, then the request leaves with its computed state (``num_computed_tokens``, its tokens
and timings) and, after ``delay_s``, joins an instance of the target pool picked by that pool's router. What the KV
transfer costs and how the target admits it (prefill/decode disaggregation) are built on this mechanism.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import simpy

from lab.cluster.transfer import Link, TransferCost
from lab.core.remote_kv import RemoteKV
from lab.core.request import Request
from lab.core.sched_api import Router
from lab.engine.instance import Instance


class RouterError(RuntimeError):
    """A router returned something that is not the index of one of the instances it was shown."""


def _router_file(router: Router) -> str:
    """`` (router defined in <file>)`` for a router class from a user's file (any module but the built-in
    ``policies.`` ones, as the scheduler contract errors name theirs), else ``""``."""
    import sys  # noqa: PLC0415  (only on the error path)

    module = type(router).__module__
    where = getattr(sys.modules.get(module), "__file__", None)
    return f" (router defined in {where})" if where and not module.startswith("policies.") else ""


def _checked(router: Router, index: object, num_instances: int) -> int:
    """``index`` as an instance index, or :class:`RouterError` naming the router (and its file, for a user's
    router) and what it returned."""
    try:
        i = operator.index(index)  # ints and numpy integers; not None, floats or strings
    except TypeError:
        i = None
    if i is None or isinstance(index, bool) or not 0 <= i < num_instances:
        raise RouterError(f"router {type(router).__name__} returned {index!r}; expected an instance index "
                          f"0..{num_instances - 1}{_router_file(router)}")
    return i


class _FixedView:
    """What a router that routes by arrival order (``RouterBase.routes_by_arrival_order``) sees of an instance when
    the arrival stream is routed ahead of the run: its fixed ``instance_id`` and ``pool``; reading its state raises
    :class:`RouterError` (that state is not known before the run)."""

    __slots__ = ("instance_id", "pool", "_router")

    def __init__(self, inst: Instance, router: Router) -> None:
        self.instance_id = inst.instance_id
        self.pool = inst.pool
        self._router = router

    def __getattr__(self, name: str):
        raise RouterError(f"router {type(self._router).__name__} declares routes_by_arrival_order but read the "
                          f"instance's {name!r}; a router that reads instance state must leave it False")


@dataclass(frozen=True)
class HandOff:
    """Where a pool's requests go next.

    Attributes:
        to: name of the target pool.
        after_output_tokens: output tokens a request produces in this pool before it leaves (>= 1).
        delay_s: seconds between leaving and arriving (the handover: P's output processing and the proxy hop).
        transfer: prefill/decode disaggregation (vLLM NIXL pull): the source keeps the request's blocks pinned,
            the target reads the KV over its ingress link once it has blocks for it, and samples its own first
            token (the source's is discarded). None: the request arrives with its computed state after
            ``delay_s``.
        link_bandwidth: bytes per second of each target instance's ingress link (with ``transfer``).
    """

    to: str
    after_output_tokens: int = 1
    delay_s: float = 0.0
    transfer: TransferCost | None = None
    link_bandwidth: float = 0.0


@dataclass
class Pool:
    """Instances of one kind, their router and where their requests go next."""

    name: str
    instances: list[Instance]
    router: Router
    hand_off: HandOff | None = None
    views: list = field(default_factory=list)


class Cluster:
    """Pools of instances; routes arrivals and moves requests between pools.

    Args:
        env: the SimPy environment.
        pools: the pools, in configuration order.
        view: wraps an instance for its router (the fast-forward brings an instance up to date when read).

    Raises:
        ValueError: a hand-off to an unknown pool, or no pool that takes arrivals.
    """

    def __init__(self, env: simpy.Environment, pools: list[Pool], view: Callable[[Instance], object]) -> None:
        self.env = env
        self.pools = {p.name: p for p in pools}
        for p in pools:
            p.views = [view(i) for i in p.instances]
            if p.hand_off is not None:
                if p.hand_off.to not in self.pools:
                    raise ValueError(f"pool {p.name!r} hands off to unknown pool {p.hand_off.to!r}; pools: "
                                     f"{', '.join(self.pools)}")
                for inst in p.instances:
                    inst.set_hand_off(self._leave)
        targets = {p.hand_off.to for p in pools if p.hand_off is not None}
        self.entry = [p for p in pools if p.name not in targets]
        if not self.entry:
            cycle = ", ".join(f"{p.name} -> {p.hand_off.to}" for p in pools if p.hand_off is not None)
            raise ValueError(f"every pool is a hand-off target, so no pool takes arrivals (hand-offs: {cycle})")
        self.entry_instances = [i for p in self.entry for i in p.instances]
        self.entry_views = [v for p in self.entry for v in p.views]
        self._routed: list[int] | None = None  # route_ahead's choices, taken in order by arrive()
        self._routed_requests: list[Request] = []
        self._num_arrived = 0
        self.num_hand_offs = 0
        self.by_id = {i.instance_id: i for p in pools for i in p.instances}
        self.links: dict[int, Link] = {}
        self.bytes_transferred = 0.0
        self.drafter_bytes_transferred = 0.0
        self.num_lease_expiries = 0
        for p in pools:
            rule = p.hand_off
            if rule is not None and rule.transfer is not None:
                for inst in self.pools[rule.to].instances:
                    self.links[inst.instance_id] = Link(env, rule.link_bandwidth, f"KV link to instance {inst.instance_id}")
                    inst.load_remote_kv = self._loader(inst, rule.transfer)

    @property
    def instances(self) -> list[Instance]:
        """Every instance, pool by pool."""
        return [i for p in self.pools.values() for i in p.instances]

    def route_ahead(self, requests: list[Request]) -> list[int] | None:
        """Route a whole arrival stream before the run, when the entry router's choice depends only on the arrival
        order (``RouterBase.routes_by_arrival_order``) or there is one entry instance (no choice).

        The router's ``route`` is called once per request, in list order, with ``now`` = the request's
        ``arrival_time`` and :class:`_FixedView` instances; :meth:`arrive` then delivers each request where it was
        routed. The caller guarantees that ``arrive`` gets exactly these requests, in this order (an open-loop
        stream without front-end delay); a request past a horizon may never arrive.

        Args:
            requests: the arrival stream, in the order ``arrive`` will get it.

        Returns:
            per request, the index in ``entry_instances`` of its instance; None when the router reads state (the
            requests are then routed at their arrivals, as without this call).

        Raises:
            RouterError: the router returned no valid index, or read instance state.
        """
        n = len(self.entry_instances)
        if n == 1:
            return [0] * len(requests)
        router = self.entry[0].router
        if not router.routes_by_arrival_order:
            return None
        views = [_FixedView(i, router) for i in self.entry_instances]
        routed = [_checked(router, router.route(r, views, r.arrival_time), n) for r in requests]
        self._routed, self._routed_requests, self._num_arrived = routed, requests, 0
        return routed

    def arrive(self, request: Request) -> None:
        """Route an arriving request to an instance of an entry pool (where :meth:`route_ahead` sent it, if it
        was called).

        Raises:
            RouterError: the router returned no valid index.
            RuntimeError: ``route_ahead`` was called and requests arrive in another order than it was given.
        """
        entry = self.entry
        if len(entry) == 1 and len(entry[0].instances) == 1:
            inst = entry[0].instances[0]
        elif self._routed is not None:
            k = self._num_arrived
            if k >= len(self._routed) or self._routed_requests[k] is not request:
                raise RuntimeError(f"request {request.request_id} arrives out of the order it was routed in "
                                   f"(Cluster.route_ahead)")
            self._num_arrived = k + 1
            inst = self.entry_instances[self._routed[k]]
        else:
            idx = _checked(entry[0].router, entry[0].router.route(request, self.entry_views, self.env.now),
                           len(self.entry_instances))
            inst = self.entry_instances[idx]
        self._enter(request, inst)
        inst.add_request(request)

    def _enter(self, request: Request, inst: Instance) -> None:
        """The request joins ``inst``'s pool: with a hand-off rule it leaves after producing
        ``after_output_tokens`` more tokens here (or at ``max_tokens``)."""
        rule = self.pools[inst.pool].hand_off  # every instance belongs to one of the pools
        if rule is not None:
            request.stop_at = min(request.max_tokens, request.num_output_tokens + rule.after_output_tokens)

    def _leave(self, request: Request) -> None:
        """A request reached its pool's hand-off point: its source instance pins its blocks for the target to read
        (with a KV transfer) or frees them, here, before the request reaches any other instance."""
        rule = self.pools[request.pool].hand_off
        assert rule is not None  # only instances of pools with a rule have this callback
        self.num_hand_offs += 1
        if rule.transfer is not None:
            self._pin(request, rule.transfer)  # its blocks leave the request, pinned on the source
        source = self.by_id[request.instance_id]
        source.kv.free(request, finished=True)
        at = source.now + rule.delay_s  # the exact instant it reaches the next pool
        if rule.delay_s > 0:
            self.env.process(self._deliver_later(request, rule, at))
        else:
            self._deliver(request, rule.to, at)

    def _deliver_later(self, request: Request, rule: HandOff, at: float):
        yield self.env.timeout(rule.delay_s)
        self._deliver(request, rule.to, at)

    def _deliver(self, request: Request, pool_name: str, at: float) -> None:
        pool = self.pools[pool_name]
        idx = 0 if len(pool.instances) == 1 else _checked(
            pool.router, pool.router.route(request, pool.views, self.env.now), len(pool.instances))
        inst = pool.instances[idx]
        request.stop_at = request.max_tokens
        self._enter(request, inst)
        inst.receive(request, at)

    # ---- prefill/decode disaggregation (vLLM NIXL pull; shared/specs/vllm-v1-scheduling.md §5) ----
    def _pin(self, request: Request, cost: TransferCost) -> None:
        """P finished the request: keep its blocks pinned for the reader (``delay_free``), start the lease, and
        discard P's token (D recomputes the last prompt token and samples its own first token), or keep it
        (``first_token`` ``with_kv``: D emits it when the KV has arrived; ``from_prefill``: it was the request's
        first output, at P's step end)."""
        src = self.by_id[request.instance_id]
        pinned = src.kv.detach(request)
        src.num_pinned_blocks += len(pinned.blocks)
        src.peak_pinned_blocks = max(src.peak_pinned_blocks, src.num_pinned_blocks)
        now = self.env.now
        remote = RemoteKV(src, pinned, request.prompt_len, cost.per_token_bytes(request.prompt_len),
                          cost.drafter_bytes_per_token)
        remote.times.update(arrival=request.arrival_time, p_scheduled=request.first_scheduled_time, p_done=now)
        remote.first_token = cost.first_token
        request.remote = remote
        if cost.first_token == "decode_recomputes":
            request.num_output_tokens = 0
        if cost.first_token != "from_prefill":
            request.first_token_time = request.last_token_time = None
        request.num_computed_tokens = 0
        self.env.process(self._lease(remote, cost.lease_s))

    def _lease(self, remote: RemoteKV, lease_s: float):
        yield self.env.timeout(lease_s)
        if "transfer_start" not in remote.times and remote.pinned is not None:
            remote.release_pinned()  # D never started reading: P frees the blocks, D will recompute
            remote.expired = True
            self.num_lease_expiries += 1

    def _loader(self, inst: Instance, cost: TransferCost) -> Callable[[Request], simpy.Event]:
        link = self.links[inst.instance_id]

        def load(request: Request) -> simpy.Event:
            done = self.env.event()
            self.env.process(self._transfer(request, link, cost, done))
            return done
        return load

    def _transfer(self, request: Request, link: Link, cost: TransferCost, done: simpy.Event):
        """One read: the fixed costs, then the bytes on the shared link; P frees its blocks when it is done."""
        remote = request.remote
        n = remote.num_loaded_tokens
        yield self.env.timeout(cost.fixed_s(n))
        yield link.send(remote.bytes)
        remote.release_pinned()  # finished_sending
        self.bytes_transferred += remote.bytes
        self.drafter_bytes_transferred += remote.drafter_bytes
        done.succeed()

