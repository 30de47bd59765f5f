"""GKE: a JobSet (``jobset.x-k8s.io/v1alpha2``) running ``--nodes`` pods of ``jaxtrain.train``.

One replicated job holds one Indexed Job (completions = parallelism = nodes). With
``network.enableDNSHostnames`` the JobSet controller creates a headless service, so pod ``i`` is
reachable as ``<name>-workers-0-<i>.<name>``; pod 0 is the coordinator. Each pod gets
``JAXTRAIN_COORDINATOR_ADDRESS`` and ``JAXTRAIN_NUM_PROCESSES``; its process id is its Job's global
index times the pods per Job plus its completion index (``JOBSET_JOB_GLOBAL_INDEX``,
``JOBSET_PODS_PER_JOB``, ``JOB_COMPLETION_INDEX``: the JobSet row of ``jaxtrain.runtime.job``), so a
JobSet given more replicas or replicated jobs still numbers its pods uniquely. A failed pod fails
its Job (``backoffLimit: 0``) and the JobSet's ``failurePolicy.maxRestarts`` then recreates every
pod: jax.distributed needs all processes to start together, and the run resumes from its latest
checkpoint. Resubmitted with another ``--nodes``, it resumes elastically (``jaxtrain.train.elastic``).
"""
from __future__ import annotations

import argparse
import math
import re

from jaxtrain.errors import LaunchError
from jaxtrain.launch import k8s
from jaxtrain.launch.common import Job, accelerator_count, add_container_args, nonnegative_int
from jaxtrain.runtime.job import COORDINATOR_VAR, JOBSET_VARS, NUM_PROCESSES_VAR

KIND = k8s.Kind("JobSet", "jobset.x-k8s.io", "v1alpha2", "jobsets", "jobset", "the JobSet controller")
GROUP, VERSION, PLURAL = KIND.group, KIND.version, KIND.plural
REPLICATED_JOB = "workers"  # short: it is part of every pod's host name (63 characters at most)
CONTAINER = k8s.CONTAINER
# The JobSet controller annotates every pod with its Job's index over the whole JobSet and the number of Jobs.
JOBSET_ANNOTATIONS = {JOBSET_VARS[0]: "jobset.sigs.k8s.io/job-global-index",
                      JOBSET_VARS[1]: "jobset.sigs.k8s.io/global-replicas"}
_TOPOLOGY = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")


def add_args(parser: argparse.ArgumentParser) -> None:
    """GKE's flags."""
    add_container_args(parser)
    k8s.add_api_args(parser, "gke")
    parser.add_argument("--max-restarts", type=nonnegative_int, default=3,
                        help="JobSet restarts after a failed or preempted pod (default: 3)")
    parser.add_argument("--coordinator-port", type=k8s.port, default=k8s.DEFAULT_COORDINATOR_PORT,
                        help="jax.distributed coordinator port on pod 0 (default: 8476)")


