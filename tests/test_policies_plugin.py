"""The plug-in contract: the documented example is the tested file, a user policy loaded by path runs in an
experiment, and broken policy files or options fail with a clear error naming the file or field."""

import re
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from lab.cli.main import app
from lab.experiment.config import ConfigError, load_experiment, parse_experiment
from policies import PolicyError, make_scheduler

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "experiments" / "user_policies" / "shortest_prompt_first.py"
runner = CliRunner()


def test_the_docs_walkthrough_shows_the_example_file_verbatim_and_it_is_under_50_lines():
    doc = (REPO / "docs" / "policies.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    source = EXAMPLE.read_text()
    assert source in blocks
    assert len(source.splitlines()) < 50


def test_a_user_policy_loaded_by_path_runs_in_an_experiment(tmp_path):
    out = tmp_path / "o"
    res = runner.invoke(app, ["run", str(REPO / "experiments" / "user_policy.yaml"), "--out", str(out), "-q",
                              "--no-plots", "--set", "workload.num_requests=120"])
    assert res.exit_code == 0, res.output
    req = pd.read_csv(out / "requests.csv")
    assert (req["status"] == "finished").all() and len(req) == 120
    assert "shortest_prompt_first.py:ShortestPromptFirst" in (out / "report.md").read_text()


def test_user_policy_admits_the_shortest_prompt_first():
    from tests.conftest import make_engine, req, submit

    sched = make_scheduler(f"{EXAMPLE}:ShortestPromptFirst", options={"lookahead": 8})
    env, inst, _ = make_engine(scheduler=sched, max_num_seqs=1, max_num_batched_tokens=100)
    rs = [req(0, 4, 3), req(1, 30, 2, t=0.1), req(2, 5, 2, t=0.2), req(3, 12, 2, t=0.3)]
    submit(env, inst, rs)
    env.run()
    assert rs[2].first_scheduled_time < rs[3].first_scheduled_time < rs[1].first_scheduled_time


def test_policy_shorthand_and_relative_path(tmp_path):
    p = tmp_path / "e.yaml"
    p.write_text(f"name: x\npolicy: {EXAMPLE.relative_to(REPO)}:ShortestPromptFirst\n")
    with pytest.raises(ConfigError, match="does not exist"):  # relative to the experiment file, not the cwd
        load_experiment(p)
    p.write_text(f"name: x\npolicy: {EXAMPLE}:ShortestPromptFirst\n")
    assert load_experiment(p).policy.scheduler.endswith("ShortestPromptFirst")
    assert parse_experiment({"name": "x", "policy": "sarathi"}).policy.scheduler == "sarathi"


@pytest.mark.parametrize("source,cls,message", [
    ("def broken(:\n", "X", r"importing .*bad\.py failed: SyntaxError"),
    ("raise RuntimeError('no GPU here')\n", "X", r"importing .*bad\.py failed: RuntimeError: no GPU here"),
    ("class Other:\n    pass\n", "X", r"bad\.py has no class 'X' \(classes defined there: Other\)"),
    ("class X:\n    pass\n", "X", r"bad\.py:X has no schedule\(\.\.\.\) method"),
    ("class X:\n    def __init__(self):\n        raise ValueError('bad init')\n    def schedule(self, e):\n        pass\n",
     "X", r"bad\.py:X\(\) failed: ValueError: bad init"),
    ("X = 3\n", "X", r"bad\.py:X is not a class"),
    ("class X:\n    def schedule(self, e):\n        pass\n", "X", r"bad\.py:X must subclass lab\.core\.sched_api\.SchedulerBase"),
])
def test_a_broken_user_policy_fails_with_a_clear_error(tmp_path, source, cls, message):
    (tmp_path / "bad.py").write_text(source)
    exp = tmp_path / "e.yaml"
    exp.write_text(f"name: x\npolicy: {{scheduler: bad.py:{cls}}}\n")
    with pytest.raises(ConfigError, match=message) as e:
        load_experiment(exp)
    assert "e.yaml" in str(e.value) and "policy.scheduler" in str(e.value)
    res = runner.invoke(app, ["run", str(exp), "-q"])
    assert res.exit_code == 2 and "bad.py" in res.output


def test_missing_policy_file_and_unknown_name():
    with pytest.raises(PolicyError, match="file .*nope.py does not exist"):
        make_scheduler("nope.py:X")
    with pytest.raises(PolicyError, match="unknown scheduler 'sarathy'; known: orca, sarathi"):
        make_scheduler("sarathy")


def test_policy_options_are_validated():
    with pytest.raises(ConfigError, match=r"policy.options: unknown option\(s\) 'chunk'.*known: chunk_size, watermark"):
        parse_experiment({"name": "x", "policy": {"scheduler": "sarathi", "options": {"chunk": 4}}})
    with pytest.raises(ConfigError, match=r"policy.options.chunk_size: Input should be greater than or equal to 1"):
        parse_experiment({"name": "x", "policy": {"scheduler": "sarathi", "options": {"chunk_size": 0}}})
    with pytest.raises(ConfigError, match=r"'vllm_v1' takes no options"):
        parse_experiment({"name": "x", "policy": {"options": {"chunk_size": 8}}})
    with pytest.raises(ConfigError, match=r"policy.preemption.victim"):
        parse_experiment({"name": "x", "policy": {"preemption": {"victim": "oldest"}}})
    with pytest.raises(ConfigError, match=r"policy.options.lookahead"):
        parse_experiment({"name": "x", "policy": {"scheduler": f"{EXAMPLE}:ShortestPromptFirst",
                                                  "options": {"lookahead": 0}}})


def test_policies_command_lists_schedulers_routers_and_options():
    res = runner.invoke(app, ["policies"], env={"COLUMNS": "250"})
    assert res.exit_code == 0
    for name in ("vllm_v1", "sarathi", "orca", "static", "sglang", "sjf", "round_robin", "least_requests",
                 "least_tokens", "power_of_two", "prefix_aware", "session_affinity", "chunk_size=512"):
        assert name in res.output, name


def test_built_in_policies_are_imported_when_first_asked_for():
    """The registry names every built-in without importing it; asking for one imports its module once and keeps
    the class; an unknown name is a KeyError."""
    import subprocess
    import sys

    code = ("import sys, policies; assert 'policies.sglang' not in sys.modules; "
            "c = policies.scheduler_class('sglang'); assert 'policies.sglang' in sys.modules; "
            "assert policies.scheduler_class('sglang') is c and c.__name__ == 'SGLangScheduler'; "
            "assert policies.router_class('round_robin').__name__ == 'RoundRobinRouter'; "
            "assert set(policies.describe()) == set(policies.scheduler_names())")
    subprocess.run([sys.executable, "-c", code], check=True)
    import policies

    with pytest.raises(KeyError):
        policies.scheduler_class("no_such_scheduler")
    with pytest.raises(KeyError):
        policies.router_class("no_such_router")
