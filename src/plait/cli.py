"""The ``plait`` command (also ``python -m plait``): ``plait train``, ``plait sample``,
``plait export``, ``plait tokenizer`` and ``plait plan``.

It sits above both: training (:mod:`plait.train.cli`) and the planner
(:mod:`plait.plan.cli`) each bring their own arguments and runners, and the planner gives
``plait train --plan`` its prediction, so that training never imports the planner.
``plait plan`` goes to the planner alone, without training's parsers: the planner's cost
model imports no torch, and neither does the command on that path.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from plait.plan import cli as plan_cli
from plait.train.cores import freeze_at_exit

if TYPE_CHECKING:
    from plait.train.config import TrainConfig

__all__ = ["main"]


def _plan(cfg: TrainConfig) -> str:
    """``plait train --plan``: the planner's summary of ``cfg``, or why there is none."""
    from plait.plan.train_plan import plan_summary

    try:
        return plan_summary(cfg)
    except ValueError as err:
        return f"plait train: --plan: no prediction: {err}"


def _plan_check(cfg: TrainConfig, step_times: list[float]) -> str:
    """``plait train --plan`` after the run: the prediction beside what it measured."""
    from plait.plan.train_plan import plan_versus_run

    try:
        return plan_versus_run(cfg, step_times)
    except ValueError as err:
        return f"plait train: --plan: no comparison: {err}"


def _parser() -> argparse.ArgumentParser:
    from plait.train import cli as train_cli  # here: training's commands import torch

    parser = argparse.ArgumentParser(prog="plait", description="composable parallelism for PyTorch")
    commands = parser.add_subparsers(dest="command", metavar="{train,sample,export,tokenizer,plan}")
    train_cli.add_parsers(commands, planner=True)
    plan_cli.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``plait`` command on ``argv`` (default: the command line); returns the exit
    status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    freeze_at_exit()
    if argv[:1] == ["plan"]:
        return plan_cli.main(argv[1:])  # the same parser and runner, without training's
    parser = _parser()
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command is None:
        parser.print_help()
        return 2
    if command == "plan":
        return plan_cli.run(argparse.Namespace(**args))
    from plait.train import cli as train_cli

    return train_cli.run(command, args, planner=_plan, plan_check=_plan_check)


if __name__ == "__main__":
    sys.exit(main())
