"""The package table of the README's architecture section, executable.

Every import in ``kvtrace/`` (module level, inside functions, and under TYPE_CHECKING)
is read with ``ast`` and checked against what its package may import; the import graph
between kvtrace modules must have no cycle, type-only edges included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvtrace"

# kvtrace/errors.py, numeric.py, metrics.py, process.py, lazy.py, compiled.py, names.py: the ground
# floor, nothing above them
GROUND = {"errors", "numeric", "metrics", "process", "lazy", "compiled", "names"}
# package -> the kvtrace packages it may import (besides itself and the ground floor)
MAY_IMPORT: dict[str, set[str]] = {
    "workload": set(),
    "cache": {"workload"},
    "engine": {"workload", "cache"},
    "store": set(),
    "instrument": {"workload", "cache", "engine", "store"},
    "replay": {"workload", "cache", "engine", "instrument", "store"},
    "compare": {"workload", "cache", "store", "replay"},
    "dashboard": {"store", "compare"},
    "cli": {"workload", "cache", "engine", "instrument", "store", "replay", "compare", "dashboard"},
}
# Narrower rules inside an allowed edge: instrument turns events into spans, so of the
# cache and the engine it may read only their event modules.
ONLY_MODULES: dict[tuple[str, str], set[str]] = {
    ("instrument", "cache"): {"kvtrace.cache.events"},
    ("instrument", "engine"): {"kvtrace.engine.events"},
    # studies switch the cache behaviours by name: of the cache, compare reads only that data
    ("compare", "cache"): {"kvtrace.cache.config"},
    # Compare shows kvtrace diff's own numbers: the dashboard reads the comparison, never the
    # studies (which replay, and so import the engine)
    ("dashboard", "compare"): {"kvtrace.compare.source", "kvtrace.compare.render", "kvtrace.compare.model",
                               "kvtrace.compare.bootstrap", "kvtrace.compare.pairing"},
}
# Third-party packages a package must never import (the rest is free).
NEVER: dict[str, set[str]] = {
    "workload": {"torch", "opentelemetry", "duckdb", "polars", "pyarrow", "streamlit", "plotly"},
    "cache": {"torch", "opentelemetry", "duckdb", "polars", "pyarrow", "streamlit", "plotly"},
    "engine": {"opentelemetry", "duckdb", "polars", "streamlit", "plotly"},
    "store": {"torch", "opentelemetry", "streamlit", "plotly"},
    "dashboard": {"torch", "opentelemetry"},
    "errors": {"torch", "numpy"},
    "numeric": {"torch"},
    "metrics": {"torch", "polars", "duckdb"},
    "compiled": {"torch", "numpy", "msgspec"},  # setup.py reads it before any dependency is installed
    "names": {"torch", "numpy", "msgspec"},  # the CLI lists them before it imports anything heavy
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvtrace"


def _is_module(name: str) -> bool:
    p = ROOT.parent / Path(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file; relative imports resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    me = _module_name(path)
    base = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
            # `from kvtrace.store import derived` imports the submodule kvtrace.store.derived:
            # the edge is to it, not to the package's __init__ (unless a name is defined there)
            subs = [f"{mod}.{a.name}" for a in node.names]
            found = [m for m in subs if _is_module(m)]
            out += [(m, node.lineno) for m in found]
            if len(found) < len(subs):
                out.append((mod, node.lineno))
    return out


FILES = sorted(ROOT.rglob("*.py"))


def test_every_package_is_in_the_table():
    packages = {_package(_module_name(f)) for f in FILES} - {"kvtrace"}
    assert packages <= set(MAY_IMPORT) | GROUND, (
        f"packages missing from the layering table: {packages - set(MAY_IMPORT)}"
    )


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_imports_follow_the_layering(path):
    me = _module_name(path)
    pkg = _package(me)
    bad = []
    for mod, line in _imports(path):
        top = mod.split(".")[0]
        if top != "kvtrace":
            if top in NEVER.get(pkg, set()):
                bad.append(f"line {line}: {pkg} must not import {top}")
            continue
        target = _package(mod)
        if target in (pkg, "kvtrace") or target in GROUND:
            if pkg in GROUND and target not in GROUND and target != "kvtrace":
                bad.append(f"line {line}: the ground floor imports {mod}")
            continue
        if pkg in GROUND or target not in MAY_IMPORT.get(pkg, set()):
            bad.append(f"line {line}: {pkg} may not import {mod} ({target} is not below it)")
        elif (pkg, target) in ONLY_MODULES and mod not in ONLY_MODULES[(pkg, target)] and mod != f"kvtrace.{target}":
            bad.append(
                f"line {line}: {pkg} may import only {sorted(ONLY_MODULES[(pkg, target)])} of {target}, not {mod}"
            )
        elif (pkg, target) in ONLY_MODULES and mod == f"kvtrace.{target}":
            bad.append(f"line {line}: {pkg} may import only {sorted(ONLY_MODULES[(pkg, target)])} of {target}")
    assert not bad, f"{path.relative_to(ROOT.parent)}:\n  " + "\n  ".join(bad)


def test_no_import_cycles():
    modules = {_module_name(f): f for f in FILES}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for mod, _ in _imports(path):
            # importing kvtrace.a.b runs kvtrace.a's __init__ too, but that is not an edge of
            # this file's own code: keep the module named
            if mod in modules and mod != name:
                deps.add(mod)
        graph[name] = deps
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
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
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    assert not cycles, f"import cycles (type-only imports included): {cycles}"


VLLM_HOME = "kvtrace.engine.backends.vllm"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_only_the_vllm_backend_imports_vllm(path):
    """vLLM is optional (``make vllm``): one package of kvtrace may import it, and nothing
    outside that package imports the package at module level (so ``import kvtrace.engine``
    and the CLI's start never load vLLM)."""
    me = _module_name(path)
    inside = me == VLLM_HOME or me.startswith(VLLM_HOME + ".")
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    bad = []
    for mod, line in _imports(path):
        if mod.split(".")[0] == "vllm" and not inside:
            bad.append(f"line {line}: imports {mod}; only {VLLM_HOME} may import vllm")
    if not inside:
        for node in tree.body:  # module level only: a function may import the backend when called
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(n == VLLM_HOME or n.startswith(VLLM_HOME + ".") for n in names):
                    bad.append(f"line {node.lineno}: imports {VLLM_HOME} at module level")
    assert not bad, f"{path.relative_to(ROOT.parent)}:\n  " + "\n  ".join(bad)


def _readme_table() -> dict[str, set[str]]:
    """The README architecture table: package -> the kvtrace packages it says it imports."""
    readme = (ROOT.parent / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Architecture"):readme.index("\n## ", readme.index("## Architecture") + 1)]
    table: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`kvtrace."):
            continue
        names = [n.strip(" `").removeprefix("kvtrace.") for n in cells[0].split(",")]
        said = cells[2]
        imports = set(MAY_IMPORT) - set(names) if said == "all of the above" else {
            n.strip() for n in said.split(",") if n.strip() not in ("—", "")}
        for name in names:
            table[name] = imports
    return table


def test_the_readme_table_is_this_table():
    """The README says what each package may import; this test's table is the one enforced."""
    table = _readme_table()
    assert set(table) == set(MAY_IMPORT) | GROUND
    for pkg in GROUND:
        assert table[pkg] == set(), pkg
    for pkg, allowed in MAY_IMPORT.items():
        assert table[pkg] == allowed, (pkg, table[pkg], allowed)
