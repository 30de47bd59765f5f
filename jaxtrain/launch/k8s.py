"""What the Kubernetes targets share (``gke``, ``kubeflow``, ``volcano``): the API connection, names,
pod resources and node selectors, the coordinator port, and submission through the official
``kubernetes`` client's custom objects API (``fieldValidation=Strict``: a field the server does
not know is an error, not silently dropped)."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import dataclass

import yaml

from jaxtrain.errors import LaunchError, SubmitError
from jaxtrain.launch.common import Job, connection_reason, positive_int, require

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# A resource quantity as the CRDs spell it (e.g. 8, 500m, 64Gi).
QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?"
                      r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
_QUALIFIED = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
DEFAULT_COORDINATOR_PORT = 8476
CONTAINER = "jaxtrain"


@dataclass(frozen=True)
class Kind:
    """A custom resource kind as the API serves it, and what to say when the API refuses it."""

    kind: str
    group: str
    version: str
    plural: str
    short: str  # kubectl's name for it (kubectl get <short> NAME)
    controller: str  # what a 404 most likely means is missing


def port(text: str) -> int:
    """argparse type: a TCP port."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if not 1 <= value <= 65535:  # one message for 0 and for a negative port
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {value}")
    return value


def add_api_args(parser: argparse.ArgumentParser, target: str) -> None:
    """Where to submit: namespace, API server, kube config context."""
    parser.add_argument("--namespace", default="default", help="Kubernetes namespace (default: default)")
    parser.add_argument("--k8s-host", default=os.environ.get("JAXTRAIN_K8S_HOST"), metavar="URL",
                        help="API server URL used without credentials, e.g. a local stand-in "
                             "(default: $JAXTRAIN_K8S_HOST, else the kube config, else in-cluster)")
    parser.add_argument("--context", help="kube config context (default: the current one)")


def add_pod_args(parser: argparse.ArgumentParser) -> None:
    """A pod's image, resources and node selectors (Kubeflow, Volcano; GKE has its own accelerator flags)."""
    parser.add_argument("--image", required=True, help="container image with jaxtrain installed")
    parser.add_argument("--gpus", type=positive_int, help="nvidia.com/gpu per node")
    parser.add_argument("--resource", action="append", default=[], metavar="NAME=QUANTITY",
                        help="a resource per node, e.g. google.com/tpu=4, cpu=8, memory=64Gi (repeatable)")
    parser.add_argument("--node-selector", action="append", default=[], metavar="LABEL=VALUE",
                        help="a node label the pods need, e.g. cloud.google.com/gke-accelerator=nvidia-h100-80gb "
                             "(repeatable)")


def resources(args: argparse.Namespace) -> dict:
    """``{name: quantity}`` from --gpus and --resource; a bad item is a LaunchError naming it."""
    out: dict = {"nvidia.com/gpu": args.gpus} if args.gpus else {}
    for name, quantity in parse_env_like("--resource", args.resource).items():
        if not _QUALIFIED.match(name) or not QUANTITY.match(quantity):
            raise LaunchError(f"--resource: expected NAME=QUANTITY such as google.com/tpu=4 or memory=64Gi, "
                              f"got '{name}={quantity}'")
        if quantity.startswith("-") or not re.search(r"[1-9]", quantity.split("e")[0].split("E")[0]):
            # the API server refuses a negative limit only at submission; a zero one asks for nothing
            raise LaunchError(f"--resource: {name} must be more than 0, got '{quantity}' (leave out what a pod "
                              f"does not need)")
        if "/" in name and not quantity.isdigit():  # an extended resource (a device plugin's): whole units only
            raise LaunchError(f"--resource: {name} is a device plugin's resource, counted in whole units; got "
                              f"'{quantity}'")
        if name == "nvidia.com/gpu" and args.gpus:  # the job's device count is read from one of them
            raise LaunchError(f"--resource: nvidia.com/gpu={quantity} and --gpus {args.gpus} both set the GPUs per "
                              f"node; give one")
        out[name] = int(quantity) if quantity.isdigit() else quantity
    return out


