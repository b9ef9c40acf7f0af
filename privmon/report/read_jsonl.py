"""Reading the JSON lines a :class:`~privmon.sinks.JsonlSink` wrote: each line checked field by
field, the checks kept per run (see :mod:`privmon.report`).

Only what a crash leaves is skipped: a last line with no newline that does not parse but begins
as every line a JsonlSink writes does (the writer was interrupted mid-line), and a cut-off line
that another line was appended to. A file whose first line is no check is not a privmon log, and
is refused as such. Any other bad
line is an error naming the line and the field, never skipped: the verdict is a statement about
every check, and a dropped check could be the one that certifies leakage. So is a figure out of
its range (an advantage outside [-1, 1], a negative ε) or written as a number that is not finite
(``NaN``, ``Infinity``, ``1e400``: the sink writes null there). A line without a run id
was written by a privmon before run ids, and is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from privmon.report import tags
from privmon.report.run_index import RunIndex

__all__ = ["BadLine", "JsonlChecks", "check_record", "check_stopping", "read_jsonl"]

_MAX_STEP = 2**63 - 1  # steps are plotted as int64
# how every line a JsonlSink writes begins (``step`` first: written before run ids)
_LINE_START = re.compile(rb'\{"(?:run_id|step)":')
_STARTS = (b'{"run_id":', b'{"step":')


class BadLine(ValueError):
    """A line of the JSON lines that is not a privmon check; the message names the field."""


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


class _NotFinite:
    """A number the JSON text writes as NaN / Infinity / -Infinity, or beyond the float range
    (``1e400``): never a check's, since the sink writes a figure that is not finite as null."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _float(text: str) -> float | _NotFinite:
    value = float(text)
    return value if math.isfinite(value) else _NotFinite(text)


def _number_or_null(v: Any, field: str) -> float:
    """A finite JSON number or null (the sink's NaN / inf) -> float."""
    if v is None:
        return math.nan
    if isinstance(v, _NotFinite):
        raise BadLine(
            f"{field} must be a finite number or null (JsonlSink writes NaN and ±inf as null), "
            f"got {v.text}"
        )
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise BadLine(f"{field} must be a number or null, got {_shown(v)}")
    try:
        return float(v)
    except OverflowError:  # an integer literal beyond the float range
        raise BadLine(f"{field} is out of range for a float: {_shown(v)}") from None


def _figure(tag: str, v: Any, field: str) -> float:
    """A figure's value: a number or null, within its range (:func:`~privmon.report.tags.
    valid_range`) when it is one; a value from memory may be NaN or ±inf."""
    x = _number_or_null(v, field)
    wrong = tags.out_of_range(tag, x)
    if wrong is not None:
        raise BadLine(f"{field} {wrong}, got {_shown(v)}")
    return x


def _count(v: Any, field: str, maximum: int = _MAX_STEP) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= maximum:
        raise BadLine(f"{field} must be an integer >= 0, got {_shown(v)}")
    return v


def _mapping(obj: dict[str, Any], field: str) -> dict[str, Any]:
    """``obj[field]`` as a dict; missing or null -> {}."""
    v = obj.get(field)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise BadLine(f"{field} must be a JSON object, got {_shown(v)}")
    return v


