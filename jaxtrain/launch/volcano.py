"""Volcano: a ``batch.volcano.sh/v1alpha1`` Job of ``--nodes`` pods running ``jaxtrain.train``,
gang-scheduled (``minAvailable`` = nodes: all pods start together or none).

The ``svc`` plugin gives every pod a host name (``<job>-worker-<i>.<job>``) and the variables
``VC_WORKER_HOSTS`` / ``VC_WORKER_NUM``; the ``env`` plugin gives ``VC_TASK_INDEX`` (and the older
``VK_TASK_INDEX``). jaxtrain takes its process id from the index and the coordinator from task 0's
host name (the Volcano row of ``jaxtrain.runtime.job``), at ``JAX_COORDINATOR_PORT``.

Restarts: a failed or evicted (preempted) pod restarts the whole job (``RestartJob``), at most
``--max-restarts`` times (``maxRetry``), and the run resumes from its latest checkpoint; exit 2
(bad input) and 3 (diverged) end it (``TerminateJob``), since a restart cannot help. Scaled to
another number of replicas (``vcctl``/``kubectl`` editing the task's replicas), the restarted pods
read the new count and the run resumes elastically (``jaxtrain.train.elastic``).
"""
from __future__ import annotations

import argparse

from jaxtrain.errors import NO_RETRY_EXITS, LaunchError
from jaxtrain.launch import k8s
from jaxtrain.launch.common import Job, nonnegative_int
from jaxtrain.runtime.job import PORT_VAR

KIND = k8s.Kind("Job", "batch.volcano.sh", "v1alpha1", "jobs", "vcjob", "Volcano")
TASK = "worker"  # part of every pod's host name: short


def add_args(parser: argparse.ArgumentParser) -> None:
    """Volcano's flags."""
    k8s.add_pod_args(parser)
    k8s.add_api_args(parser, "volcano")
    parser.add_argument("--coordinator-port", type=k8s.port, default=k8s.DEFAULT_COORDINATOR_PORT,
                        help=f"jax.distributed coordinator port on pod 0 (default: {k8s.DEFAULT_COORDINATOR_PORT})")
    parser.add_argument("--queue", default="default", help="Volcano queue (default: default)")
    parser.add_argument("--max-restarts", type=nonnegative_int, default=3,
                        help="job restarts after a failed or evicted pod (maxRetry) (default: 3)")
    parser.add_argument("--priority-class", help="the pods' PriorityClass (default: none)")


def _policies() -> list[dict]:
    """Exit codes first (Volcano matches them before events): bad input and divergence end the job."""
    policies = [{"exitCode": code, "action": "TerminateJob"} for code in NO_RETRY_EXITS]
    policies += [{"event": "PodEvicted", "action": "RestartJob"},  # preempted: every pod again, then resume
                 {"event": "PodFailed", "action": "RestartJob"},  # jax.distributed needs all processes anew
                 {"event": "TaskCompleted", "action": "CompleteJob"}]
    return policies


def _pod(job: Job, args: argparse.Namespace) -> dict:
    limits = k8s.resources(args)
    container: dict = {
        "name": k8s.CONTAINER,
        "image": args.image,
        "command": job.train_command()[:3],
        "args": job.train_args(),
        "ports": [{"name": "coordinator", "containerPort": args.coordinator_port}],
        "env": k8s.env_list(job, {PORT_VAR: {"value": str(args.coordinator_port)}}),
    }
    if limits:
        container["resources"] = {"limits": dict(limits), "requests": dict(limits)}
    pod: dict = {"restartPolicy": "Never", "terminationGracePeriodSeconds": k8s.grace_seconds(job),
                 "containers": [container]}
    selector = k8s.node_selector(args)
    if selector:
        pod["nodeSelector"] = selector
    if args.priority_class:
        pod["priorityClassName"] = args.priority_class
    return {"metadata": {"labels": {"app.kubernetes.io/name": "jaxtrain"}}, "spec": pod}


def build(job: Job, args: argparse.Namespace) -> dict:
    """The Volcano Job manifest as a plain dict (``--dry-run`` prints it as YAML; submission sends it as JSON)."""
    k8s.check_names(job, args.namespace, "Volcano Job", f"{job.name}-{TASK}-{job.nodes - 1}")
    if not k8s.DNS1123.match(args.queue):
        raise LaunchError(f"--queue: '{args.queue}' is not a valid Volcano queue name")
    return {
        "apiVersion": f"{KIND.group}/{KIND.version}",
        "kind": KIND.kind,
        "metadata": {"name": job.name, "namespace": args.namespace, "labels": {"app.kubernetes.io/name": "jaxtrain"}},
        "spec": {
            "schedulerName": "volcano",
            "queue": args.queue,
            "minAvailable": job.nodes,  # the gang: jax.distributed waits for every process
            "maxRetry": args.max_restarts,
            "plugins": {"svc": [], "env": []},
            "policies": _policies(),
            "tasks": [{"name": TASK, "replicas": job.nodes, "minAvailable": job.nodes, "template": _pod(job, args)}],
        },
    }


def notes(job: Job, args: argparse.Namespace) -> list[str]:
    """Warnings for stderr: a local checkpoint directory does not survive a restart."""
    return k8s.local_checkpoint_notes(job)


render = k8s.render


def submit(spec: dict, job: Job, args: argparse.Namespace) -> str:
    """Creates the Volcano Job through the API server; returns the line to print. Raises SubmitError."""
    where = k8s.create(KIND, spec, job, args)
    return (f"submitted Volcano Job {where} ({job.nodes} pods, queue {args.queue}); follow it with: "
            f"kubectl get vcjob {job.name} -n {args.namespace}")
