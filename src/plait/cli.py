"""The ``plait`` command (also ``python -m plait``): ``plait train``, ``plait sample``,
``plait export``, ``plait tokenizer`` and ``plait plan``.

It sits above both: training (:mod:`plait.train.cli`) and the planner
(:mod:`plait.plan.cli`) each bring their own arguments and runners, and the planner gives
``plait train --plan`` its prediction, so that training never imports the planner.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from plait.plan import cli as plan_cli
from plait.plan.train_plan import plan_summary
from plait.train import cli as train_cli
from plait.train.config import TrainConfig

__all__ = ["main"]


def _plan(cfg: TrainConfig) -> str:
    """``plait train --plan``: the planner's summary of ``cfg``, or why there is none."""
    try:
        return plan_summary(cfg)
    except ValueError as err:
        return f"plait train: --plan: no prediction: {err}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plait", description="composable parallelism for PyTorch")
    commands = parser.add_subparsers(dest="command", metavar="{train,sample,export,tokenizer,plan}")
    train_cli.add_parsers(commands, planner=True)
    plan_cli.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``plait`` command on ``argv`` (default: the command line); returns the exit
    status."""
    parser = _parser()
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command is None:
        parser.print_help()
        return 2
    if command == "plan":
        return plan_cli.run(argparse.Namespace(**args))
    return train_cli.run(command, args, planner=_plan)


if __name__ == "__main__":
    sys.exit(main())
