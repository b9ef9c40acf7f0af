"""Writes a pip constraints file that holds every dependency of pyproject.toml at its floor.

    python .ci/floors.py [--extras test,docs] [--pin torch==2.13.0] [--pyproject FILE] > floors.txt

Read from [project] dependencies and the named extras of [project.optional-dependencies]
(an extra may name others as privmon[...]); nothing here lists a package. Each requirement's
floor is the lowest version its specifiers admit (>=, ==, ~=), checked against the rest of
them (a != or < that excludes it is an error), and written as `name==floor`, so a floor must
name a published release (pytorch-ignite>=0.5.0.post2: there is no 0.5.0). A constraint applies
only to what gets installed, so transitive dependencies float.

The floors are taken as the requirements say. Every other extra is read too: a package that
another extra declares with a different floor than the tested one is an error (that floor
would never be tested), and one that only other extras declare is named on stderr (its floor
is not tested here). A requirement without a floor is named on stderr and floats.

--pin NAME==VERSION tests that release instead of the floor (it must satisfy the declared
specifiers); the output says that the floor itself is not tested.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version


def floor(spec: SpecifierSet) -> Version | None:
    """The lowest version ``spec`` admits by its lower bounds, or None where it has none."""
    lows = []
    for s in spec:
        if s.operator in (">=", "~=", "===") or (s.operator == "==" and "*" not in s.version):
            lows.append(Version(s.version))
        elif s.operator == "==":  # ==1.2.*: from 1.2 on
            lows.append(Version(s.version.removesuffix(".*")))
        elif s.operator == ">":
            raise SystemExit(f"floors: '{s}' has no lowest version: write >= instead")
    return max(lows) if lows else None


def requirements(
    project: dict, extras: list[str], seen: set[str] | None = None
) -> Iterator[tuple[str, Requirement]]:
    """(where, requirement) of the core install (where='core', when ``seen`` is None) and of
    ``extras``, those an extra names as ``<project>[...]`` included, whose markers hold here."""
    name = canonicalize_name(project["name"])
    optional = project.get("optional-dependencies", {})
    if seen is None:
        seen = set()
        yield from _own(project.get("dependencies", []), "core", None)
    for extra in extras:
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in optional:
            raise SystemExit(f"floors: pyproject.toml has no extra {extra!r}")
        for where, req in _own(optional[extra], extra, extra):
            if canonicalize_name(req.name) == name:
                yield from requirements(project, sorted(req.extras), seen)
            else:
                yield where, req


def _own(lines: list[str], where: str, extra: str | None) -> Iterator[tuple[str, Requirement]]:
    env = {**default_environment(), "extra": extra or ""}
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            yield where, req


def constraints(project: dict, extras: list[str], pins: dict[str, Version]) -> list[str]:
    tested: dict[str, tuple[Version | None, Requirement, list[str]]] = {}
    for where, req in requirements(project, extras):
        key = canonicalize_name(req.name)
        low = floor(req.specifier)
        if key in tested:
            old_low, old_req, wheres = tested[key]
            if old_low != low:
                raise SystemExit(
                    f"floors: {old_req} ({', '.join(wheres)}) and {req} ({where}) declare "
                    "different floors: make them agree"
                )
            tested[key] = (low, old_req, [*wheres, where])
        else:
            tested[key] = (low, req, [where])

    others = [e for e in project.get("optional-dependencies", {}) if e not in extras]
    untested = set()
    for extra in others:
        for where, req in requirements(project, [extra], set(extras)):
            key = canonicalize_name(req.name)
            low = floor(req.specifier)
            if key not in tested:
                untested.add(
                    f"floors: {req} ({where}) is in no tested extra: its floor is not tested"
                )
            elif tested[key][0] != low:
                raise SystemExit(
                    f"floors: {req} ({where}) and {tested[key][1]} ({', '.join(tested[key][2])}) "
                    "declare different floors: the tested one is the second, make them agree"
                )

    for line in sorted(untested):
        print(line, file=sys.stderr)
    unknown = set(pins) - set(tested)
    if unknown:
        raise SystemExit(f"floors: --pin of {sorted(unknown)}, which no tested requirement names")
    out = []
    for key, (low, req, wheres) in sorted(tested.items()):
        declared = f"{req.name}{req.specifier}" if req.specifier else req.name
        note = f"{declared} ({', '.join(wheres)})"
        if key in pins:
            if not req.specifier.contains(pins[key], prereleases=True):
                raise SystemExit(f"floors: --pin {key}=={pins[key]} is outside {declared}")
            out.append(f"{key}=={pins[key]}  # {note}: pinned, the floor {low} is NOT tested")
        elif low is None:
            print(
                f"floors: {declared} ({', '.join(wheres)}) has no floor: it floats", file=sys.stderr
            )
            out.append(f"# {key} floats: {note} declares no floor")
        elif not req.specifier.contains(low, prereleases=True):
            raise SystemExit(
                f"floors: the floor {low} of {declared} is excluded by its own "
                "specifiers: raise the >= to the first release it admits"
            )
        else:
            out.append(f"{key}=={low}  # {note}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pyproject", type=Path, default=Path(__file__).resolve().parent.parent / "pyproject.toml"
    )
    parser.add_argument(
        "--extras",
        default="test,docs",
        help="the extras whose floors are tested, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NAME==VERSION",
        help="test this release instead of NAME's floor (repeatable)",
    )
    args = parser.parse_args(argv)
    project = tomllib.loads(args.pyproject.read_text())["project"]
    extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    pins = {}
    for pin in args.pin:
        name, sep, version = pin.partition("==")
        if not sep:
            parser.error(f"--pin {pin!r}: NAME==VERSION")
        pins[canonicalize_name(name)] = Version(version)
    lines = constraints(project, extras, pins)
    print(f"# {project['name']}'s requirements at their floors: core, {', '.join(extras)}.")
    print(f"# Written by .ci/floors.py from {args.pyproject.name}; transitive dependencies float.")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
