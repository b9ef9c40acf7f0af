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
    from privmon.estimators.methods import METHODS

    audit = sub.add_parser(
        "audit",
        help="audit saved member / non-member scores (.npy, .csv, .pt)",
        description="Advantage figures (value, certified lower bound, plug-in, upper), AUC, "
        "TPR at low FPR and epsilon lower bounds of two saved score sets, shape (n,) or (n, d).",
    )
    audit.add_argument("members", help="scores of member records (.npy, .csv or .pt)")
    audit.add_argument("nonmembers", help="scores of held-out records (.npy, .csv or .pt)")
    audit.add_argument("--prior", type=_unit_interval, default=0.5, help="P(member), default 0.5")
    audit.add_argument(
        "--delta",
        type=_unit_interval,
        default=0.05,
        help="1 - joint confidence of the certified figures (default 0.05, split over methods)",
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
        default=[0.1, 0.01, 0.001],
        help="target false-positive rates for TPR at low FPR",
    )
    audit.add_argument(
        "--orientation",
        choices=("higher", "lower", "best"),
        default="higher",
        help="threshold attack: higher (default) or lower score = member (a loss), or the "
        "better of the two (optimistic)",
    )
    audit.add_argument("--json", action="store_true", help="print one JSON object")
    audit.add_argument("--threads", type=_threads, default=1, help="torch threads (default 1)")


def _run_audit(args: argparse.Namespace) -> int:
    import json

    import torch

    from privmon.offline import audit_scores, format_audit, load_scores

    torch.set_num_threads(args.threads)
    members, nonmembers = load_scores(args.members), load_scores(args.nonmembers)
    result = audit_scores(
        members,
        nonmembers,
        prior=args.prior,
        delta=args.delta,
        methods=args.methods,
        fpr=args.fpr,
        higher_is_member={"higher": True, "lower": False, "best": None}[args.orientation],
    )
    if args.json:
        print(json.dumps(_finite_json(result), indent=2, allow_nan=False))
    else:
        print(format_audit(result))
    return 0


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
    stderr, a warning line for each skipped part of a line and for the runs left out; returns
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
    """``privmon report LOGDIR... --compare``: prints each run's verdict and the path."""
    from privmon.report import read_runs
    from privmon.report.compare import run_summary, write_comparison_page

    if args.run is not None:
        raise ValueError("--run picks one run to report; --compare reports every run: pass one")
    runs = read_runs(args.logdir)
    path = write_comparison_page(runs, args.logdir, args.out, args.title)
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
