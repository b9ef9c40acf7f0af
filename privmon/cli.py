"""Command line: ``privmon demo``, ``privmon report``, ``privmon audit``.

Bad arguments end with argparse's usage line and one error line; bad files, unwritable paths
and failed writes end with one line, ``privmon <command>: error: ...``; both exit with code 2.
An interrupt exits with 130. ``PRIVMON_DEBUG=1`` re-raises the error with its traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

__all__ = ["main"]


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def _threads(text: str) -> int:
    """Threads for torch: at most this machine's CPUs (torch crashes on absurd counts)."""
    v = _positive_int(text)
    most = os.cpu_count() or 1
    if v > most:
        raise argparse.ArgumentTypeError(
            f"must be an integer in [1, {most}] (the CPUs of this machine), got {text}"
        )
    return v


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None


def _positive_float(text: str) -> float:
    v = _float(text)
    if not 0.0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {text}")
    return v


def _unit_interval(text: str) -> float:
    v = _float(text)
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"must be in the open interval (0, 1), got {text}")
    return v


def _advantage(text: str) -> float:
    v = _float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be an advantage in [0, 1], got {text}")
    return v


_MAX_SEED = 2**64 - 1  # torch.manual_seed's range; numpy's generators take any seed >= 0


def _seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= v <= _MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**64 - 1], got {text}")
    return v


def _version() -> str:
    from privmon import __version__

    return f"privmon {__version__}"


def _add_audit(sub: Any) -> None:
    from privmon.audit.synthetic import TABLE_ATTACKS
    from privmon.estimators.methods import METHODS

    audit = sub.add_parser(
        "audit",
        help="audit saved member / non-member scores (.npy, .csv, .pt), or a released "
        "synthetic table (.csv, .parquet)",
        description="Saved scores (MEMBERS NONMEMBERS): advantage figures (value, certified "
        "lower bound, plug-in, upper), AUC, TPR at low FPR and epsilon lower bounds of two "
        "score sets, shape (n,) or (n, d). A released synthetic table (--synthetic, --members, "
        "--heldout, --reference): DOMIAS, its baselines and DCR, each with AUC, TPR at low "
        "FPR, advantage and certified lower bound (privmon.audit.audit_synthetic).",
    )
    audit.set_defaults(audit_parser=audit)
    audit.add_argument("members", nargs="?", help="scores of member records (.npy, .csv or .pt)")
    audit.add_argument(
        "nonmembers", nargs="?", help="scores of held-out records (.npy, .csv or .pt)"
    )
    audit.add_argument("--prior", type=_unit_interval, default=0.5, help="P(member), default 0.5")
    audit.add_argument(
        "--delta",
        type=_unit_interval,
        default=0.05,
        help="1 - joint confidence of the certified figures (default 0.05, split over methods "
        "and, for tables, attacks)",
    )
    audit.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=list(METHODS),
        help="advantage estimators (default: both)",
    )
    audit.add_argument(
        "--fpr",
        nargs="+",
        type=_unit_interval,
        default=None,
        help="target false-positive rates for TPR at low FPR (default 0.1 0.01 0.001)",
    )
    audit.add_argument(
        "--orientation",
        choices=("higher", "lower", "best"),
        default=None,
        help="saved scores: higher (default) or lower score = member (a loss), or the "
        "better of the two (optimistic)",
    )
    audit.add_argument("--json", action="store_true", help="print one JSON object")
    audit.add_argument("--threads", type=_threads, default=1, help="torch threads (default 1)")
    tables = audit.add_argument_group(
        "a released synthetic table (each a .csv with a header row, or .parquet)"
    )
    tables.add_argument("--synthetic", metavar="FILE", help="the released synthetic table")
    tables.add_argument(
        "--members", dest="members_table", metavar="FILE", help="the records it was fitted on"
    )
    tables.add_argument("--heldout", metavar="FILE", help="records of the same pool it never saw")
    tables.add_argument(
        "--reference",
        metavar="FILE",
        help="further population records, disjoint from both (fits the encoder and DOMIAS)",
    )
    tables.add_argument(
        "--categorical",
        metavar="COLS",
        help="comma-separated columns read as categories (default: the non-numeric ones)",
    )
    tables.add_argument(
        "--subgroup", metavar="COL", help="each attack's figures within each value of COL"
    )
    tables.add_argument(
        "--attacks",
        nargs="+",
        choices=TABLE_ATTACKS,
        default=None,
        metavar="ATTACK",
        help=f"the attacks to run, from {', '.join(TABLE_ATTACKS)} (default: all)",
    )
    tables.add_argument("--seed", type=_seed, default=None, help="LOGAN-D1's seed (default 0)")


