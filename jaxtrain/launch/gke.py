"""GKE: a JobSet (``jobset.x-k8s.io/v1alpha2``) running ``--nodes`` pods of ``jaxtrain.train``.

One replicated job holds one Indexed Job (completions = parallelism = nodes). With
``network.enableDNSHostnames`` the JobSet controller creates a headless service, so pod ``i`` is
reachable as ``<name>-workers-0-<i>.<name>``; pod 0 is the coordinator. Each pod gets
``JAXTRAIN_COORDINATOR_ADDRESS`` and ``JAXTRAIN_NUM_PROCESSES``; its process id is the Job's
completion index (``JOB_COMPLETION_INDEX``, and ``JAXTRAIN_PROCESS_ID`` from the same pod
annotation). A failed pod fails its Job (``backoffLimit: 0``) and the JobSet's
``failurePolicy.maxRestarts`` then recreates every pod: jax.distributed needs all processes to
start together, and the run resumes from its latest checkpoint.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re

import yaml

from jaxtrain.errors import LaunchError, SubmitError
from jaxtrain.launch.common import (
    Job,
    accelerator_count,
    add_container_args,
    connection_reason,
    nonnegative_int,
    require,
)
from jaxtrain.runtime.job import COORDINATOR_VAR, NUM_PROCESSES_VAR, PROCESS_ID_VAR

GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
REPLICATED_JOB = "workers"  # short: it is part of every pod's host name (63 characters at most)
CONTAINER = "jaxtrain"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_TOPOLOGY = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")


def _port(text: str) -> int:
    value = nonnegative_int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {value}")
    return value


def add_args(parser: argparse.ArgumentParser) -> None:
    """GKE's flags."""
    add_container_args(parser)
    parser.add_argument("--namespace", default="default", help="Kubernetes namespace (default: default)")
    parser.add_argument("--max-restarts", type=nonnegative_int, default=3,
                        help="JobSet restarts after a failed or preempted pod (default: 3)")
    parser.add_argument("--coordinator-port", type=_port, default=8476,
                        help="jax.distributed coordinator port on pod 0 (default: 8476)")
    parser.add_argument("--k8s-host", default=os.environ.get("JAXTRAIN_K8S_HOST"), metavar="URL",
                        help="API server URL used without credentials, e.g. a local stand-in "
                             "(default: $JAXTRAIN_K8S_HOST, else the kube config, else in-cluster)")
    parser.add_argument("--context", help="kube config context (default: the current one)")


def _check_names(job: Job, namespace: str) -> None:
    if not _DNS1035.match(job.name):
        raise LaunchError(f"--name: '{job.name}' is not a valid JobSet name (lower-case letters, digits and "
                          f"'-', starting with a letter and ending with a letter or digit)")
    last_host = f"{job.name}-{REPLICATED_JOB}-0-{job.nodes - 1}"
    if len(last_host) > 63:  # a pod host name is one DNS label
        raise LaunchError(f"--name: '{job.name}' is too long: pod host name '{last_host}' has {len(last_host)} "
                          f"characters (at most 63)")
    if len(namespace) > 63 or not _DNS1123.match(namespace):
        raise LaunchError(f"--namespace: '{namespace}' is not a valid namespace name")


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
    env: dict[str, dict] = {
        COORDINATOR_VAR: {"value": coordinator_address(job, port)},
        NUM_PROCESSES_VAR: {"value": str(job.nodes)},
        # The same number as JOB_COMPLETION_INDEX, which Kubernetes sets itself; either is read.
        PROCESS_ID_VAR: {"valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}},
    }
    env.update({key: {"value": value} for key, value in job.env.items()})  # --env wins over ours
    return [{"name": key, **entry} for key, entry in env.items()]


def build(job: Job, args: argparse.Namespace) -> dict:
    """The JobSet manifest as a plain dict (what ``--dry-run`` prints as YAML and submission sends as JSON)."""
    _check_names(job, args.namespace)
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
        "terminationGracePeriodSeconds": math.ceil(job.cfg.checkpoint.grace_period_s) + 30,
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


def render(spec: dict) -> str:
    """The manifest as YAML (``kubectl apply -f`` takes it as it is)."""
    return yaml.safe_dump(spec, sort_keys=False, default_flow_style=False).rstrip("\n")


def _api_client(args: argparse.Namespace):
    client = require("kubernetes.client", "gke", "kubernetes")
    if args.k8s_host:
        conf = client.Configuration()
        conf.host = args.k8s_host.rstrip("/")
        return client.ApiClient(conf)
    config = require("kubernetes.config", "gke", "kubernetes")
    try:
        return config.new_client_from_config(context=args.context)
    except (config.ConfigException, OSError) as kube_err:
        if args.context:
            raise LaunchError(f"--context: {kube_err}") from None
        try:
            config.load_incluster_config()
            return client.ApiClient()
        except config.ConfigException:
            raise LaunchError(f"no Kubernetes credentials ({kube_err}): run `gcloud container clusters "
                              f"get-credentials CLUSTER` or pass --k8s-host") from None


def _reason(body) -> str:
    """The ``message`` of a Kubernetes Status body, else the body's start."""
    try:
        return json.loads(body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(body or "")[:300]


def submit(spec: dict, job: Job, args: argparse.Namespace) -> str:
    """Creates the JobSet through the API server; returns the line to print. Raises SubmitError."""
    client = require("kubernetes.client", "gke", "kubernetes")
    import urllib3  # the kubernetes client's HTTP library
    api = client.CustomObjectsApi(_api_client(args))
    where = f"{args.namespace}/{job.name}"
    try:
        # Strict: a field the server does not know is an error, not silently dropped.
        api.create_namespaced_custom_object(GROUP, VERSION, args.namespace, PLURAL, spec,
                                            field_validation="Strict", _request_timeout=60)
    except client.ApiException as err:
        hint = {404: " (is the JobSet controller installed in the cluster?)",
                409: f" (delete it with `kubectl delete jobset {job.name} -n {args.namespace}` or pass --name)"}
        raise SubmitError(f"the Kubernetes API refused JobSet {where}: HTTP {err.status} {err.reason}: "
                          f"{_reason(err.body)}{hint.get(err.status, '')}") from None
    except (urllib3.exceptions.HTTPError, OSError) as err:
        host = api.api_client.configuration.host
        raise SubmitError(f"cannot reach the Kubernetes API server at {host}: {connection_reason(err)}") from None
    return (f"submitted JobSet {where} ({job.nodes} pods); follow it with: "
            f"kubectl get jobset {job.name} -n {args.namespace}")
