"""The import graph of ``kvx/`` runs downward only (DESIGN section 1), and stays that way; the
layers above the agent use its public API.

Every ``import`` of a kvx module counts, at module level or inside a function, except those under
``if TYPE_CHECKING:`` (they do not run).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvx"


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (p, is_pkg)
    return out


def _extensions() -> set[str]:
    """Native extension modules (``Extension("kvx._native", ...)`` in setup.py): leaves of the graph."""
    setup = (ROOT.parent / "setup.py").read_text()
    return {c.value for c in ast.walk(ast.parse(setup)) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            and c.value.startswith("kvx.")}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for n in ast.walk(sub):
                    if hasattr(n, "lineno"):
                        skip.add(n.lineno)
    return skip


def graph() -> dict[str, set[str]]:
    """Module -> the kvx modules it imports (the most specific existing module of each import)."""
    mods = _modules()
    native = _extensions()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
            for t in targets:
                if t in native:
                    break
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges[name].add(t)
                    break
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle() -> None:
    assert _cycles(graph()) == []


def test_backends_import_only_downward() -> None:
    """A backend knows the contract (backends.base), memory, errors, config, net and _cuda; never
    the API layer, the tiers, the CLI, the benchmarks or the test apparatus."""
    above = ("kvx.agent", "kvx.bench", "kvx.compare", "kvx.testing", "kvx.tiers", "kvx.cli")
    bad = [(m, t) for m, ts in graph().items() if m.startswith("kvx.backends") for t in ts
           if t.startswith(above)]
    assert bad == []


def test_memory_imports_no_backend() -> None:
    assert not [t for t in graph()["kvx.memory"] if t.startswith("kvx.backends")]


def test_only_cli_and_bench_reach_the_benchmarks() -> None:
    g = graph()
    bad = [(m, t) for m, ts in g.items() if not m.startswith(("kvx.cli", "kvx.bench", "kvx.compare"))
           for t in ts if t.startswith(("kvx.bench", "kvx.compare"))]
    assert bad == []


def test_the_graph_sees_imports_inside_functions() -> None:
    """The checker itself: a function-level import counts (the agent imports discovery lazily)."""
    assert "kvx.discovery" in graph()["kvx.agent"]


def test_discovery_reaches_no_backend() -> None:
    """The side channel shares its networking helpers with the tcp backend through kvx.net."""
    assert not [t for t in graph()["kvx.discovery"] if t.startswith("kvx.backends")]


def test_users_of_the_agent_keep_to_its_public_api() -> None:
    """The tiers, the pool, the CLI, the benchmark runners and the plugins call no private name of
    an agent (``agent._x``, ``self.agent._x``): what they need has a public, documented method."""
    top = ROOT.parent
    files = [*ROOT.joinpath("tiers").rglob("*.py"), *ROOT.joinpath("pool").rglob("*.py"), ROOT / "cli.py",
             *ROOT.joinpath("bench").rglob("*.py"), *top.glob("plugins/*/kvx_*/**/*.py")]
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and ast.unparse(node.value).rpartition(".")[2] in ("agent", "_agent")):
                bad.append(f"{path.relative_to(top)}:{node.lineno} {ast.unparse(node)}")
    assert len(files) > 10 and bad == []
