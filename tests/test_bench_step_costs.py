"""bench/step_costs.py: its counts add up to the run's steps, and it leaves the engine as it found it."""

import importlib.util
from pathlib import Path

import pytest

from lab.core.kv_cache import BlockPool
from lab.engine import jump
from lab.engine.jump_context import JumpContext
from lab.engine.instance import Instance

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("step_costs", ROOT / "bench" / "step_costs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _table(text: str, header: str) -> list[list[str]]:
    lines = text.split(header, 1)[1].strip().splitlines()[1:]  # skip the |---| line
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_real_schedules_and_jumped_steps_add_up_to_every_step(capsys):
    originals = (Instance.schedule_step, JumpContext.run, jump.plan, BlockPool.free_unique)
    step_costs = _load()
    assert step_costs.main([str(ROOT / "bench" / "million_16x.yaml"), "--set", "workload.num_requests=400",
                            "--set", "cluster.num_instances=2"]) == 0
    out = capsys.readouterr().out
    assert (Instance.schedule_step, JumpContext.run, jump.plan, BlockPool.free_unique) == originals
    head = out.splitlines()[0]  # "...: 400 requests, N steps, J fast-forwarded (P%), ..."
    steps, jumped = (int(x.split()[0].replace(",", "")) for x in head.split(" requests, ")[1].split(", ")[:2])
    kinds = _table(out, "| real schedule | before it | queue | count |")
    real = sum(int(r[3].replace(",", "")) for r in kinds)
    plans = dict((r[0], int(r[1].replace(",", ""))) for r in _table(out, "| fast-forward plan | count |"))
    calls = dict((r[0], int(r[1].replace(",", "")))
                 for r in _table(out, "| function | calls | seconds | us per call |"))
    assert {r[0] for r in kinds} <= {"admit", "decode", "chunk", "admit+chunk", "preempt", "preempt+admit",
                                     "preempt+chunk", "preempt+admit+chunk"}
    # behind round robin no arrival cuts a jump short, so every logged step is a real schedule or a jumped one
    assert real + jumped == steps and real > 0 and jumped > 0
    assert calls["jump.apply (a jump's bookkeeping)"] == plans["planned"]
    assert calls["Instance.add_request (an arrival)"] == 400


def test_a_bad_field_is_one_line_naming_it(capsys):
    step_costs = _load()
    with pytest.raises(SystemExit):
        step_costs.main([str(ROOT / "bench" / "million_16x.yaml"), "--set", "engine.max_num_seqs=zero"])
    assert "max_num_seqs" in capsys.readouterr().err


def test_decodes_that_verify_drafts_are_decodes_not_prompt_chunks(capsys):
    # speculative decoding schedules 1 + k tokens per decode: still a decode, not a prompt chunk
    step_costs = _load()
    step_costs.main([str(ROOT / "experiments" / "demo.yaml"), "--set", "workload.num_requests=60",
                     "--set", "speculative.method=eagle3", "--set", "speculative.num_speculative_tokens=3"])
    kinds = {}
    for kind, _, _, n in _table(capsys.readouterr().out, "| real schedule | before it | queue | count |"):
        kinds[kind] = kinds.get(kind, 0) + int(n.replace(",", ""))
    assert kinds["decode"] > 10 * kinds.get("chunk", 0)


def test_overrides_that_are_not_an_object_are_refused(capsys):
    step_costs = _load()
    with pytest.raises(SystemExit):
        step_costs.main([str(ROOT / "bench" / "million_16x.yaml"), "--overrides", "[1, 2]"])
    assert "--overrides: expected a JSON object, got list" in capsys.readouterr().err
