"""Helpers of the launcher tests: running ``python -m jaxtrain.launch`` (in this process or as a
subprocess) and a local HTTP server standing in for the Kubernetes / Vertex AI API."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import parse_qs, urlsplit

import portpicker

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("JAXTRAIN_SHARED", REPO.parent / "shared"))
# A path from any working directory; it loads without its data (the config checks never open data.path).
CONFIG = str(Path(__file__).with_name("shakespeare_char.yaml"))
# The same file for the pod targets, which refuse an absolute path of this machine without --container-config:
# relative to the repository root, where launch() and launch_cli() run.
POD_CONFIG = str(Path(CONFIG).relative_to(REPO))


def launch(capsys, *argv: str) -> tuple[int, str, str]:
    """Runs the launcher in this process; returns (exit code, stdout, stderr)."""
    from jaxtrain.launch import main
    capsys.readouterr()
    here = os.getcwd()
    os.chdir(REPO)  # POD_CONFIG is relative to it
    try:
        code = main(list(argv))
    finally:
        os.chdir(here)
    out, err = capsys.readouterr()
    return code, out, err


def launch_cli(*argv: str, prelude: str = "", env: Optional[dict] = None,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs ``python -m jaxtrain.launch ARGV`` as a subprocess from the repo root.

    ``prelude`` is Python run first in that process (e.g. to make a client library unimportable).
    """
    if prelude:
        code = f"{prelude}\nimport sys\nfrom jaxtrain.launch import main\nsys.exit(main())"
        cmd = [sys.executable, "-c", code, *argv]
    else:
        cmd = [sys.executable, "-m", "jaxtrain.launch", *argv]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


@dataclass
class Request:
    """One request the stub received."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


class StubServer:
    """An HTTP server on 127.0.0.1 (a free port) recording every request and answering each with
    ``respond(request) -> (status, JSON body)``; the default echoes the request body with 201."""

    def __init__(self, respond: Optional[Callable[[Request], tuple[int, object]]] = None):
        self.requests: list[Request] = []
        self.respond = respond or (lambda req: (201, req.json()))
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                parts = urlsplit(self.path)
                req = Request(self.command, parts.path, parse_qs(parts.query), dict(self.headers),
                              self.rfile.read(length))
                stub.requests.append(req)
                status, body = stub.respond(req)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

            def log_message(self, *args):  # keep the test output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", portpicker.pick_unused_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "StubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


def strict_schema(schema):
    """The schema with unknown fields refused (what the API server's fieldValidation=Strict does): every
    object schema with listed properties and no ``x-kubernetes-preserve-unknown-fields`` gets
    ``additionalProperties: false``."""
    if isinstance(schema, dict):
        schema = {k: strict_schema(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict_schema(v) for v in schema]
    return schema


def crd_validators(file: str, group: str, plural: str, version: str):
    """(plain, strict) JSON-schema validators of ``version`` of the upstream CRD ``shared/k8s/<file>``."""
    import jsonschema
    import pytest
    import yaml
    crd_path = SHARED / "k8s" / file
    if not crd_path.is_file():
        pytest.fail(f"CRD missing: {crd_path} (set JAXTRAIN_SHARED to the shared/ folder)")
    crd = yaml.safe_load(crd_path.read_text())
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["plural"] == plural
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = served["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(schema), jsonschema.Draft7Validator(strict_schema(schema))


def schema_errors(validator, manifest) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]
