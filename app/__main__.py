"""`python -m app CONFIG.toml [--resume] [--print-config] [--section.key=value ...]` (what ./run.sh runs).

Before any work the config is checked (app.config, then app.preflight for RL and offline jobs): a bad setting, or a
config or TRAJ.jsonl file that cannot be read, prints one `error:` line naming the key or the file and line, and
exits with code 2 (no traceback); a likely mistake prints a `warning:` line and the job goes on. `--section.key=none`
unsets an optional setting; paths given here are relative to the current folder, paths in the file to the file's
folder.

An RL or offline job whose [parallel] degrees need several ranks re-executes itself under torchrun on this node
(app.launch); each rank then runs this same entry point.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from app.config import PLAN_JOB_READS, JobConfig
from app.config_loader import load_config, to_toml
from app.errors import ConfigError, JobError
from app.launch import launch_size, torchrun_command, under_torchrun
from planner.jsonl import TrajectoryFileError

#: Set in the environment of the ranks this entry point relaunches under torchrun: their parent already printed the
#: config's warnings.
WARNED_ENV = "ARBOR_CONFIG_WARNED"


def warns() -> bool:
    """Whether this process prints the config's warnings: once per job, by the process that checked it first (the
    parent of a relaunch, else rank 0)."""
    return os.environ.get("RANK", "0") == "0" and WARNED_ENV not in os.environ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="./run.sh",
        description="Run an Arbor job. Extra arguments --section.key=value override the config file.",
    )
    parser.add_argument("config", help="TOML job config (e.g. configs/demo.toml)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint (checkpoint.resume)")
    argv = sys.argv[1:] if argv is None else argv
    args, overrides = parser.parse_known_args(argv)
    if args.resume:
        overrides = [*overrides, "--checkpoint.resume=true"]
    try:
        config = load_config(JobConfig, args.config, overrides)
        if args.print_config:
            print(to_toml(config), end="")
            return 0
        if config.job.kind == "plan":
            from app.config import ignored_by_plan_job
            from app.plan_report import run_plan_report

            ignored = ignored_by_plan_job(config)
            if ignored:
                print(f"warning: a plan job reads only {', '.join(PLAN_JOB_READS)}; it ignores {', '.join(ignored)}",
                      file=sys.stderr)

            return run_plan_report(config)
        from app.preflight import check_offline_job, check_rl_job

        if config.job.kind == "offline" and warns():
            from app.config import ignored_by_offline_job

            ignored = ignored_by_offline_job(config)
            if ignored:
                print(f"warning: an offline job (objective {config.job.objective!r}) ignores {', '.join(ignored)}",
                      file=sys.stderr)

        relaunch = launch_size(config) > 1 and not under_torchrun()
        command = torchrun_command(config, args.config, [a for a in argv if a != args.config]) if relaunch else None
        for warning in (check_rl_job if config.job.kind == "rl" else check_offline_job)(config):
            if warns():
                print(f"warning: {warning}", file=sys.stderr)
        if command is not None:
            print(f"[arbor] {launch_size(config)} ranks: {' '.join(command)}", file=sys.stderr, flush=True)
            os.environ[WARNED_ENV] = "1"
            os.execv(command[0], command)
        if config.job.kind == "offline":
            from app.offline_job import run_offline

            return run_offline(config)
        from app.rl_job import run_rl

        return run_rl(config)
    except (JobError, TrajectoryFileError) as e:
        # Under torchrun every rank reads the same config: rank 0 reports it.
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return e.exit_code if isinstance(e, JobError) else ConfigError.exit_code


def exit_rank(code: int) -> NoReturn:
    """End a torchrun rank whose job has returned `code` without the interpreter's finalization.

    By then the job has written its checkpoints and exports, closed its writers and destroyed its process groups,
    but FSDP2 modules and device meshes still hold the gloo process groups, so their C++ worker threads would be torn
    down during finalization, when a thread that takes the GIL aborts the process ("terminate called without an
    active exception", exit -6): seen twice in full test-suite runs on a loaded 2-core machine, after jobs that had
    finished. Output streams and logging handlers are flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if under_torchrun():
        exit_rank(code)
    sys.exit(code)
