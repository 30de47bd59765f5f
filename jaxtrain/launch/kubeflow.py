"""Kubeflow Trainer: a ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``) of ``--nodes`` nodes running
``jaxtrain.train`` on the ``jax-distributed`` ClusterTrainingRuntime (``--runtime``).

The runtime's JAX plugin (``mlPolicy.jax``) sets ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``
and ``JAX_PROCESS_ID`` in every node's container, which jaxtrain reads (the Kubeflow row of
``jaxtrain.runtime.job``). Node selectors and the termination grace period go in a
``runtimePatches`` entry on the runtime's replicated job ``node``; resources per node in
``trainer.resourcesPerNode``. Restarts are the runtime's (its JobSet failure policy): the upstream
``jax-distributed`` runtime has none, so a failed node fails the TrainJob; resubmitting resumes from
the latest checkpoint, on any number of nodes (``jaxtrain.train.elastic``).
"""
from __future__ import annotations

import argparse

from jaxtrain.errors import LaunchError
from jaxtrain.launch import k8s
from jaxtrain.launch.common import Job

KIND = k8s.Kind("TrainJob", "trainer.kubeflow.org", "v1alpha1", "trainjobs", "trainjob", "Kubeflow Trainer")
RUNTIME_JOB = "node"  # the replicated job (and container) of the upstream jax-distributed runtime
PATCH_MANAGER = "jaxtrain.launch"  # who owns the runtimePatches entry


def add_args(parser: argparse.ArgumentParser) -> None:
    """Kubeflow's flags."""
    k8s.add_pod_args(parser)
    k8s.add_api_args(parser, "kubeflow")
    parser.add_argument("--runtime", default="jax-distributed",
                        help="the ClusterTrainingRuntime with mlPolicy.jax (default: jax-distributed)")


def _patch(job: Job, selector: dict) -> dict:
    """A runtimePatches entry: what the TrainJob's own fields cannot say, on the runtime's pods."""
    pod = {"terminationGracePeriodSeconds": k8s.grace_seconds(job)}
    if selector:
        pod["nodeSelector"] = selector
    return {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": RUNTIME_JOB, "template": {"spec": {"template": {"spec": pod}}}}]}}}}


def build(job: Job, args: argparse.Namespace) -> dict:
    """The TrainJob manifest as a plain dict (``--dry-run`` prints it as YAML; submission sends it as JSON)."""
    # Pods are <name>-<replicated job>-0-<index>: one DNS label.
    k8s.check_names(job, args.namespace, "TrainJob", f"{job.name}-{RUNTIME_JOB}-0-{job.nodes - 1}")
    if not k8s.DNS1123.match(args.runtime):
        raise LaunchError(f"--runtime: '{args.runtime}' is not a valid ClusterTrainingRuntime name")
    limits = k8s.resources(args)
    trainer: dict = {
        "image": args.image,
        "command": job.train_command()[:3],
        "args": job.train_args(),
        "numNodes": job.nodes,
    }
    if job.env:
        trainer["env"] = k8s.env_list(job, {})
    if limits:
        trainer["resourcesPerNode"] = {"limits": dict(limits), "requests": dict(limits)}
    return {
        "apiVersion": f"{KIND.group}/{KIND.version}",
        "kind": KIND.kind,
        "metadata": {"name": job.name, "namespace": args.namespace, "labels": {"app.kubernetes.io/name": "jaxtrain"}},
        "spec": {
            "runtimeRef": {"apiGroup": KIND.group, "kind": "ClusterTrainingRuntime", "name": args.runtime},
            "trainer": trainer,
            "runtimePatches": [_patch(job, k8s.node_selector(args))],
        },
    }


def notes(job: Job, args: argparse.Namespace) -> list[str]:
    """Warnings for stderr: a local checkpoint directory does not survive a resubmission."""
    return k8s.local_checkpoint_notes(job)


render = k8s.render


def submit(spec: dict, job: Job, args: argparse.Namespace) -> str:
    """Creates the TrainJob through the API server; returns the line to print. Raises SubmitError."""
    where = k8s.create(KIND, spec, job, args)
    return (f"submitted TrainJob {where} ({job.nodes} nodes, runtime {args.runtime}); follow it with: "
            f"kubectl get trainjob {job.name} -n {args.namespace}")
