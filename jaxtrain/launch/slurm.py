"""SLURM: an sbatch script whose tasks run ``jaxtrain.train`` under ``srun``.

``srun`` is what makes it one multi-process run: it starts ``--nodes x --ntasks-per-node`` tasks
and gives each the step's environment (``SLURM_STEP_NODELIST``, ``SLURM_PROCID``, ...), from
which ``jax.distributed.initialize()`` finds the coordinator and the process ids by itself. A
plain batch script has no step, so without ``srun`` JAX would see one lone process.
``--kill-on-bad-exit`` ends every task when one fails, instead of leaving the others waiting in a
collective. Submission is ``sbatch --parsable`` with the script on stdin.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess

from jaxtrain.errors import LaunchError, SubmitError
from jaxtrain.launch.common import Job, nonnegative_int, positive_int

_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$")
_SAFE = re.compile(r"^[^\s#'\"\\]+$")  # a value that needs no quoting on an #SBATCH line


def add_args(parser: argparse.ArgumentParser) -> None:
    """SLURM's flags."""
    parser.add_argument("--ntasks-per-node", type=positive_int, default=1,
                        help="processes per node, e.g. one per GPU (default: 1)")
    parser.add_argument("--gpus-per-task", type=nonnegative_int, default=0, help="GPUs per process (default: 0)")
    parser.add_argument("--gpu-type", help="GPU type for --gpus-per-task (TYPE:N), e.g. h100")
    parser.add_argument("--cpus-per-task", type=positive_int, help="CPUs per process (default: SLURM's)")
    parser.add_argument("--partition", help="SLURM partition (default: the cluster's default)")
    parser.add_argument("--time", help="time limit: MINUTES, HH:MM:SS or D-HH:MM:SS (default: the partition's)")
    parser.add_argument("--output", default="jaxtrain-%j.out",
                        help="log file of the job, relative to --chdir; %%j is the job id (default: jaxtrain-%%j.out)")
    parser.add_argument("--chdir", default=os.getcwd(),
                        help="working directory of the job on the shared filesystem (default: here)")
    parser.add_argument("--python", default="python", help="the interpreter on the nodes (default: python)")
    parser.add_argument("--sbatch-arg", action="append", default=[], metavar="OPTION",
                        help="an extra #SBATCH option, e.g. --account=abc (repeatable)")


def _sbatch_value(flag: str, value: str) -> str:
    if not _SAFE.match(value):
        raise LaunchError(f"{flag}: '{value}' contains spaces, quotes or '#', which an #SBATCH line cannot carry")
    return value


def _directives(job: Job, args: argparse.Namespace) -> list[str]:
    if not job.name or not _SAFE.match(job.name):
        raise LaunchError(f"--name: '{job.name}' is not a valid SLURM job name (no spaces, quotes or '#')")
    lines = [f"--job-name={job.name}", f"--nodes={job.nodes}", f"--ntasks-per-node={args.ntasks_per_node}"]
    if args.gpu_type and not args.gpus_per_task:
        raise LaunchError("--gpu-type: needs --gpus-per-task")
    if args.gpus_per_task:
        gpus = f"{_sbatch_value('--gpu-type', args.gpu_type)}:{args.gpus_per_task}" if args.gpu_type \
            else str(args.gpus_per_task)
        lines.append(f"--gpus-per-task={gpus}")
    if args.cpus_per_task:
        lines.append(f"--cpus-per-task={args.cpus_per_task}")
    if args.partition:
        lines.append(f"--partition={_sbatch_value('--partition', args.partition)}")
    if args.time:
        if not _TIME.match(args.time):
            raise LaunchError(f"--time: expected MINUTES, HH:MM:SS or D-HH:MM:SS, got '{args.time}'")
        lines.append(f"--time={args.time}")
    lines.append(f"--output={_sbatch_value('--output', args.output)}")
    lines.append(f"--chdir={_sbatch_value('--chdir', os.path.abspath(args.chdir))}")
    for extra in args.sbatch_arg:
        if not extra.startswith("-"):
            raise LaunchError(f"--sbatch-arg: expected an sbatch option such as --account=abc, got '{extra}'")
        lines.append(_sbatch_value("--sbatch-arg", extra))
    return lines


def build(job: Job, args: argparse.Namespace) -> str:
    """The sbatch script: #SBATCH directives, the --env exports, then ``srun python -m jaxtrain.train ...``."""
    directives = _directives(job, args)
    if not args.container_config and os.path.isfile(args.config):
        # The job starts in --chdir, not here: a relative path to this (shared) file must not change meaning.
        job.config_path = os.path.abspath(args.config)
    lines = ["#!/bin/bash"] + [f"#SBATCH {d}" for d in directives]
    lines += ["# Written by `python -m jaxtrain.launch slurm`. srun starts every task of the step: JAX's own",
              "# SLURM detection (jax.distributed.initialize()) then forms one run of all of them.", "set -eu"]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in job.env.items()]
    srun = ["srun", "--kill-on-bad-exit=1", *job.train_command(args.python)]
    lines.append(" ".join(shlex.quote(part) for part in srun))
    return "\n".join(lines) + "\n"


def notes(job: Job, args: argparse.Namespace) -> list[str]:
    """Nothing to warn about: the job's directories are on the cluster's shared filesystem."""
    return []


def render(script: str) -> str:
    """The script as it is submitted."""
    return script.rstrip("\n")


def submit(script: str, job: Job, args: argparse.Namespace) -> str:
    """Runs ``sbatch --parsable`` with the script on stdin; returns the line to print. Raises SubmitError."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise LaunchError("sbatch not found on PATH: run the slurm launcher on a SLURM login node "
                          "(or print the script with --dry-run)")
    try:
        done = subprocess.run([sbatch, "--parsable"], input=script, capture_output=True, text=True, timeout=120,
                              check=False)
    except subprocess.TimeoutExpired:
        raise SubmitError("sbatch did not answer within 120 s") from None
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        raise SubmitError(f"sbatch failed (exit {done.returncode}): {reason[-1] if reason else 'no message'}")
    job_id = done.stdout.strip().split(";")[0]  # --parsable: "<id>" or "<id>;<cluster>"
    log = os.path.join(os.path.abspath(args.chdir), args.output.replace("%j", job_id).replace("%x", job.name))
    return f"submitted SLURM job {job_id} ({job.nodes} nodes x {args.ntasks_per_node} tasks); log: {log}"
