"""The package's layout rules, read from its source (DESIGN.md, "Layout"): no module imports
another module's private name; no two modules import each other, directly or through others (an
import inside a function counts: it hides a circle, it does not break it); layers point one way;
nothing imports the command line; every module reads in one sitting (≤ 600 lines, the monitor
≤ 450) and says what it is for in a few lines (at most 3 module docstrings over 30 lines)."""

from __future__ import annotations

import ast
import pathlib

import privmon

ROOT = pathlib.Path(privmon.__file__).parent


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(encoding="utf-8"))
    return out


def _imports(modules: dict[str, ast.Module]) -> dict[str, list[tuple[str, str]]]:
    """module -> [(imported module, imported name)] for every privmon import in it."""
    out: dict[str, list[tuple[str, str]]] = {}
    for name, tree in modules.items():
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("privmon"):
                found += [(node.module or "", alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(a.name, "") for a in node.names if a.name.startswith("privmon")]
        out[name] = found
    return out


def _edges(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, found in _imports(modules).items():
        for module, imported in found:
            sub = f"{module}.{imported}"
            target = sub if sub in modules else module
            # a package importing its own submodule runs it; the circle needs the way back
            if target != name:
                edges[name].add(target)
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_another_modules_private_name():
    modules = _modules()
    private = [
        f"{name} imports {imported} from {module}"
        for name, found in _imports(modules).items()
        for module, imported in found
        if imported.startswith("_") and not imported.startswith("__") and module != name
    ]
    assert private == []


def test_no_import_circle_between_modules():
    assert _circles(_edges(_modules())) == []


def test_the_checks_find_what_they_look_for():
    # the two checks above on made-up modules: a circle through three, a private import
    made = {
        "privmon.a": ast.parse("from privmon.b import f"),
        "privmon.b": ast.parse("def g():\n    from privmon.c import _h"),
        "privmon.c": ast.parse("import privmon.a"),
        "privmon.d": ast.parse("from privmon.a import f"),
    }
    assert _circles(_edges(made)) == [["privmon.a", "privmon.b", "privmon.c"]]
    assert [x for x in _imports(made)["privmon.b"] if x[1].startswith("_")] == [("privmon.c", "_h")]


# Layers point one way (DESIGN.md, "Layout"): each layer lists the privmon packages it may import
# besides itself and the shared private modules at the package's root (privmon._validation, …).
_MAY_IMPORT = {
    "privmon.estimators": set(),
    "privmon.models": set(),
    "privmon.attacks": {"privmon.estimators"},
    "privmon.queries": {"privmon.attacks", "privmon.models"},
    "privmon.audit": {"privmon.estimators", "privmon.attacks", "privmon.models", "privmon.queries"},
}


def _layer(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _shared(module: str) -> bool:
    """A private module at the package's root, shared by every layer (privmon._validation, …)."""
    parts = module.split(".")
    return len(parts) == 2 and parts[1].startswith("_")


def _layer_violations(modules: dict[str, ast.Module]) -> list[str]:
    out = []
    for name, found in _imports(modules).items():
        layer = _layer(name)
        if layer not in _MAY_IMPORT:
            continue
        allowed = _MAY_IMPORT[layer] | {layer}
        for module, _ in found:
            if not _shared(module) and _layer(module) not in allowed:
                out.append(f"{name} imports {module}")
    return sorted(set(out))


def test_layers_point_one_way():
    assert _layer_violations(_modules()) == []


def test_nothing_imports_the_command_line():
    importers = [
        n for n, found in _imports(_modules()).items() for m, _ in found if m == "privmon.cli"
    ]
    assert importers == []


def test_modules_read_in_one_sitting():
    sizes = {
        str(path.relative_to(ROOT.parent)): len(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(ROOT.rglob("*.py"))
    }
    assert {p: n for p, n in sizes.items() if n > 600} == {}
    assert sizes["privmon/callbacks/monitor.py"] <= 450


def test_the_layer_check_finds_what_it_looks_for():
    made = {
        "privmon.queries.x": ast.parse(
            "from privmon.audit.y import f\nfrom privmon._validation import g"
        ),
        "privmon.attacks.x": ast.parse("def f():\n    from privmon.queries import Q"),
        "privmon.audit.x": ast.parse("from privmon.queries import Q"),
        "privmon.estimators.x": ast.parse("import privmon.estimators.y"),
    }
    assert _layer_violations(made) == [
        "privmon.attacks.x imports privmon.queries",
        "privmon.queries.x imports privmon.audit.y",
    ]


def test_module_docstrings_are_short():
    long = {
        name: len(ast.get_docstring(tree, clean=False).splitlines())
        for name, tree in _modules().items()
        if ast.get_docstring(tree, clean=False)
        and len(ast.get_docstring(tree, clean=False).splitlines()) > 30
    }
    assert len(long) <= 3, long