def _list(v: Any, field: str, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise BadLine(f"{field} must be a list of {what}, got {_shown(v)}")
    return v


# the fields of a decision (``stopping``) and of an outcome line, by type
_STOPPING_TYPES: dict[str, type | tuple[type, ...]] = {
    "tag": str, "use": str, "reason": (str, type(None)), "stop": bool, "decision": str,
    "sentence": str, "threshold": (int, float), "value": (int, float, type(None)),
    "highest": (int, float, type(None)), "stopped_value": (int, float, type(None)),
    "wait": int, "patience": int, "min_checks": int, "checks": int,
    "stopped_step": (int, type(None)), "last_within": (int, type(None)),
    "highest_step": (int, type(None)), "restored_step": (int, type(None)),
    "stopped_wait": (int, type(None)),
}  # fmt: skip


def check_stopping(v: Any, field: str) -> dict[str, Any]:
    """Early stopping's decision at a check (``stopping``) or the run's outcome line, its fields
    type-checked (others ignored); BadLine names the field that does not fit."""
    if not isinstance(v, dict):
        raise BadLine(f"{field} must be a JSON object, got {_shown(v)}")
    out = {}
    for key, kind in _STOPPING_TYPES.items():
        if key not in v:
            continue
        x = v[key]
        if isinstance(x, _NotFinite) or (isinstance(x, bool) and kind is not bool):
            raise BadLine(f"{field}[{key!r}] must be of type {kind}, got {_shown(x)}")
        if not isinstance(x, kind):
            raise BadLine(f"{field}[{key!r}] must be of type {kind}, got {_shown(x)}")
        out[key] = x
    return out


def _vulnerable(v: Any, field: str) -> dict[str, Any]:
    """One source's most vulnerable records (``Vulnerable.to_json``), every field checked."""
    if not isinstance(v, dict):
        raise BadLine(f"{field} must be an object, got {_shown(v)}")
    records = _list(v.get("records"), f"{field}['records']", "record indices (integers >= 0)")
    scores = _list(v.get("scores"), f"{field}['scores']", "numbers or null")
    if len(records) != len(scores):
        raise BadLine(f"{field} must hold as many scores as records")
    return {
        "records": [_count(i, f"{field}['records'][{j}]") for j, i in enumerate(records)],
        "scores": [_number_or_null(x, f"{field}['scores'][{j}]") for j, x in enumerate(scores)],
        "n_scored": _count(v.get("n_scored"), f"{field}['n_scored']"),
        "steps": _count(v.get("steps"), f"{field}['steps']"),
    }


def check_record(obj: Any) -> dict[str, Any]:
    """One line's JSON value as a check record, every field type checked (JsonlSink's format:
    ``privmon.report.Report.to_json``; other keys are ignored); :class:`BadLine` names the
    field that does not fit."""
    if not isinstance(obj, dict):
        raise BadLine(f"a check must be a JSON object, got {type(obj).__name__}")
    if "run_id" not in obj:
        raise BadLine(
            "run_id is missing: the line was written by a privmon before run ids, whose logs "
            "privmon report does not read"
        )
    run_id = obj["run_id"]
    if not isinstance(run_id, str):
        raise BadLine(f"run_id must be a string, got {_shown(run_id)}")
    if "step" not in obj:
        raise BadLine("step is missing")
    step = obj["step"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _MAX_STEP:
        raise BadLine(f"step must be an integer in [0, 2**63 - 1], got {_shown(step)}")
    scalars = {k: _figure(k, v, f"scalars[{k!r}]") for k, v in _mapping(obj, "scalars").items()}
    eps = obj.get("epsilon")
    dp_violation = obj.get("dp_violation", False)
    if not isinstance(dp_violation, bool):
        raise BadLine(f"dp_violation must be true or false, got {_shown(dp_violation)}")
    top_records = {}
    for k, v in _mapping(obj, "top_records").items():
        field = f"top_records[{k!r}]"
        indices = _list(v, field, "record indices (integers >= 0)")
        top_records[k] = [_count(i, f"{field}[{j}]") for j, i in enumerate(indices)]
    top_risks = {}
    for k, v in _mapping(obj, "top_risks").items():
        field = f"top_risks[{k!r}]"
        risks = _list(v, field, "numbers or null")
        top_risks[k] = [_number_or_null(r, f"{field}[{j}]") for j, r in enumerate(risks)]
    lt_iqr = {k: _vulnerable(v, f"lt_iqr[{k!r}]") for k, v in _mapping(obj, "lt_iqr").items()}
    messages = _list(obj.get("messages") or [], "messages", "strings")
    if not all(isinstance(m, str) for m in messages):
        raise BadLine(f"messages must be a list of strings, got {_shown(messages)}")
    causes = _list(obj.get("dp_causes") or [], "dp_causes", "strings")
    if not all(isinstance(c, str) for c in causes):
        raise BadLine(f"dp_causes must be a list of strings, got {_shown(causes)}")
    return {
        "run_id": run_id,
        "step": step,
        "scalars": scalars,
        "epsilon": None if eps is None else _figure(tags.EPSILON, eps, "epsilon"),
        "dp_violation": dp_violation,
        "top_records": top_records,
        "top_risks": top_risks,
        "top_tied": {
            k: _count(v, f"top_tied[{k!r}]") for k, v in _mapping(obj, "top_tied").items()
        },
        "messages": messages,
        "seconds": _number_or_null(obj.get("seconds"), "seconds"),
        **({"dp_causes": causes} if causes else {}),  # a check that found a DP violation
        **({"lt_iqr": lt_iqr} if lt_iqr else {}),  # with loss traces
        **(
            {"stopping": check_stopping(obj["stopping"], "stopping")} if obj.get("stopping") else {}
        ),
    }


def _parse_line(raw: bytes) -> Any:
    """One line's JSON value; BadLine when it is not UTF-8 text or not valid JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadLine(f"not UTF-8 text (byte {err.start + 1})") from None
    try:
        return json.loads(text, parse_float=_float, parse_constant=_NotFinite)
    except RecursionError:  # nested too deep for the parser
        raise BadLine("not valid JSON (nested too deep)") from None
    except ValueError as err:
        raise BadLine(f"not valid JSON ({err})") from None


def _after_torn_start(raw: bytes) -> Any:
    """The JSON object of the whole line that follows a line cut off mid-write on the same line,
    or None: both parts begin as every line a JsonlSink writes does, and only the second
    parses."""
    if not _LINE_START.match(raw):
        return None
    for start in _LINE_START.finditer(raw, 1):
        try:
            value = _parse_line(raw[start.start() :])
        except BadLine:
            continue
        return value if isinstance(value, dict) else None
    return None


def _cut_off(raw: bytes) -> bool:
    """Whether a last line with no newline can be a line a JsonlSink was writing when it was
    interrupted: it begins as every such line does, or is cut within that beginning (the NUL
    bytes a crash of the machine can leave after it aside)."""
    raw = raw.rstrip(b"\0")
    return bool(_LINE_START.match(raw)) or any(start.startswith(raw) for start in _STARTS)


def _could_be_a_check(obj: Any) -> bool:
    """Whether a line's JSON value is meant as a privmon line (a check, or an outcome)."""
    keys = ("run_id", "step", tags.STOPPING_OUTCOME_KEY)
    return isinstance(obj, dict) and any(key in obj for key in keys)


def _not_a_log(path: str, lineno: int, err: BadLine) -> ValueError:
    """The error for a file whose first line is no check (a text file, an event file, ...)."""
    hint = ""
    if "tfevents" in os.path.basename(path):
        hint = " (a TensorBoard event file: pass the folder that holds it)"
    return ValueError(
        f"{path}, line {lineno}: {err}: the file is not a privmon log{hint}; privmon report "
        "reads the JSON lines a JsonlSink writes, or a log directory"
    )


@dataclass
class JsonlChecks:
    """What :func:`read_jsonl` found."""

    runs: RunIndex
    skipped: int | None  # the last line, cut off mid-write
    torn: list[int]  # lines that begin with a line cut off mid-write
    outcomes: dict[str, dict[str, Any]] = dataclasses.field(
        default_factory=dict
    )  # run -> its last outcome


def read_jsonl(path: str) -> JsonlChecks:
    """The check records of a JSON-lines file, per run (what is skipped: the module
    docstring); a ValueError names the first line that is not a check, and the field."""
    runs = RunIndex("lines")
    skipped, torn, outcomes = None, [], {}
    read = 0  # lines read as checks or outcomes
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = _parse_line(raw)
            except BadLine as err:
                obj = _after_bad_line(path, lineno, raw, err, first=not read)
                if obj is None:  # only the last line can lack its newline
                    skipped = lineno
                    continue
                torn.append(lineno)
            record, outcome = _check_or_outcome(path, lineno, obj, first=not read)
            if outcome is not None:
                outcomes[outcome[0]] = outcome[1]
            else:
                runs.put(record["run_id"], record["step"], record, lineno)
            read += 1
    return JsonlChecks(runs, skipped, torn, outcomes)


def _after_bad_line(path: str, lineno: int, raw: bytes, err: BadLine, *, first: bool) -> Any:
    """What a line that does not parse holds after a start torn by an earlier cut-off write;
    None for a last line cut off mid-write; otherwise the ValueError naming the line (the
    file's ``first`` line: that the file is no privmon log)."""
    obj = _after_torn_start(raw)
    if obj is not None:
        return obj
    if not raw.endswith(b"\n") and _cut_off(raw):
        return None
    if first:
        raise _not_a_log(path, lineno, err) from None
    raise ValueError(f"{path}, line {lineno}: {err}") from None


def _check_or_outcome(
    path: str, lineno: int, obj: Any, *, first: bool
) -> tuple[dict[str, Any], tuple[str, dict[str, Any]] | None]:
    """A parsed line as (the check record, None), or (an empty record, (run id, its early-
    stopping outcome)); a ValueError names the line and the field that is not a check's."""
    try:
        if isinstance(obj, dict) and tags.STOPPING_OUTCOME_KEY in obj:  # not a check
            run_id = obj.get("run_id")
            if not isinstance(run_id, str):
                raise BadLine(f"run_id must be a string, got {_shown(run_id)}")
            key = tags.STOPPING_OUTCOME_KEY
            return {}, (run_id, check_stopping(obj[key], key))
        return check_record(obj), None
    except BadLine as err:
        if first and not _could_be_a_check(obj):
            no_check = BadLine("no privmon check (a JSON object with a run_id and a step)")
            raise _not_a_log(path, lineno, no_check) from None
        raise ValueError(f"{path}, line {lineno}: {err}") from None
