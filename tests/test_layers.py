"""The package's layer rule (docs/architecture.md, "Layers"): every import in lab/ and policies/ goes to the same or
a lower layer, and no modules import each other in a cycle.

Layers, lowest first: lab.core < lab.costmodel < lab.engine < lab.cluster < lab.workload = lab.experiment
< lab.report < lab.cli (lab/__init__.py and lab/__main__.py sit on top). ``policies`` stands beside them: it may
import only lab.core (and itself), and only lab.experiment and above may import it.

Every import statement counts, including those inside functions and under ``if TYPE_CHECKING``. Run it as a script
to print the violations and cycles: ``.venv/bin/python tests/test_layers.py``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS: dict[str, int] = {
    "lab.core": 0,
    "lab.costmodel": 1,
    "lab.engine": 2,
    "lab.cluster": 3,
    "lab.workload": 4,
    "lab.experiment": 4,
    "lab.report": 5,
    "lab.cli": 6,
    "lab": 7,  # lab/__init__.py, lab/__main__.py
}
POLICIES = "policies"
POLICY_USERS_FROM = LAYERS["lab.experiment"]  # lowest layer that may import policies


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every module of lab/ and policies/, dotted name -> file."""
    found = {}
    for top in ("lab", POLICIES):
        for path in sorted((ROOT / top).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported module) for every import of a project module in ``path``; ``from pkg import sub`` names
    the submodule when ``sub`` is one."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import lab.core.request as r` -> lab.core.request; drop attributes
                t = t.rpartition(".")[0]
            if t and t != name and (node.lineno, t) not in out:
                out.append((node.lineno, t))
    return out


def layer_of(module: str) -> tuple[str, int | None]:
    """(layer name, rank); rank None for policies."""
    if module == POLICIES or module.startswith(POLICIES + "."):
        return POLICIES, None
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYERS:
            return key, LAYERS[key]
    raise KeyError(module)


def violations(graph: dict[str, list[tuple[int, str]]], files: dict[str, Path]) -> list[str]:
    bad = []
    for src, edges in graph.items():
        src_layer, src_rank = layer_of(src)
        for line, dst in edges:
            dst_layer, dst_rank = layer_of(dst)
            where = f"{files[src].relative_to(ROOT)}:{line}: {src} imports {dst}"
            if src_rank is None:  # policies: lab.core and policies only
                if dst_layer not in ("lab.core", POLICIES):
                    bad.append(f"{where} (policies may import only lab.core)")
            elif dst_rank is None:
                if src_rank < POLICY_USERS_FROM:
                    bad.append(f"{where} ({src_layer} is below lab.experiment, the lowest user of policies)")
            elif dst_rank > src_rank:
                bad.append(f"{where} ({src_layer} is below {dst_layer})")
    return bad


def cycles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for _, w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph() -> tuple[dict[str, list[tuple[int, str]]], dict[str, Path]]:
    files = modules()
    return {name: imports(name, path, files) for name, path in files.items()}, files


def test_every_import_goes_to_the_same_or_a_lower_layer():
    graph, files = import_graph()
    assert not violations(graph, files)


def test_no_import_cycles_between_modules():
    graph, _ = import_graph()
    assert not cycles(graph)


def test_every_module_has_a_layer():
    graph, _ = import_graph()
    assert "lab.core.request" in graph and "policies.vllm_v1" in graph
    for name in graph:
        layer_of(name)


if __name__ == "__main__":
    g, f = import_graph()
    bad, loops = violations(g, f), cycles(g)
    for b in bad:
        print("layer:", b)
    for c in loops:
        print("cycle:", " <-> ".join(c))
    print(f"{len(g)} modules, {sum(map(len, g.values()))} imports: {len(bad)} layer violations, {len(loops)} cycles")
    sys.exit(1 if bad or loops else 0)
