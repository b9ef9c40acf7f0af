"""The package's layout rules, read from its source (docs/architecture.md, "Layers" and "Rules
every part keeps"): no module imports another module's private name; no two modules import each
other, directly or through others (an import inside a function counts: it hides a circle, it
does not break it); every layer is in the table and points one way; nothing imports the command
line; every module reads in one sitting (≤ 600 lines, the monitor ≤ 450) and says what it is for
in a few lines (at most 3 module docstrings over 30 lines); the check path's functions read one
by one (≤ 50 lines, ≤ 4 nested blocks)."""

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


# Layers point one way (docs/architecture.md, "Layers"): each layer lists the privmon packages and
# top-level modules it may import besides itself and the shared private modules at the package's
# root (privmon._validation, …). Every layer of the package is listed: a new one must be placed.
_MAY_IMPORT = {
    "privmon.estimators": set(),
    "privmon.models": set(),
    "privmon.bounds": {"privmon.estimators"},
    "privmon.attacks": {"privmon.estimators"},
    "privmon.queries": {"privmon.attacks", "privmon.models"},
    "privmon.audit": {"privmon.estimators", "privmon.attacks", "privmon.models", "privmon.queries"},
    "privmon.report": {"privmon.estimators", "privmon.bounds"},
    "privmon.sinks": {"privmon.estimators", "privmon.report"},
    "privmon.offline": {"privmon.estimators", "privmon.bounds"},
    "privmon.callbacks": {  # it wires all of them (docs/architecture.md)
        "privmon.estimators",
        "privmon.bounds",
        "privmon.attacks",
        "privmon.audit",
        "privmon.queries",
        "privmon.report",
        "privmon.sinks",
    },
    "privmon.integrations": {
        "privmon.callbacks",
        "privmon.queries",
        "privmon.report",
        "privmon.sinks",
    },
    "privmon.demo": {"privmon.callbacks", "privmon.queries", "privmon.report", "privmon.sinks"},
    # the package's face re-exports the public names; the command line may use all of it
    "privmon": {"privmon.attacks", "privmon.bounds", "privmon.callbacks", "privmon.estimators"},
    "privmon.cli": {
        "privmon",
        "privmon.audit",
        "privmon.demo",
        "privmon.estimators",
        "privmon.offline",
        "privmon.report",
    },
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
        if _shared(name):
            continue
        if layer not in _MAY_IMPORT:
            out.append(f"{name} is in no layer of the table")
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
        "privmon.widgets.x": ast.parse("import privmon.estimators"),
        "privmon._shared_helper": ast.parse("import privmon.estimators"),
    }
    assert _layer_violations(made) == [
        "privmon.attacks.x imports privmon.queries",
        "privmon.queries.x imports privmon.audit.y",
        "privmon.widgets.x is in no layer of the table",
    ]


def test_module_docstrings_are_short():
    long = {
        name: len(ast.get_docstring(tree, clean=False).splitlines())
        for name, tree in _modules().items()
        if ast.get_docstring(tree, clean=False)
        and len(ast.get_docstring(tree, clean=False).splitlines()) > 30
    }
    assert len(long) <= 3, long


# Functions read one by one: none nested deeper than 4 blocks anywhere, and on the check path
# (what runs inside a monitor's check) none longer than 50 lines, its docstring aside; nested
# functions and classes are measured on their own.
_CHECK_PATH = (
    "privmon/callbacks/",
    "privmon/estimators/",
    "privmon/queries/",
    "privmon/sinks/",
    "privmon/bounds.py",
    "privmon/report/build.py",
    "privmon/report/tags.py",
    "privmon/audit/mechanism",
)
_MAX_LINES, _MAX_DEPTH = 50, 4


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = fn.body[1:] if ast.get_docstring(fn, clean=False) is not None else fn.body
    return (body[-1].end_lineno or 0) - body[0].lineno + 1 if body else 0


