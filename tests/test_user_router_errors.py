"""A user's router loaded by path that returns no valid instance index: the run stops with one line naming the
router's file (exit status 2 from `servelab run`); a built-in router's message names no file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lab.cluster.cluster import RouterError, _checked
from policies import make_router

REPO = Path(__file__).resolve().parent.parent

ROUTER = """from lab.core.sched_api import RouterBase


class OutOfRange(RouterBase):
    \"\"\"Sends every request one past the last instance.\"\"\"

    def route(self, request, instances, now):
        return len(instances)
"""

EXPERIMENT = """name: bad_user_router
workload: {source: synthetic, num_requests: 4, rate: 1.0}
cluster: {num_instances: 2, router: "bad_router.py:OutOfRange"}
simulation: {progress: false}
"""


def test_servelab_run_with_a_user_router_returning_a_bad_index_exits_2_naming_its_file(tmp_path):
    router_file = tmp_path / "bad_router.py"
    router_file.write_text(ROUTER)
    exp = tmp_path / "exp.yaml"
    exp.write_text(EXPERIMENT)
    res = subprocess.run([sys.executable, "-m", "lab", "run", str(exp), "--out", str(tmp_path / "out"), "-q",
                          "--no-plots"], capture_output=True, text=True, cwd=REPO, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out, out
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), out
    assert "router OutOfRange returned 2; expected an instance index 0..1" in lines[0], lines[0]
    assert f"(router defined in {router_file})" in lines[0], lines[0]


def test_a_built_in_router_names_no_file():
    with pytest.raises(RouterError) as e:
        _checked(make_router("round_robin"), 5, 2)
    assert str(e.value) == "router RoundRobinRouter returned 5; expected an instance index 0..1"
