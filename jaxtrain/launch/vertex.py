"""Vertex AI: a CustomJob running ``--nodes`` replicas of ``jaxtrain.train``.

The job is built from ``google.cloud.aiplatform_v1`` types, so a misspelled field or an unknown
accelerator fails here, not at the API. Worker pool 0 is the chief (one replica), worker pool 1
the other ``nodes - 1`` replicas, all on the same machine spec. Vertex sets ``CLUSTER_SPEC`` in
every container, from which jaxtrain takes the coordinator (pool 0's host) and its process id
(pool 0 -> 0, pool 1 replica i -> 1 + i). ``restart_job_on_worker_restart`` restarts every
replica when one restarts: jax.distributed needs all processes to start together.
"""
from __future__ import annotations

import argparse
import re

from jaxtrain.errors import LaunchError, SubmitError
from jaxtrain.launch.common import Job, accelerator_count, add_container_args, connection_reason, require

_REGION = re.compile(r"^[a-z]+(-[a-z0-9]+)+$")


def add_args(parser: argparse.ArgumentParser) -> None:
    """Vertex AI's flags."""
    add_container_args(parser)
    parser.add_argument("--project", required=True, help="Google Cloud project id")
    parser.add_argument("--region", default="us-central1", help="Vertex AI region (default: us-central1)")
    parser.add_argument("--machine-type", required=True,
                        help="Compute Engine machine type per replica, e.g. a3-highgpu-8g, n1-standard-8")
    parser.add_argument("--service-account", help="service account the job runs as (default: Vertex's)")
    parser.add_argument("--vertex-endpoint", metavar="HOST_OR_URL",
                        help="API endpoint (default: <region>-aiplatform.googleapis.com); an http:// URL, "
                             "e.g. a local stand-in, is called with anonymous credentials")


def _aip():
    return require("google.cloud.aiplatform_v1", "vertex", "google-cloud-aiplatform")


def _machine(aip, job: Job, args: argparse.Namespace):
    count = accelerator_count(args)
    machine = aip.MachineSpec(machine_type=args.machine_type)
    if args.accelerator:
        known = [a.name for a in aip.AcceleratorType if a.name != "ACCELERATOR_TYPE_UNSPECIFIED"]
        if args.accelerator not in known:
            raise LaunchError(f"--accelerator: unknown Vertex AI accelerator '{args.accelerator}' "
                              f"(known: {', '.join(known)})")
        machine.accelerator_type = aip.AcceleratorType[args.accelerator]
        machine.accelerator_count = count
    if args.tpu_topology:
        if not (args.accelerator or "").startswith("TPU_"):
            raise LaunchError("--tpu-topology: only for a TPU --accelerator (e.g. TPU_V5_LITEPOD)")
        machine.tpu_topology = args.tpu_topology
    return machine


def build(job: Job, args: argparse.Namespace):
    """The ``aiplatform_v1.CustomJob`` (chief pool, then the worker pool when ``--nodes`` > 1)."""
    if not _REGION.match(args.region):
        raise LaunchError(f"--region: expected a region such as us-central1, got '{args.region}'")
    if not args.project or "/" in args.project:
        raise LaunchError(f"--project: expected a project id, got '{args.project}'")
    if not job.name or len(job.name) > 128:
        raise LaunchError(f"--name: a Vertex AI display name has 1 to 128 characters, got {len(job.name)}")
    aip = _aip()
    machine = _machine(aip, job, args)
    container = aip.ContainerSpec(image_uri=args.image, command=job.train_command()[:3], args=job.train_args(),
                                  env=[aip.EnvVar(name=k, value=v) for k, v in job.env.items()])
    pools = [aip.WorkerPoolSpec(machine_spec=machine, replica_count=1, container_spec=container)]
    if job.nodes > 1:
        pools.append(aip.WorkerPoolSpec(machine_spec=machine, replica_count=job.nodes - 1, container_spec=container))
    spec = aip.CustomJobSpec(worker_pool_specs=pools,
                             scheduling=aip.Scheduling(restart_job_on_worker_restart=True))
    if args.service_account:
        spec.service_account = args.service_account
    return aip.CustomJob(display_name=job.name, job_spec=spec)


def notes(job: Job, args: argparse.Namespace) -> list[str]:
    """Warnings for stderr: a local checkpoint directory does not survive a restart of the replicas."""
    local = job.local_checkpoints()
    if local is None:
        return []
    return [(f"checkpoint.dir is local to each replica ({local}): a restarted job starts again from step 0; "
             f"set checkpoint.dir=gs://BUCKET/PATH to resume instead")]


def render(custom_job) -> str:
    """The CustomJob as the REST API's JSON (camelCase, enum names, int64 as strings, defaults left out)."""
    from google.protobuf import json_format
    return json_format.MessageToJson(type(custom_job).pb(custom_job), indent=2)


def _endpoint(args: argparse.Namespace) -> str:
    return args.vertex_endpoint or f"{args.region}-aiplatform.googleapis.com"


def _credentials(endpoint: str):
    """Anonymous for a plain-http endpoint (never send real tokens unencrypted); else the default ones."""
    if endpoint.startswith("http://"):
        from google.auth.credentials import AnonymousCredentials
        return AnonymousCredentials()
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError
    try:
        credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    except DefaultCredentialsError:
        raise LaunchError("no Google Cloud credentials: run `gcloud auth application-default login`") from None
    return credentials


def _reason(err) -> str:
    """``HTTP 403 PERMISSION_DENIED: <message>`` from the API's error body (api_core's message repeats the URL)."""
    code = f"HTTP {int(err.code)}" if getattr(err, "code", None) else "error"
    try:
        error = err.response.json()["error"]
        return f"{code} {error.get('status', '')}: {error['message']}".replace(" :", ":")
    except (AttributeError, TypeError, ValueError, KeyError):  # no JSON error body: api_core's own message
        return f"{code}: {err.message}"


def submit(custom_job, job: Job, args: argparse.Namespace) -> str:
    """Creates the CustomJob; returns the line to print. Raises SubmitError for an API failure."""
    aip = _aip()
    from google.api_core import exceptions as api_errors
    endpoint = _endpoint(args)
    client = aip.JobServiceClient(transport="rest", client_options={"api_endpoint": endpoint},
                                  credentials=_credentials(endpoint))
    parent = f"projects/{args.project}/locations/{args.region}"
    try:
        created = client.create_custom_job(parent=parent, custom_job=custom_job, timeout=60)
    except api_errors.GoogleAPICallError as err:
        raise SubmitError(f"Vertex AI refused CustomJob '{job.name}' in {parent}: {_reason(err)}") from None
    except (api_errors.RetryError, OSError) as err:  # requests' connection errors are OSErrors
        raise SubmitError(f"cannot reach Vertex AI at {endpoint}: {connection_reason(err)}") from None
    return (f"submitted CustomJob {created.name} ({job.nodes} replicas); "
            f"follow it with: gcloud ai custom-jobs describe {created.name}")