def _depth(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The deepest statement's indentation below the function's body, in blocks (an ``elif``
    is its ``if``'s level, as it reads)."""
    base, deepest = fn.body[0].col_offset, 0
    stack: list[ast.AST] = list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        deepest = max(deepest, (getattr(node, "col_offset", base) - base) // 4)
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            stack.extend(getattr(node, field, []))
    return deepest


def _long_functions(trees: dict[str, ast.Module], *, max_lines: int | None) -> list[str]:
    out = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines, depth = _body_lines(node), _depth(node)
                if (max_lines is not None and lines > max_lines) or depth > _MAX_DEPTH:
                    out.append(f"{path}:{node.lineno} {node.name}: {lines} lines, depth {depth}")
    return out


def test_functions_read_one_by_one():
    trees = {
        str(path.relative_to(ROOT.parent)): ast.parse(path.read_text(encoding="utf-8"))
        for path in sorted(ROOT.rglob("*.py"))
    }
    on_path = {p: t for p, t in trees.items() if p.startswith(_CHECK_PATH)}
    assert len(on_path) > 60
    assert _long_functions(on_path, max_lines=_MAX_LINES) == []
    assert _long_functions(trees, max_lines=None) == []


def test_the_function_check_finds_what_it_looks_for():
    deep = "def f(x):\n" + "".join("    " * (i + 1) + f"if x > {i}:\n" for i in range(5))
    deep += "    " * 6 + "return x\n"
    long = 'def g():\n    """doc"""\n' + "    x = 1\n" * 51
    elifs = "def h(x):\n" + "".join(
        f"    {'if' if i == 0 else 'elif'} x == {i}:\n        return {i}\n" for i in range(25)
    )
    trees = {"m.py": ast.parse(deep + long + elifs)}
    found = _long_functions(trees, max_lines=_MAX_LINES)
    assert found == ["m.py:1 f: 6 lines, depth 5", "m.py:8 g: 51 lines, depth 0"]
    assert _long_functions(trees, max_lines=None) == ["m.py:1 f: 6 lines, depth 5"]


def test_tests_mirror_the_packages():
    # tests/<package>/ holds a package's tests; tests/ itself the whole package's rules (layout,
    # docs, names, messages), its root modules' (bounds, cli, demo) and the shared helpers
    tests = pathlib.Path(__file__).parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert folders <= packages, folders - packages
    assert all(any((tests / f).glob("test_*.py")) for f in folders)
    assert len(folders) >= 7


def _private_torch(trees: dict[str, ast.Module]) -> list[str]:
    """Every ``torch.<…>._name`` reached from the torch module (``torch._foreach_norm``,
    ``torch._C``, ``torch.nn.utils._x``): torch's private API."""
    out = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "torch" and chain:
                if any(part.startswith("_") and not part.startswith("__") for part in chain):
                    out.append(f"{name}: torch.{'.'.join(reversed(chain))}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                parts = [*(node.module or "").split("."), *(a.name for a in node.names)]
                if any(p.startswith("_") and not p.startswith("__") for p in parts):
                    out.append(f"{name}: from {node.module} import ...")
    return sorted(set(out))


def test_no_private_torch_api():
    assert _private_torch(_modules()) == []
    made = {"m": ast.parse("import torch\nx = torch._foreach_norm(t)\nfrom torch._C import y")}
    assert _private_torch(made) == ["m: from torch._C import ...", "m: torch._foreach_norm"]


def _torch_private_attributes() -> set[str]:
    """The private attribute names of torch's tensors, parameters, modules and optimizers
    (``_version``, ``_parameters``, ``_forward_hooks``, …), read off live objects."""
    import torch
    from torch import nn

    layer = nn.Linear(1, 1)
    objects = (torch.zeros(1), layer, layer.weight, torch.optim.SGD(layer.parameters(), lr=1.0))
    return {n for o in objects for n in dir(o) if n.startswith("_") and not n.startswith("__")}


def _private_attribute_reads(trees: dict[str, ast.Module], names: set[str]) -> list[str]:
    """``x.<name>`` for a torch private attribute ``name`` on anything but ``self`` / ``cls``."""
    return sorted(
        f"{module}: {ast.unparse(node)}"
        for module, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in names
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    )


def test_no_private_attribute_of_torch_objects_is_read():
    # One exception, with no public route in torch: whether a module has forward hooks, which a
    # stacked ensemble would not run (so a template with any is not stacked).
    names = _torch_private_attributes()
    assert {"_version", "_parameters", "_buffers", "_forward_hooks"} <= names
    hooks = {
        "privmon.models.linear_stack: layer._forward_hooks",
        "privmon.models.linear_stack: layer._forward_pre_hooks",
        "privmon.models.linear_stack: template._forward_hooks",
        "privmon.models.linear_stack: template._forward_pre_hooks",
    }
    assert set(_private_attribute_reads(_modules(), names)) == hooks
    made = {"m": ast.parse("v = p._version\nself._version = 1\nb = m._buffers")}
    assert _private_attribute_reads(made, names) == ["m: m._buffers", "m: p._version"]
