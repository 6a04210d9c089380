"""`python -m planner COMMAND ...`: command-line tools over TRAJ.jsonl files (see planner/jsonl.py)."""

from __future__ import annotations

import argparse
import importlib
import sys

from planner.jsonl import TrajectoryFileError

#: Each command is a module in planner/commands/ with `add_arguments(parser)` and `run(args) -> int`.
COMMANDS = ("stats", "calls", "batches")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planner", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = {}
    for name in COMMANDS:
        module = importlib.import_module(f"planner.commands.{name}")
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__))
    args = parser.parse_args(argv)
    try:
        return modules[args.command].run(args)
    except (TrajectoryFileError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
