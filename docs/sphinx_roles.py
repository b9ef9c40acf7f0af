"""Griffe extension for the API reference: the docstrings' Sphinx-style roles
(:func:`name`, :class:`~privmon.x.Y`, :meth:, :mod:, :data:, :attr:, :exc:, :obj:) become
cross-references. A name is resolved in the scope of the object whose docstring holds it
(its members, its module's imports, its parents); a link is made when the target is rendered
in the reference, the name is shown as code otherwise (an optional reference never warns)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import griffe

# a role's target may be broken across lines of the docstring
ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):`(~?)([\w.\s]+?)`")


def _objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias and isinstance(member, griffe.Object):
            yield from _objects(member)


def _resolve(scope: griffe.Object, name: str) -> str | None:
    if name.split(".")[0] == scope.package.name:
        return name
    head, _, rest = name.partition(".")
    try:
        base = scope.resolve(head)
    except griffe.NameResolutionError:
        return None
    return f"{base}.{rest}" if rest else base


class SphinxRoles(griffe.Extension):
    """Rewrite the roles of every docstring once the whole package is loaded (so that names
    imported from other modules resolve)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _objects(pkg):
            if obj.docstring is None:
                continue

            def link(match: re.Match[str], scope: griffe.Object = obj) -> str:
                short, name = match.group(1), re.sub(r"\s+", "", match.group(2))
                title = name.rsplit(".", 1)[-1] if short else name
                target = _resolve(scope, name)
                if target is None:
                    return f"`{title}`"
                return f'<autoref identifier="{target}" optional><code>{title}</code></autoref>'

            obj.docstring.value = ROLE.sub(link, obj.docstring.value)
