"""KV that reaches an instance from outside its GPU cache, and when its scheduler learns of it: reads of remote KV on a
decode instance (prefill/decode disaggregation, vLLM's ``WAITING_FOR_REMOTE_KVS``) and loads from the CPU tier (KV
offloading). Functions of the instance (lab/engine/instance.py ``Instance``): they use its queues, KV cache and
window, and the counters it keeps (``remote_pending``, ``loads_in_flight``, ``_loaded``, ``num_remote_loads``)."""

from __future__ import annotations

from lab.core.outputs import record_first_token
from lab.core.request import Request
from lab.engine.window import delay_until


def start_cpu_load(inst, request: Request, num_gpu_hit: int, num_cpu_tokens: int) -> None:
    """Start copying ``num_cpu_tokens`` tokens back from the CPU tier (EngineView ``start_cpu_load``); the
    request waits, out of every queue, until the engine learns the copy ended (:func:`cpu_loaded`). Its GPU
    prefix hit is its prefix-hit statistic, as if it were admitted now."""
    if not request.prefix_hit_recorded:
        request.prefix_hit_recorded = True
        request.prefix_hit_tokens = num_gpu_hit
        inst.kv.prefix_queries += request.num_tokens
        inst.kv.prefix_hits += num_gpu_hit
    now = inst.now
    done = inst.kv_offload.start_load(request, num_gpu_hit, num_cpu_tokens, now)
    inst.loads_in_flight += 1
    if request.events is not None:
        request.events.append((now, "cpu_load", f"{num_cpu_tokens} tokens from the CPU tier after a GPU prefix "
                                                f"hit of {num_gpu_hit} ({(done - now) * 1e3:.3f} ms over PCIe)"))
    env = inst.env
    env.timeout(delay_until(env.now, done)).callbacks.append(lambda _e: cpu_loaded(inst, request))


def cpu_loaded(inst, request: Request) -> None:
    """A CPU-tier load ended; the scheduler learns of it with the next step's output (at once if none runs)."""
    inst.loads_in_flight -= 1
    if inst.window.steps:
        inst.loads_done.append(request)
    else:
        admit_loaded(inst, [request])


def start_remote_loads(inst) -> None:
    """Allocate blocks for waiting remote KV in arrival order (the first that does not fit waits, P's blocks
    stay pinned) and start each read; a request whose lease expired on P joins the waiting queue to
    recompute its prompt here."""
    pending = inst.remote_pending
    # a read starts only while running + holding + reading requests stay under max_num_seqs (vLLM counts the
    # running ones only; counting the parked ones too keeps KV that cannot run from filling the cache)
    while pending and (len(inst.running) + len(inst.kv_holding) + inst.loads_in_flight
                       < inst.config.max_num_seqs):
        r = pending[0]
        remote = r.remote
        if remote.expired:
            pending.popleft()
            remote.times["transfer_start"] = remote.times["transfer_end"] = inst.now
            inst.waiting.add(r)
            continue
        ok, num_hit = inst.kv.allocate_for_remote(r, remote.num_tokens)
        if not ok:
            return
        pending.popleft()
        remote.num_loaded_tokens = remote.num_tokens - num_hit
        remote.times["transfer_start"] = inst.now
        inst.num_remote_loads += 1
        inst.loads_in_flight += 1
        inst.load_remote_kv(r).callbacks.append(lambda _e, r=r: remote_loaded(inst, r))  # type: ignore[misc]


def remote_loaded(inst, request: Request) -> None:
    """The read finished; the scheduler learns of it with the next step's output (at once if none runs)."""
    request.remote.times["transfer_end"] = inst.env.now
    inst.loads_in_flight -= 1
    if inst.window.steps:
        inst.loads_done.append(request)
    else:
        admit_loaded(inst, [request])


def admit_loaded(inst, requests: list[Request]) -> None:
    """Loaded requests rejoin the head of the waiting queue with C = num_tokens - 1: the last prompt token is
    recomputed and D samples its own first token (vLLM ``_update_waiting_for_remote_kv``); their full blocks
    are registered for prefix caching now that the KV is there. A request loaded from the CPU tier gets C = the
    tokens it holds now (GPU hit + CPU hit), ``num_tokens - 1`` when that is all of them."""
    inst.jump.before_arrival()
    bs = inst.kv.block_size
    for r in reversed(requests):
        remote = r.remote
        if remote is not None:
            c = r.num_tokens - 1  # (the prompt, and P's first token when it came with the KV: its KV D computes)
            remote.times["d_ready"] = inst.now
            if remote.first_token == "with_kv" and r.first_token_time is None:
                record_first_token(r, inst.now)  # D emits P's token with the KV (SGLang's prebuilt batch)
                r.last_token_time = inst.now
        else:
            c = min(inst.kv_offload.finish_load(r), r.num_tokens - 1)
        r.num_computed_tokens = c
        if inst.kv.enable_prefix_caching and c // bs > r.num_cached_blocks:
            inst.kv.register_full_blocks(r, c // bs)
        if inst.scheduler.admits_kv_holding:
            inst.kv_holding.appendleft(r)
        else:
            inst.waiting.prepend(r)
    inst.wake()


def drop_held_kv(inst, request: Request) -> None:
    """Nothing runs and no request holding KV that arrived (a remote read, or a load from the CPU tier) can be
    admitted (each needs more blocks than the others leave free): free the newest holder's blocks and let it
    recompute its prompt here, as a preemption (vLLM recomputes a request whose loaded KV it cannot use,
    ``kv_load_failure_policy = recompute``). Its copy in the CPU tier, if any, stays there."""
    inst.kv.free(request)
    request.num_computed_tokens = 0
    remote = request.remote
    if remote is not None:
        remote.expired = True
    request.num_preemptions += 1
    inst.num_preemptions += 1
    if request.events is not None:
        what = "remote KV" if remote is not None else "KV loaded from the CPU tier"
        request.events.append((inst.now, "preempted", f"{what} dropped: no holder could be admitted; "
                                                      "recompute here"))
    inst.waiting.prepend(request)
