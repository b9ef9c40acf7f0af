"""What a :class:`~privmon.PrivacyMonitor` is built from, checked at construction: its queries and
sinks as the monitor uses them, the audit sets, the accountant, early stopping's threshold
against the prior, and the folders it writes to (another run there is said)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any, cast

from torch import nn

from privmon._shown import shown
from privmon._validation import check_audit_set, check_has_methods, check_int
from privmon.bounds import epsilon_from_opacus
from privmon.callbacks.early_stopping import PrivacyEarlyStopping
from privmon.callbacks.loss_tracking import LossTracing
from privmon.callbacks.user_frame import stacklevel_to_user
from privmon.queries import CallableQuery
from privmon.report import tags
from privmon.report.runs import LATEST, runs_in
from privmon.sinks.base import Sink
from privmon.sinks.jsonl import JsonlSink

__all__ = [
    "OtherRuns",
    "as_modules",
    "as_queries",
    "as_sinks",
    "check_accountant",
    "check_audit_sets",
    "check_early_stopping",
    "check_epsilon_readable",
    "check_loss_tracing",
    "check_run_id",
    "optional_count",
    "traces_for_losses",
]

logger = logging.getLogger("privmon")


def as_queries(query: Any) -> list[Any]:
    """The monitor's queries: :mod:`privmon.queries` queries as they are, any other callable
    ``batch -> scores`` wrapped in a :class:`~privmon.queries.CallableQuery` named by its
    ``__name__`` (lambdas: ``query``, ``query_1``, …); names must differ."""
    given = list(query) if isinstance(query, (list, tuple)) else [query]
    if not given:
        raise ValueError("query must be a query or a non-empty sequence of queries")
    out, unnamed = [], 0
    for q in given:
        if isinstance(q, nn.Module) and not isinstance(getattr(q, "name", None), str):
            raise ValueError(
                f"query is a model ({type(q).__name__}), not a query: pass what an attacker "
                "observes of it, e.g. privmon.queries.LossQuery(model), another privmon.queries "
                "query, or a function batch -> scores"
            )
        if not callable(q):
            raise ValueError(
                f"query {shown(q)} is not callable: pass a privmon.queries query (e.g. "
                "privmon.queries.LossQuery(model)) or any function batch -> scores"
            )
        if isinstance(getattr(q, "name", None), str):
            out.append(q)
            continue
        name = getattr(q, "__name__", "<lambda>")
        if name == "<lambda>" or not isinstance(name, str):
            name = "query" if unnamed == 0 else f"query_{unnamed}"
            unnamed += 1
        out.append(CallableQuery(q, name=name))
    names = [q.name for q in out]
    if len(set(names)) != len(names):
        raise ValueError(f"query names must be unique, got {names}")
    return out


def check_audit_sets(members: Any, nonmembers: Any, *, sharded: bool) -> None:
    """Refuse one object as both audit sets, or a set that is not an iterable of batches (an
    empty one only where ``sharded``: a rank's shard under torch.distributed)."""
    if members is nonmembers:
        raise ValueError(
            "members and nonmembers are the same object: every figure would read no leak. "
            "Pass training records as members and held-out records as nonmembers"
        )
    for data, name in ((members, "members"), (nonmembers, "nonmembers")):
        check_audit_set(data, name=name, allow_empty=sharded)


def as_modules(modules: nn.Module | Sequence[nn.Module] | None) -> tuple[nn.Module, ...]:
    """The modules a check protects besides the queries': one, a sequence or None."""
    out = (modules,) if isinstance(modules, nn.Module) else tuple(modules or ())
    for module in out:
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"modules must be torch.nn.Module objects, got a {type(module).__name__}"
            )
    return out


def optional_count(value: Any, *, name: str) -> int | None:
    """None, or ``value`` as an integer >= 1 (``max_batches``, ``planned_checks``)."""
    return None if value is None else check_int(value, name=name, minimum=1)


def check_loss_tracing(tracing: Any, queries: Sequence[Any]) -> LossTracing | None:
    """``tracing`` when it is a :class:`LossTracing` or None, else a ValueError; also one when
    a query bears the name the loop's traces are reported under (``report.vulnerable``)."""
    if tracing is not None and not isinstance(tracing, LossTracing):
        raise ValueError(f"loss_traces must be a LossTracing or None, got {type(tracing).__name__}")
    if tracing is not None and any(q.name == tags.TRAINING_LOOP for q in queries):
        raise ValueError(
            f"a query is named {tags.TRAINING_LOOP!r}, the name loss_traces reports the training "
            "loop's traces under: name the query otherwise"
        )
    return tracing


def traces_for_losses(tracing: LossTracing | None) -> LossTracing:
    """The monitor's loss traces for ``record_losses``; a ValueError when it has none."""
    if tracing is None:
        raise ValueError("record_losses needs PrivacyMonitor(..., loss_traces=LossTracing(n))")
    return tracing


def check_accountant(accountant: Any) -> None:
    """Refuse an accountant that is neither None nor has ``get_epsilon(delta)``."""
    if accountant is not None and not callable(getattr(accountant, "get_epsilon", None)):
        raise ValueError(
            "accountant must be an Opacus PrivacyEngine or accountant "
            "(an object with get_epsilon(delta))"
        )


def as_sinks(sinks: Sink | Sequence[Sink] | None, writer: Any) -> list[Sink]:
    """The monitor's sinks: ``sinks`` (one, a sequence or None), each with ``write`` and
    ``close``, after a :class:`~privmon.sinks.TensorBoardSink` of ``writer`` when given."""
    if sinks is None:
        given: Sequence[Sink] = ()
    elif callable(getattr(sinks, "write", None)):  # a single sink
        given = (cast(Sink, sinks),)
    else:
        given = cast("Sequence[Sink]", sinks)
    out: list[Sink] = [
        check_has_methods(
            sink, "write", "close", name="sinks", expected="sinks with write() and close()"
        )
        for sink in given
    ]
    if writer is not None:
        from privmon.sinks.tensorboard import TensorBoardSink

        out.insert(0, TensorBoardSink(writer))
    return out