def node_selector(args: argparse.Namespace) -> dict:
    """``{label: value}`` from --node-selector; a bad item is a LaunchError naming it."""
    out = parse_env_like("--node-selector", args.node_selector)
    for key, value in out.items():
        if not _QUALIFIED.match(key) or (value and not re.match(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", value)):
            raise LaunchError(f"--node-selector: expected LABEL=VALUE with a Kubernetes label, got '{key}={value}'")
    return out


def parse_env_like(flag: str, items: list[str]) -> dict:
    """``['KEY=VALUE', ...]`` -> dict, any KEY; an item without '=' is a LaunchError naming ``flag``."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise LaunchError(f"{flag}: expected KEY=VALUE, got '{item}'")
        out[key] = value
    return out


def check_names(job: Job, namespace: str, what: str, last_host: str) -> None:
    """The object's name (a DNS-1035 label: it names a headless service), the longest pod host name
    (one DNS label, 63 characters) and the namespace. Raises LaunchError naming the flag."""
    if not DNS1035.match(job.name):
        raise LaunchError(f"--name: '{job.name}' is not a valid {what} name (lower-case letters, digits and "
                          f"'-', starting with a letter and ending with a letter or digit)")
    if len(last_host) > 63:
        raise LaunchError(f"--name: '{job.name}' is too long: pod host name '{last_host}' has {len(last_host)} "
                          f"characters (at most 63)")
    if len(namespace) > 63 or not DNS1123.match(namespace):
        raise LaunchError(f"--namespace: '{namespace}' is not a valid namespace name")


def env_list(job: Job, ours: dict[str, dict]) -> list[dict]:
    """A container's ``env``: ``ours`` (name -> value or valueFrom), then ``--env`` (which wins)."""
    env = dict(ours)
    env.update({key: {"value": value} for key, value in job.env.items()})
    return [{"name": key, **entry} for key, entry in env.items()]


def grace_seconds(job: Job) -> int:
    """A pod's termination grace period: jaxtrain saves on SIGTERM within checkpoint.grace_period_s; more."""
    return math.ceil(job.cfg.checkpoint.grace_period_s) + 30


def local_checkpoint_notes(job: Job) -> list[str]:
    """A note for stderr when checkpoints would be on the pod's own disk (gone after a restart)."""
    local = job.local_checkpoints()
    if local is None:
        return []
    return [(f"checkpoint.dir is local to the pod ({local}): a restarted pod starts on a fresh disk and training "
             f"starts again from step 0; set checkpoint.dir=gs://BUCKET/PATH (or s3://) to resume instead")]


def render(spec: dict) -> str:
    """The manifest as YAML (``kubectl apply -f`` takes it as it is)."""
    return yaml.safe_dump(spec, sort_keys=False, default_flow_style=False).rstrip("\n")


def api_client(args: argparse.Namespace, target: str):
    """An ApiClient: --k8s-host without credentials, else the kube config (--context), else in-cluster."""
    client = require("kubernetes.client", target, "kubernetes")
    if args.k8s_host:
        conf = client.Configuration()
        conf.host = args.k8s_host.rstrip("/")
        return client.ApiClient(conf)
    config = require("kubernetes.config", target, "kubernetes")
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
                              f"get-credentials CLUSTER` (or point KUBECONFIG at the cluster) or pass "
                              f"--k8s-host") from None


def _reason(body) -> str:
    """The ``message`` of a Kubernetes Status body, else the body's start."""
    try:
        return json.loads(body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(body or "")[:300]


def create(kind: Kind, spec: dict, job: Job, args: argparse.Namespace) -> str:
    """Creates ``spec`` through the API server; returns ``NAMESPACE/NAME``.

    Raises:
      SubmitError: the API refused it (HTTP status and the server's message), or is unreachable.
    """
    client = require("kubernetes.client", job.target, "kubernetes")
    import urllib3  # the kubernetes client's HTTP library
    api = client.CustomObjectsApi(api_client(args, job.target))
    where = f"{args.namespace}/{job.name}"
    try:
        api.create_namespaced_custom_object(kind.group, kind.version, args.namespace, kind.plural, spec,
                                            field_validation="Strict", _request_timeout=60)
    except client.ApiException as err:
        hint = {404: f" (is {kind.controller} installed in the cluster?)",
                409: f" (delete it with `kubectl delete {kind.short} {job.name} -n {args.namespace}` or pass --name)"}
        raise SubmitError(f"the Kubernetes API refused {kind.kind} {where}: HTTP {err.status} {err.reason}: "
                          f"{_reason(err.body)}{hint.get(err.status, '')}") from None
    except (urllib3.exceptions.HTTPError, OSError) as err:
        host = api.api_client.configuration.host
        raise SubmitError(f"cannot reach the Kubernetes API server at {host}: {connection_reason(err)}") from None
    return where