def _accelerators(job: Job, args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """(node selector, resource limits, JobSet annotations) for ``--accelerator``."""
    count = accelerator_count(args)
    kind = args.accelerator or ""
    if args.tpu_topology and not kind.startswith("tpu"):
        raise LaunchError("--tpu-topology: only for a TPU --accelerator (e.g. tpu-v5p-slice)")
    if not kind:
        return {}, {}, {}
    if kind.startswith("nvidia-"):
        return {"cloud.google.com/gke-accelerator": kind}, {"nvidia.com/gpu": count}, {}
    if not kind.startswith("tpu"):
        raise LaunchError(f"--accelerator: expected a GKE accelerator label, nvidia-... (GPU, e.g. nvidia-h100-80gb) "
                          f"or tpu... (TPU, e.g. tpu-v5p-slice), got '{kind}'")
    topology = args.tpu_topology
    if not topology:
        raise LaunchError(f"--tpu-topology: required with --accelerator {kind} (e.g. 2x2x2)")
    if not _TOPOLOGY.match(topology):
        raise LaunchError(f"--tpu-topology: expected AxB or AxBxC, got '{topology}'")
    chips = math.prod(int(n) for n in topology.split("x"))
    if chips != job.nodes * count:
        # GKE would never schedule the pods: a slice's hosts come as a whole node pool.
        raise LaunchError(f"--tpu-topology: {topology} has {chips} chips, but --nodes {job.nodes} x "
                          f"--accelerator-count {count} = {job.nodes * count}")
    selector = {"cloud.google.com/gke-tpu-accelerator": kind, "cloud.google.com/gke-tpu-topology": topology}
    # All hosts of one slice must land in one node pool: JobSet's exclusive placement per node pool.
    annotations = {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    return selector, {"google.com/tpu": count}, annotations


def coordinator_address(job: Job, port: int) -> str:
    """``host:port`` of pod 0 through the JobSet's headless service (subdomain = the JobSet's name)."""
    return f"{job.name}-{REPLICATED_JOB}-0-0.{job.name}:{port}"


def _env(job: Job, port: int) -> list[dict]:
    return k8s.env_list(job, {
        COORDINATOR_VAR: {"value": coordinator_address(job, port)},
        NUM_PROCESSES_VAR: {"value": str(job.nodes)},
        # The process id: these and JOB_COMPLETION_INDEX, which Kubernetes sets in an Indexed Job's pods.
        **{var: {"valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{key}']"}}}
           for var, key in JOBSET_ANNOTATIONS.items()},
        JOBSET_VARS[2]: {"value": str(job.nodes)},  # the pods of each Job (its completions)
    })


def build(job: Job, args: argparse.Namespace) -> dict:
    """The JobSet manifest as a plain dict (what ``--dry-run`` prints as YAML and submission sends as JSON)."""
    k8s.check_names(job, args.namespace, "JobSet", f"{job.name}-{REPLICATED_JOB}-0-{job.nodes - 1}")
    selector, limits, annotations = _accelerators(job, args)
    container: dict = {
        "name": CONTAINER,
        "image": args.image,
        "command": job.train_command()[:3],
        "args": job.train_args(),
        "ports": [{"name": "coordinator", "containerPort": args.coordinator_port}],
        "env": _env(job, args.coordinator_port),
    }
    if limits:
        container["resources"] = {"limits": dict(limits), "requests": dict(limits)}
    pod: dict = {
        "restartPolicy": "Never",
        # jaxtrain saves a checkpoint on SIGTERM within checkpoint.grace_period_s: leave it that long and more.
        "terminationGracePeriodSeconds": k8s.grace_seconds(job),
        "containers": [container],
    }
    if selector:
        pod["nodeSelector"] = selector
    metadata: dict = {"name": job.name, "namespace": args.namespace, "labels": {"app.kubernetes.io/name": "jaxtrain"}}
    if annotations:
        metadata["annotations"] = annotations
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "failurePolicy": {"maxRestarts": args.max_restarts},
            "network": {"enableDNSHostnames": True, "subdomain": job.name},
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {"spec": {
                    "completionMode": "Indexed",
                    "completions": job.nodes,
                    "parallelism": job.nodes,
                    "backoffLimit": 0,  # one failed pod fails the Job; the JobSet then restarts every pod
                    "template": {"spec": pod},
                }},
            }],
        },
    }


def notes(job: Job, args: argparse.Namespace) -> list[str]:
    """Warnings for stderr: a local checkpoint directory cannot survive a JobSet restart."""
    local = job.local_checkpoints()
    if local is None:
        return []
    return [(f"checkpoint.dir is local to the pod ({local}): after a preemption the JobSet restarts on fresh disks "
             f"and training starts again from step 0; set checkpoint.dir=gs://BUCKET/PATH to resume instead")]


render = k8s.render


def submit(spec: dict, job: Job, args: argparse.Namespace) -> str:
    """Creates the JobSet through the API server; returns the line to print. Raises SubmitError."""
    where = k8s.create(KIND, spec, job, args)
    return (f"submitted JobSet {where} ({job.nodes} pods); follow it with: "
            f"kubectl get jobset {job.name} -n {args.namespace}")