def check_epsilon_readable(accountant: Any, *, delta: float) -> None:
    """Read ε once at construction: an accountant that answers with something other than a
    number is refused now rather than at every check. One that cannot answer before training
    (it raises) is left for the checks to read."""
    try:
        epsilon_from_opacus(accountant, delta=delta)
    except ValueError as err:
        raise ValueError(f"accountant: {err}") from None
    except Exception:  # e.g. no step accounted yet: the first check reads it
        logger.debug("privmon: the accountant gave no ε before training", exc_info=True)


def check_early_stopping(stopping: Any, prior: float) -> None:
    """Refuse early stopping that is not a :class:`PrivacyEarlyStopping` (or None), and a budget
    on an advantage figure in [0, |2p − 1|): every figure is at least |2p − 1|
    (the advantage of guessing the likelier class, MACE eq. 7 at prior p), so it would stop
    training at the first check whatever leaks — a budget set on the scale of prior ½. Warn
    when the debiased estimate (``value``) is watched at the floor itself: it stops on noise."""
    if stopping is None:
        return
    if not isinstance(stopping, PrivacyEarlyStopping):
        raise ValueError("early_stopping must be a PrivacyEarlyStopping or None")
    floor = abs(2 * prior - 1)
    if not tags.is_advantage_estimate(stopping.tag):
        return
    if stopping.threshold < floor:
        raise ValueError(
            f"early_stopping's threshold {stopping.threshold:g} on {stopping.tag} is below "
            f"|2·prior − 1| = {floor:.4g}, the advantage of always guessing the likelier class "
            f"at prior {prior:g}: every advantage figure is at least that, so training would "
            f"stop at the first check whatever leaks; give a threshold in [{floor:.4g}, 1)"
        )
    if tags.is_debiased_estimate(stopping.tag) and stopping.threshold <= floor + 1e-12:
        message = (
            f"privmon: early stopping on {stopping.tag} (the debiased estimate, use='value') "
            f"with threshold {stopping.threshold:g} at prior {prior:g} stops on noise: "
            f"{floor:.4g} = "
            "|2·prior − 1| is every advantage figure's floor, and the debiased estimate of a run "
            "that leaks nothing lies above it at about every other check. Watch the certified "
            "lower bound (use='lower'), which exceeds the floor only where leakage is proven, "
            "or set the threshold above the floor by more than the estimate's noise"
        )
        logger.warning(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def check_run_id(value: Any) -> str:
    """``value`` as a monitor's run id: a non-empty string (what ``privmon report`` reads back
    from every line and event), not ``"latest"`` (``--run latest`` names the run that wrote
    last, so a run of that name could not be picked by it)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"run_id must be a non-empty string, got {value!r}: every line and event the run "
            "writes carries it, and privmon report reads it back as a string"
        )
    if value == LATEST:
        raise ValueError(
            f"run_id must be a non-empty string other than {LATEST!r}, which privmon report "
            "--run reads as the run that wrote last"
        )
    return value


def _places(sinks: Sequence[Sink]) -> list[tuple[str, str]]:
    """(what, path) of each place the monitor's sinks write that a run can be read back from:
    each TensorBoardSink's folder (the monitor's ``writer`` included) and JsonlSink's file."""
    from privmon.sinks.tensorboard import TensorBoardSink

    places = [
        ("writer", sink.logdir)
        for sink in sinks
        if isinstance(sink, TensorBoardSink) and sink.logdir is not None
    ]
    places += [("JsonlSink", sink.path) for sink in sinks if isinstance(sink, JsonlSink)]
    return places


class OtherRuns:
    """Warns once, before the monitor's first write (a UserWarning, and the log), when the
    TensorBoard folder or a JsonlSink's file already holds a run other than this one: its checks
    and this run's would mix (TensorBoard draws both on one line; ``privmon report`` reads one
    run at a time). Read then, not at construction, so a run resumed under its own id
    (``run_id=`` or ``load_state_dict``) is not warned about. Reading never fails the monitor."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self._places = _places(sinks)

    def say_once(self, run_id: str) -> None:
        """Read the places (the first call only) and warn of each other run found there."""
        places, self._places = self._places, []
        for what, path in places:
            self._say(what, path, run_id)

    @staticmethod
    def _say(what: str, path: str, run_id: str) -> None:
        try:
            others = [info for info in runs_in(path) if info.run_id != run_id]
        except ValueError as err:  # files privmon report cannot read back
            others, unreadable = [], str(err)
        except Exception:
            logger.debug("privmon: could not read the runs in %s", path, exc_info=True)
            return
        else:
            unreadable = ""
        if not others and not unreadable:
            return
        held = "; ".join(str(info) for info in others) if others else "files it cannot read"
        last = others[-1].run_id if others else ""
        message = (
            f"privmon: the {what} path {path!r} already holds another run: {held}. This run "
            f"({run_id}) would be mixed with it: TensorBoard draws every run of a folder on one "
            "line, and privmon report reads one run at a time. Write each run to a fresh folder "
            "(privmon.report.version_dir(root) gives root/version_N)"
            + (
                f", or, if this run resumes run {last}, pass PrivacyMonitor(..., "
                f"run_id={last!r}) and load its state_dict"
                if last
                else f" ({unreadable})"
            )
        )
        logger.warning(message)
        warnings.warn(message, UserWarning, stacklevel=stacklevel_to_user())
