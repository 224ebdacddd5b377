"""Regenerate the small traces in traces/generated/ with the project's seeded generator (lab/workload/synthetic.py).

    .venv/bin/python traces/generate.py            # rewrites traces/generated/*.csv
    .venv/bin/python traces/generate.py --out DIR  # writes them elsewhere (the tests compare the two)

Each file is the plain CSV the ``csv`` loader reads (``workload.source: csv``): ``request_id, arrival_time_s,
prompt_tokens, output_tokens, priority``; arrival times in seconds, written with 6 decimals (microseconds). The same
numpy version gives byte-identical files (numpy's Generator streams are stable across most releases; a change is
caught by tests/test_traces.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

from lab.workload.synthetic import LengthDist, generate  # noqa: E402

# name -> generate() arguments. Changing one changes its file: update traces/generated/README.md too.
SPECS: dict[str, dict] = {
    "poisson_chat_200": dict(
        num_requests=200, rate=4.0, cv=1.0, seed=0,
        prompt=LengthDist(kind="lognormal", median=600, sigma=0.9, max=8192),
        output=LengthDist(kind="lognormal", median=200, sigma=0.8, max=2048),
    ),
    "bursty_code_200": dict(
        num_requests=200, rate=3.0, cv=4.0, seed=1,
        prompt=LengthDist(kind="lognormal", median=1500, sigma=0.7, max=8192),
        output=LengthDist(kind="lognormal", median=30, sigma=1.0, max=512),
    ),
    "priority_mix_200": dict(
        num_requests=200, rate=6.0, cv=1.0, seed=2, num_priorities=3,
        prompt=LengthDist(kind="uniform", low=128, high=2048),
        output=LengthDist(kind="exponential", mean=256, max=2048),
    ),
}


def render(name: str) -> str:
    """The CSV text of trace ``name`` (deterministic: ``SPECS[name]`` fixes the seed)."""
    reqs = generate(**SPECS[name])
    lines = ["request_id,arrival_time_s,prompt_tokens,output_tokens,priority"]
    lines += [f"{name}-{r.index},{r.arrival_time:.6f},{r.prompt_len},{r.max_tokens},{r.priority}" for r in reqs]
    return "\n".join(lines) + "\n"


# A shared-prefix trace in the Mooncake format (``workload.source: mooncake``): requests open with one of a few long
# system prompts (whole 512-token hash blocks, shared) and go on with a question of their own (blocks unique to
# them), for prefix caching on hybrid models (experiments/hybrid_prefix_gpt_oss_qwen3next.yaml).
SHARED_PREFIX = dict(name="shared_prefix_300", num_requests=300, rate=6.0, seed=3, num_prefixes=4, prefix_blocks=8,
                     question=LengthDist(kind="lognormal", median=300, sigma=0.6, max=3000),
                     output=LengthDist(kind="lognormal", median=120, sigma=0.6, max=1024))


def render_shared_prefix() -> str:
    """The JSONL text of the shared-prefix trace (deterministic: ``SHARED_PREFIX`` fixes the seed). Timestamps in
    integer milliseconds; prefix ``k``'s blocks are hash ids ``k * 1000 + j``, every other block a fresh id."""
    import json

    import numpy as np

    spec = SHARED_PREFIX
    reqs = generate(spec["num_requests"], spec["rate"], spec["question"], spec["output"], seed=spec["seed"])
    rng = np.random.default_rng([spec["seed"], 0x5A])
    block = 512
    fresh = 1_000_000
    lines = []
    for r in reqs:
        k = int(rng.integers(spec["num_prefixes"]))
        prefix = [k * 1000 + j for j in range(spec["prefix_blocks"])]
        n = spec["prefix_blocks"] * block + r.prompt_len
        own = -(-n // block) - len(prefix)
        ids = prefix + list(range(fresh, fresh + own))
        fresh += own
        lines.append(json.dumps({"timestamp": int(round(r.arrival_time * 1000)), "input_length": n,
                                 "output_length": r.max_tokens, "hash_ids": ids}, separators=(",", ":")))
    return "\n".join(lines) + "\n"


def write_all(out_dir: Path) -> list[Path]:
    """Write every trace of ``SPECS`` as ``out_dir/<name>.csv`` (and the shared-prefix JSONL); return the CSV
    paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in SPECS:
        p = out_dir / f"{name}.csv"
        p.write_text(render(name))
        paths.append(p)
    (out_dir / f"{SHARED_PREFIX['name']}.jsonl").write_text(render_shared_prefix())
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", type=Path, default=HERE / "generated", help="output folder (default traces/generated)")
    args = ap.parse_args(argv)
    for p in write_all(args.out):
        print(p)


if __name__ == "__main__":
    main()
