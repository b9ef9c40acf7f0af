"""Command line: ``privmon demo``, ``privmon report``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="privmon", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GAN on the digits under the monitor")
    demo.add_argument("--logdir", default="runs/privmon-demo", help="TensorBoard log directory")
    demo.add_argument("--steps", type=_positive_int, default=3000, help="training steps")
    demo.add_argument("--every", type=_positive_int, default=50, help="steps between checks")
    demo.add_argument("--dp", action="store_true", help="train the discriminator with Opacus")
    demo.add_argument(
        "--epsilon",
        type=float,
        default=3.0,
        help="with --dp: the ε budget Opacus spends over the run (default 3)",
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--budget",
        type=float,
        default=None,
        help="stop when the certified advantage of the discriminator query "
        "stays above this for two checks",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    from privmon.html_report import add_report_arguments

    add_report_arguments(
        sub.add_parser("report", help="write a self-contained HTML privacy report of a run")
    )
    args = parser.parse_args(argv)
    if args.command == "report":
        from privmon.html_report import run_report

        return run_report(args)
    if args.command == "demo":
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
            )
        )
        print(format_summary(summary))
        print(f"\nsummary: {args.logdir}/summary.json\nopen:    tensorboard --logdir {args.logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