_TABLE_FILES = (
    ("--synthetic", "synthetic"),
    ("--members", "members_table"),
    ("--heldout", "heldout"),
    ("--reference", "reference"),
)
_TABLE_OPTIONS = (
    ("--categorical", "categorical"),
    ("--subgroup", "subgroup"),
    ("--attacks", "attacks"),
    ("--seed", "seed"),
)


def _run_audit(args: argparse.Namespace) -> int:
    import json

    import torch

    parser = args.audit_parser
    given = [flag for flag, dest in _TABLE_FILES if getattr(args, dest) is not None]
    if given:
        if args.members is not None or args.nonmembers is not None:
            parser.error(
                "give saved scores (MEMBERS NONMEMBERS) or tables (--synthetic, --members, "
                "--heldout, --reference), not both"
            )
        missing = [flag for flag, dest in _TABLE_FILES if getattr(args, dest) is None]
        if missing:
            parser.error(f"a table audit needs all four tables: missing {', '.join(missing)}")
        if args.orientation is not None:
            parser.error("--orientation reads saved scores; the attacks score higher = member")
    else:
        extra = [flag for flag, dest in _TABLE_OPTIONS if getattr(args, dest) is not None]
        if extra:
            parser.error(f"{', '.join(extra)}: only with tables (--synthetic ...)")
        if args.members is None or args.nonmembers is None:
            parser.error(
                "give MEMBERS NONMEMBERS (saved scores) or --synthetic, --members, --heldout "
                "and --reference (a released synthetic table)"
            )
    torch.set_num_threads(args.threads)
    if given:
        return _run_audit_tables(args)
    from privmon.offline import audit_scores, format_audit, load_scores

    members, nonmembers = load_scores(args.members), load_scores(args.nonmembers)
    result = audit_scores(
        members,
        nonmembers,
        prior=args.prior,
        delta=args.delta,
        methods=args.methods,
        fpr=[0.1, 0.01, 0.001] if args.fpr is None else args.fpr,
        higher_is_member={"higher": True, "lower": False, "best": None}[
            args.orientation or "higher"
        ],
    )
    if args.json:
        print(json.dumps(_finite_json(result), indent=2, allow_nan=False))
    else:
        print(format_audit(result))
    return 0


def _run_audit_tables(args: argparse.Namespace) -> int:
    """``privmon audit --synthetic S --members M --heldout H --reference R``: prints the table
    of :func:`privmon.audit.audit_synthetic` on the four files, or with ``--json`` its
    ``to_dict()`` (NaN / inf as null); returns 0."""
    import json

    from privmon.audit.synthetic import TABLE_ATTACKS, audit_synthetic

    synthetic, members, heldout, reference = (
        _read_table(getattr(args, dest)) for _, dest in _TABLE_FILES
    )
    categorical = None
    if args.categorical is not None:
        categorical = [c.strip() for c in args.categorical.split(",") if c.strip()]
    kwargs: dict[str, Any] = {} if args.fpr is None else {"fprs": args.fpr}
    audit = audit_synthetic(
        synthetic,
        members,
        heldout,
        reference,
        attacks=TABLE_ATTACKS if args.attacks is None else args.attacks,
        categorical=categorical,
        delta=args.delta,
        subgroup=args.subgroup,
        prior=args.prior,
        methods=args.methods,
        seed=0 if args.seed is None else args.seed,
        **kwargs,
    )
    if args.json:
        print(json.dumps(_finite_json(audit.to_dict()), indent=2, allow_nan=False))
    else:
        print(audit.table())
    return 0


