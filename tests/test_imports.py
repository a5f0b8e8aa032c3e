"""The package's import graph has no cycles, models name no mesh axis, the config is light, and
no line in jaxpar/ is over MAX_LINE characters.

A cycle held apart by a function-local import still couples the two modules, so every import
counts, at module level or inside a function; only an import whose line carries a
`# optional: <why>` comment (an optional or heavy dependency) is left out of the graph.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxpar", "models")
MESH_AXES = {"data", "fsdp", "pipeline", "tensor", "expert", "context"}
OPTIONAL = "# optional:"
MAX_LINE = 110  # characters, in jaxpar/**/*.py (issue 13)


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, a package's __init__ named as the package."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_optional(node: ast.stmt, lines: list[str]) -> bool:
    return any(OPTIONAL in lines[i] for i in range(node.lineno - 1, node.end_lineno))


def _targets(node: ast.stmt, module: str, is_pkg: bool, known: set[str]) -> set[str]:
    """The package modules an import statement loads (`from pkg import sub` loads pkg.sub)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    base = node.module or ""
    if node.level:
        anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
        base = ".".join(anchor + ([base] if base else []))
    out = set()
    for a in node.names:
        if f"{base}.{a.name}" in known:
            out.add(f"{base}.{a.name}")
        elif base in known:
            out.add(base)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its body (optional ones left out)."""
    files = module_files()
    known = set(files)
    graph = {}
    for mod, path in files.items():
        src = path.read_text()
        lines = src.splitlines()
        edges = set()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not _is_optional(node, lines):
                edges |= _targets(node, mod, path.name == "__init__.py", known)
        graph[mod] = edges - {mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    detail = "\n".join(
        " <-> ".join(c) + "\n    " + "; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c)
        for c in found)
    assert not found, f"import cycles (break them, or mark an optional import `{OPTIONAL} <why>`):\n{detail}"


def test_cycle_finder_sees_function_local_and_submodule_imports(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    tree = ast.parse("def f():\n    from jaxpar.parallel import expert\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert _targets(node, "jaxpar.nn", False, {"jaxpar.parallel", "jaxpar.parallel.expert"}) == {
        "jaxpar.parallel.expert"}
    rel = ast.parse("from .schedule import build_timetable").body[0]
    assert _targets(rel, "jaxpar.parallel.pipeline", True, {"jaxpar.parallel.pipeline.schedule"}) == {
        "jaxpar.parallel.pipeline.schedule"}
    marked = "import jaxpar.cli  # optional: heavy\n"
    assert _is_optional(ast.parse(marked).body[0], marked.splitlines())


_SPEC_CALLS = {"P", "PartitionSpec", "NamedSharding"}
_AXIS_KWARGS = {"axis_name", "axis_names", "mesh_axes", "manual_axes"}
_COLLECTIVES = {"psum", "pmean", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "psum_scatter",
                "axis_index", "axis_size"}


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def mesh_axis_uses(src: str) -> list[tuple[int, str]]:
    """(line, axis) where code names a mesh axis: in a PartitionSpec, an axis_name, a collective."""
    out = []
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        named = set()
        if fn in _SPEC_CALLS:
            named |= set().union(*map(_strings, node.args), set())
        if fn in _COLLECTIVES:
            named |= set().union(*map(_strings, node.args[1:]), set())
        for kw in node.keywords:
            if kw.arg in _AXIS_KWARGS:
                named |= _strings(kw.value)
        out += [(node.lineno, a) for a in sorted(named & MESH_AXES)]
    return out


def test_models_name_no_mesh_axis():
    found = [f"{p.relative_to(ROOT)}:{line}: {axis!r}"
             for p in sorted((ROOT / "models").rglob("*.py")) for line, axis in mesh_axis_uses(p.read_text())]
    assert not found, "models/ must use logical axis names only:\n" + "\n".join(found)


def test_mesh_axis_check_sees_specs_and_collectives():
    src = ("P('data', None)\njax.lax.psum(x, 'tensor')\nshard_map(f, axis_names={'pipeline'})\n"
           "param(rngs, s, ('layers', 'expert'))\n")
    assert mesh_axis_uses(src) == [(1, "data"), (2, "tensor"), (3, "pipeline")]


def test_import_config_does_not_import_jax():
    code = "import jaxpar.config, sys; assert 'jax' not in sys.modules, sorted(sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_importing_jaxpar_starts_no_jax_backend():
    """Every module imports without starting a JAX backend: jax.distributed must start before
    any JAX call, and a script imports jaxpar before it calls jaxpar.distributed.initialize
    (a module-level jnp array would start one)."""
    mods = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                  for d in ("jaxpar", "models") for p in (ROOT / d).rglob("*.py"))
    code = ("import importlib, sys\nfrom jax._src import xla_bridge as xb\n"
            f"for m in {mods!r}:\n    importlib.import_module(m)\n"
            "    assert not xb._backends, f'importing {m} started a JAX backend'")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_no_line_over_110_characters_in_jaxpar():
    found = [f"{path.relative_to(ROOT)}:{i}: {len(line)} characters"
             for path in sorted((ROOT / "jaxpar").rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if len(line) > MAX_LINE]
    assert not found, f"lines over {MAX_LINE} characters (re-wrap them):\n" + "\n".join(found)
