"""Every public object has a docstring, and no source text points at a file that does not ship.

Public means: each name in ``__all__`` of the modules the API reference renders (docs/api/), and
each public method or property of a public class (its own, or inherited from a privmon class:
the reference shows those too). A module-level constant is documented by a string literal right
after its assignment (the form the reference reads)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from pathlib import Path

import privmon

# The modules docs/api/ renders (each page's `::: module` lines).
PUBLIC_MODULES = (
    "privmon",
    "privmon.queries",
    "privmon.callbacks",
    "privmon.sinks",
    "privmon.estimators",
    "privmon.attacks",
    "privmon.audit",
    "privmon.models",
    "privmon.bounds",
    "privmon.report",
    "privmon.report.tags",
    "privmon.offline",
    "privmon.integrations.lightning",
    "privmon.integrations.transformers",
    "privmon.integrations.ignite",
)

DOCS = Path(__file__).resolve().parents[1] / "docs"

# Public objects in files another branch was editing when this test was written: each is
# listed in that hand-over and leaves this set once it has a docstring (the test fails while a
# documented name is still here).
PENDING: set[str] = set()


def _own_doc(obj) -> str | None:
    """The object's own docstring: not a base class's, not the signature @dataclass writes."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
        return None if doc and doc.startswith(f"{obj.__name__}(") else doc
    if isinstance(obj, property):
        return obj.fget.__doc__ if obj.fget is not None else None
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__.__doc__
    return obj.__doc__


def _public_methods(cls):
    """(qualified name, member) of each public method / property of ``cls`` defined on it or on
    a privmon base class."""
    seen = set()
    for base in cls.__mro__:
        if not base.__module__.startswith("privmon"):
            continue
        for name, member in vars(base).items():
            if name.startswith("_") or name in seen:
                continue
            if inspect.isfunction(member) or isinstance(
                member, (property, staticmethod, classmethod)
            ):
                seen.add(name)
                yield f"{base.__module__}.{base.__qualname__}.{name}", member


def _constant_doc(name: str) -> tuple[str, str | None]:
    """Where the privmon constant ``name`` is assigned at module level, and the string literal
    that follows the assignment (None when there is none)."""
    for modname, module in sorted(sys.modules.items()):
        if not modname.startswith("privmon") or getattr(module, "__file__", None) is None:
            continue
        body = ast.parse(Path(module.__file__).read_text(encoding="utf-8")).body
        for node, after in zip(body, [*body[1:], None], strict=True):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                doc = None
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    doc = after.value.value if isinstance(after.value.value, str) else None
                return f"{modname}.{name}", doc
    raise LookupError(f"no module-level assignment of {name}")


def public_objects() -> dict[str, str | None]:
    """Qualified name -> own docstring (None when missing) of every public object, once each."""
    out: dict[str, str | None] = {}
    for modname in PUBLIC_MODULES:
        module = importlib.import_module(modname)
        out[modname] = module.__doc__
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                continue  # on its own page
            if inspect.isclass(obj) or inspect.isfunction(obj):
                out[f"{obj.__module__}.{obj.__qualname__}"] = _own_doc(obj)
                if inspect.isclass(obj):
                    out.update((q, _own_doc(m)) for q, m in _public_methods(obj))
            else:
                key, doc = _constant_doc(name)
                out[key] = doc
    return out


def test_every_public_object_has_a_docstring():
    objects = public_objects()
    missing = {name for name, doc in objects.items() if not (doc and doc.strip())}
    assert len(objects) > 200  # the walk reached the classes' methods
    assert sorted(missing - PENDING) == []
    assert sorted(PENDING - missing) == [], "documented now: remove from PENDING"


def test_a_missing_docstring_is_found():
    class Probe:
        def method(self):
            pass

        @property
        def figure(self):
            return 1

    Probe.__module__ = "privmon.probe"
    assert [(q.rsplit(".", 1)[1], _own_doc(m)) for q, m in _public_methods(Probe)] == [
        ("method", None),
        ("figure", None),
    ]


def test_the_api_pages_render_every_public_module():
    rendered = set()
    for page in (DOCS / "api").glob("*.md"):
        rendered |= set(re.findall(r"^::: ([\w.]+)", page.read_text(), re.MULTILINE))
    assert sorted(set(PUBLIC_MODULES) - rendered) == []


# Papers are cited by title and equation; the design notes and the papers' files do not ship.
FILE_REFERENCE = re.compile(
    r"DESIGN\.md|papers/|\.pdf\b|\.txt\b|mace-membership|domias-density|song-mittal-"
    r"|specific-setup-mia|reference-model-attacks\.md"
)
# "file:line" of references in files another branch was editing when this test was written.
PENDING_REFERENCES: set[str] = set()


def test_no_reference_to_a_file_that_does_not_ship():
    root = Path(privmon.__file__).parent
    hits = {
        f"{path.relative_to(root.parent).as_posix()}:{lineno}"
        for path in root.rglob("*.py")
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if FILE_REFERENCE.search(line)
    }
    assert sorted(hits - PENDING_REFERENCES) == []
    assert sorted(PENDING_REFERENCES - hits) == [], "fixed now: remove from PENDING_REFERENCES"


def test_the_file_reference_pattern():
    for text in ("see DESIGN.md", "papers/mace.md", "(``domias-density-ratio-mia.txt``)", "a.pdf"):
        assert FILE_REFERENCE.search(text), text
    for text in ("MACE eq. 7", "the specific-setup audit", "DOMIAS Sec. 5.3"):
        assert not FILE_REFERENCE.search(text), text


# The namespaces whose every public class and function shows a runnable example (`>>>`, run by
# pytest --doctest-modules): what a user imports first.
EXAMPLE_NAMESPACES = (
    "privmon",
    "privmon.queries",
    "privmon.audit",
    "privmon.attacks",
    "privmon.sinks",
)


def test_every_public_object_shows_a_runnable_example():
    missing = []
    for name in EXAMPLE_NAMESPACES:
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and ">>>" not in (
                _own_doc(obj) or ""
            ):
                missing.append(f"{name}.{attr}")
    assert missing == []
