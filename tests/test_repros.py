"""The known-bug reproducers of ../shared/repro, run from there (skipped when it is absent): each completes with
every request finished and the invariants holding. Plus the engine's progress guards."""

from pathlib import Path

import pytest

from lab.core.request import RequestStatus
from lab.core.sched_api import SchedulerBase, SchedulerContractError, SchedulerOutput
from lab.experiment.config import load_experiment, parse_experiment
from lab.experiment.simulation import simulate
from tests.conftest import DATA_DIR, make_engine, req, submit

REPRO = DATA_DIR.parent / "repro"
needs_repro = pytest.mark.skipif(not REPRO.is_dir(), reason=f"reproducers not found: {REPRO}")


def _run(name: str):
    res = simulate(load_experiment(REPRO / name))
    assert all(r.status == RequestStatus.FINISHED for r in res.requests), [
        (r.request_id, r.status.name, r.reason) for r in res.requests if r.status != RequestStatus.FINISHED]
    assert all(r.num_output_tokens == r.max_tokens for r in res.requests)
    for inst in res.instances:  # KV conserved: every block back in the free queue
        assert inst.kv.num_free_blocks == inst.kv.pool.num_gpu_blocks - 1
    return res


@needs_repro
def test_vllm_most_kv_victims_no_longer_livelock():
    # a request now never preempts one admitted before it, so the oldest always progresses
    res = _run("vllm_most_kv_livelock.yaml")
    assert res.sim_end < 30 and sum(i.num_preemptions for i in res.instances) < 1000


@needs_repro
def test_sglang_no_longer_rejects_a_request_mid_generation():
    # the step that retracted the last running request only made room: the engine lets SGLang schedule again
    res = _run("sglang_reject_midrun.yaml")
    assert not any(r.status == RequestStatus.REJECTED for r in res.requests)


@needs_repro
def test_sglang_max_num_seqs_reproducer_completes():
    _run("sglang_max_num_seqs.yaml")


class _Raises(SchedulerBase):
    def schedule(self, engine):
        if engine.now > 0.5:
            raise KeyError("boom")
        out = SchedulerOutput()
        for r in list(engine.waiting):
            engine.waiting.pop()
            engine.admit(r, 0)
            engine.kv.allocate_slots(r, r.num_tokens)
            out.add(r, r.num_tokens)
        for r in engine.running:
            if r not in out.requests:
                engine.kv.allocate_slots(r, 1)
                out.add(r, 1)
        return out


class _Idles(SchedulerBase):
    """Admits and then schedules nothing while its requests run."""

    def schedule(self, engine):
        out = SchedulerOutput()
        if engine.waiting:
            r = engine.waiting.pop()
            engine.admit(r, 0)
            engine.kv.allocate_slots(r, r.num_tokens)
            out.add(r, r.num_tokens)
        return out


def test_a_policy_that_raises_is_reported_with_its_name_and_the_time():
    env, inst, _ = make_engine(scheduler=_Raises())
    submit(env, inst, [req(0, 4, 10)])
    with pytest.raises(SchedulerContractError, match=r"_Raises .*raised KeyError: 'boom' \(at t = 1.000000 s\)"):
        env.run()


def test_a_policy_that_stalls_its_running_requests_is_stopped():
    env, inst, _ = make_engine(scheduler=_Idles())
    submit(env, inst, [req(0, 4, 10)])
    with pytest.raises(SchedulerContractError, match="nothing scheduled while 1 request"):
        env.run()


class _ChunkThenPreempt(SchedulerBase):
    """Admits the head with all but one prompt token (a chunk that samples nothing), then preempts it: the
    request recomputes for ever and no step emits a token."""

    def schedule(self, engine):
        out = SchedulerOutput()
        if engine.running:
            r = engine.running[-1]
            engine.preempt(r, reason="test")
            out.preempted.append(r)
            return out
        if not engine.waiting:
            return out
        r = engine.waiting.pop()
        engine.admit(r, 0)
        engine.kv.allocate_slots(r, r.num_tokens - 1)
        out.add(r, r.num_tokens - 1)
        return out


def test_a_preemption_livelock_is_stopped_with_the_request_named():
    env, inst, _ = make_engine(scheduler=_ChunkThenPreempt(), max_num_seqs=1, max_model_len=64)
    submit(env, inst, [req(7, 8, 4)])
    with pytest.raises(SchedulerContractError, match=r"no token emitted in 10,000 steps .*request 7 was preempted "
                                                     r"10,000 times since the last token"):
        env.run()