_TABLE_SUFFIXES = (".csv", ".parquet")


def _read_table(path: str) -> Any:
    """A table file as a DataFrame: CSV with a header row (pandas' ``read_csv``), or parquet
    (``read_parquet``, which needs pyarrow or fastparquet). Errors name the file, never a
    value of it."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in _TABLE_SUFFIXES:
        raise ValueError(f"{path}: a table must be a {' or '.join(_TABLE_SUFFIXES)} file")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file")
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("reading tables needs pandas: pip install 'privmon[synthetic]'") from None
    try:
        if suffix == ".csv":
            table = pd.read_csv(path)
        else:
            table = pd.read_parquet(path)
    except ImportError:
        raise ImportError(
            f"{path}: reading parquet needs pyarrow or fastparquet, which this Python lacks "
            "(pip install pyarrow), or save the table as .csv"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: cannot read the table (not UTF-8 text)") from None
    except Exception as err:  # the readers' own errors, reduced to one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path}: cannot read the table ({first})") from None
    if len(table.columns) and str(table.columns[0]) in ("", "Unnamed: 0"):
        raise ValueError(
            f"{path}: the first column is a row index (header {str(table.columns[0])!r}, as "
            "pandas writes it): save the table without it (to_csv(path, index=False))"
        )
    if len(table) == 0:
        raise ValueError(f"{path}: the table has no records")
    return table


def _finite_json(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_json(v) for v in obj]
    return obj


def _add_demo(sub: Any) -> None:
    demo = sub.add_parser("demo", help="train a small GAN on the digits under the monitor")
    demo.add_argument("--logdir", default="runs/privmon-demo", help="TensorBoard log directory")
    demo.add_argument("--steps", type=_positive_int, default=3000, help="training steps")
    demo.add_argument("--every", type=_positive_int, default=50, help="steps between checks")
    demo.add_argument("--dp", action="store_true", help="train the discriminator with Opacus")
    demo.add_argument(
        "--epsilon",
        type=_positive_float,
        default=3.0,
        help="with --dp: the ε budget Opacus spends over the run (default 3)",
    )
    demo.add_argument("--seed", type=_seed, default=0)
    demo.add_argument(
        "--budget",
        type=_advantage,
        default=None,
        help="stop when the certified advantage of the discriminator query "
        "stays above this, in [0, 1], for two checks",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument(
        "--threads",
        type=_threads,
        default=1,
        help="torch intra-op threads (default 1: the models are tiny, more threads only spin)",
    )


def _run_demo(args: argparse.Namespace) -> int:
    from privmon.demo import DemoConfig, format_summary, run_demo

    summary = run_demo(
        DemoConfig(
            logdir=args.logdir,
            steps=args.steps,
            dp=args.dp,
            seed=args.seed,
            every_n_steps=args.every,
            budget=args.budget,
            target_epsilon=args.epsilon,
            progress=not args.quiet,
            num_threads=args.threads,
        )
    )
    print(format_summary(summary))
    print(f"\nsummary: {args.logdir}/summary.json\nopen:    tensorboard --logdir {args.logdir}")
    print("         (first its Custom Scalars tab: each query's advantage, bound and budget)")
    return 0


def _add_report(sub: Any) -> None:
    from privmon.report import JSONL_NAME, REPORT_NAME
    from privmon.report.compare import COMPARISON_NAME

    parser = sub.add_parser(
        "report", help="write a self-contained HTML privacy report of a run, or compare runs"
    )
    parser.add_argument(
        "logdir",
        nargs="+",
        help=f"the monitor's log directory (with {JSONL_NAME} or TensorBoard event files), "
        "or a JSON-lines file; with --compare, one or several",
    )
    parser.add_argument(
        "--out",
        default=None,
        help=f"HTML file to write (default LOGDIR/{REPORT_NAME}; with --compare "
        f"{COMPARISON_NAME} in the folder that holds every LOGDIR)",
    )
    parser.add_argument("--title", default=None, help="page title")
    parser.add_argument(
        "--run",
        default=None,
        metavar="ID",
        help="the run to report when the log holds several (a second run written into the same "
        "directory): its id or a unique prefix of it, or 'latest' (the run that wrote last). "
        "Runs are never merged; logs written without run ids (by a privmon before them) are "
        "not read",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="one page with every run of the LOGDIRs side by side: a line per run on each "
        "chart, and each run's verdict, largest certified advantage and ε in one table",
    )


def _run_report(args: argparse.Namespace) -> int:
    """Run ``privmon report`` from parsed arguments: prints the verdict, the path and, on
    stderr, a warning line for each event file cut off or damaged, each skipped part of a line
    and for the runs left out; returns
    0. Bad input raises OSError, ValueError or ImportError, which :func:`main` turns into one
    error line and exit code 2 (several runs and no ``--run``: the line names them)."""
    from privmon.report import read_checks, verdict
    from privmon.report.page import write_page

    if args.compare:
        return _run_compare(args)
    if len(args.logdir) > 1:
        raise ValueError(
            f"{len(args.logdir)} log directories given: pass --compare to put their runs side "
            "by side, or one LOGDIR"
        )
    (logdir,) = args.logdir
    checks = read_checks(logdir, run=args.run)
    path = write_page(checks, logdir, args.out, args.title)
    warn = "privmon report: warning:"
    for sentence in checks.lost_events:
        print(f"{warn} {sentence}", file=sys.stderr)
    if checks.skipped_line is not None:
        print(
            f"{warn} skipped 1 line of {checks.source}: line "
            f"{checks.skipped_line} was cut off mid-write (the run was interrupted while "
            "writing it)",
            file=sys.stderr,
        )
    for lineno in checks.torn_lines:
        print(
            f"{warn} skipped the start of line {lineno} of {checks.source}: a line cut off "
            "mid-write, with a resumed run's line appended to it (that line is read)",
            file=sys.stderr,
        )
    if checks.other_runs:  # (each names its file or folder when they are not the source)
        where = "left out, never merged into it:"
        if not any(r.where for r in checks.other_runs):
            where = f"{checks.source} also holds"
        print(
            f"{warn} reported run {checks.run_id or '(no run id)'} only; {where} "
            + "; ".join(str(r) for r in checks.other_runs),
            file=sys.stderr,
        )
    print(verdict(checks).headline)
    print(f"report: {path}")
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    """``privmon report LOGDIR... --compare``: prints each run's verdict and the path (on
    stderr, a warning for each event file cut off or damaged)."""
    from privmon.report import read_runs
    from privmon.report.compare import run_summary, write_comparison_page

    if args.run is not None:
        raise ValueError("--run picks one run to report; --compare reports every run: pass one")
    runs = read_runs(args.logdir)
    path = write_comparison_page(runs, args.logdir, args.out, args.title)
    for sentence in dict.fromkeys(s for checks in runs for s in checks.lost_events):
        print(f"privmon report: warning: {sentence}", file=sys.stderr)
    for checks in runs:
        print(f"{checks.label}: {run_summary(checks)['headline']}")
    print(f"report: {path}")
    return 0


def _error_line(err: BaseException) -> str:
    """One line for an error: an OSError as "path: reason", anything else its message."""
    if isinstance(err, OSError) and err.strerror and err.filename is not None:
        return f"{os.fsdecode(err.filename)}: {err.strerror}"
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="privmon",
        description=__doc__.split("\n\n", 1)[0],
        epilog="PRIVMON_DEBUG=1 shows the traceback of an error.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_report(sub)
    _add_audit(sub)
    args = parser.parse_args(argv)
    run = {"audit": _run_audit, "demo": _run_demo, "report": _run_report}[args.command]
    try:
        return run(args)
    except KeyboardInterrupt:
        print(f"privmon {args.command}: interrupted", file=sys.stderr)
        return 130
    # Bad files, unwritable paths, failed writes, missing optional packages: one line, exit 2
    # (argparse's code). Other exceptions are bugs and keep their traceback.
    except (OSError, ValueError, ImportError, OverflowError) as err:
        if os.environ.get("PRIVMON_DEBUG", "") not in ("", "0"):
            raise
        print(f"privmon {args.command}: error: {_error_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
