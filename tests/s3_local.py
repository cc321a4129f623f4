"""A real S3 endpoint for tests: moto's S3 server on 127.0.0.1 (a free port), reached through s3fs,
with faults injected at the storage layer.

``LocalS3`` serves moto's WSGI application (the one ``moto_server`` runs) behind a small WSGI
middleware that can answer chosen requests with an S3 error instead of passing them on: a 503
``SlowDown`` a few times (transient: botocore and s3fs retry it), or a 403 ``AccessDenied`` for good
(permanent: a key the credentials may read but not write). k3rl's own functions are never patched;
the client sees exactly what a real S3 server would send.

Nothing here talks to anything but 127.0.0.1: ``env()`` gives fake credentials, the endpoint (both
``AWS_ENDPOINT_URL_S3``, which botocore reads, and ``FSSPEC_S3_ENDPOINT_URL``, which fsspec reads
at import), and switches off the EC2 metadata lookup and the user's own AWS config files.
``configure(monkeypatch)`` applies the same in this process (fsspec's config is read at import,
so its ``s3`` section is set directly); every request is logged in ``requests``.
"""

from __future__ import annotations

import fnmatch
import threading
from dataclasses import dataclass, field
from urllib.parse import unquote

from werkzeug.serving import make_server
from werkzeug.wsgi import get_input_stream

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app

ERROR_BODY = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
              '<Resource>{path}</Resource><RequestId>k3rl-test</RequestId></Error>')
MESSAGES = {"SlowDown": "Please reduce your request rate.", "AccessDenied": "Access Denied",
            "InternalError": "We encountered an internal error. Please try again."}
STATUS = {503: "503 Service Unavailable", 500: "500 Internal Server Error", 403: "403 Forbidden"}


class _QuietHandler(MotoRequestHandler):
    def log_request(self, *args, **kwargs) -> None:  # the request list is the log; keep test output clean
        pass


@dataclass
class Fault:
    """Answer requests of ``method`` whose path (``/bucket/key``) matches ``pattern`` with ``status`` /
    ``code``, ``times`` times (None: every time). ``hits`` counts the answers given."""

    method: str
    pattern: str
    status: int
    code: str
    times: int | None = None
    hits: int = 0

    def take(self, method: str, path: str) -> bool:
        if method != self.method or not fnmatch.fnmatchcase(path, self.pattern):
            return False
        if self.times is not None and self.hits >= self.times:
            return False
        self.hits += 1
        return True


@dataclass
class LocalS3:
    host: str = "127.0.0.1"
    requests: list[tuple[str, str]] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)

    def __post_init__(self):
        self._lock = threading.Lock()
        self._moto = DomainDispatcherApplication(create_backend_app)
        self._server = make_server(self.host, 0, self._app, threaded=True, request_handler=_QuietHandler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://{self.host}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()

    # ----------------------------------------------------------------- faults
    def fail(self, method: str, pattern: str, *, status: int = 503, code: str = "SlowDown",
             times: int | None = None) -> Fault:
        f = Fault(method, pattern, status, code, times)
        with self._lock:
            self.faults.append(f)
        return f

    def clear_faults(self) -> None:
        with self._lock:
            self.faults.clear()

    def _app(self, environ, start_response):
        method, path = environ["REQUEST_METHOD"], unquote(environ.get("PATH_INFO", ""))
        with self._lock:
            self.requests.append((method, path))
            fault = next((f for f in self.faults if f.take(method, path)), None)
        if fault is None:
            return self._moto(environ, start_response)
        get_input_stream(environ).read()  # take the whole request, as a server that refuses it would
        body = ERROR_BODY.format(code=fault.code, message=MESSAGES.get(fault.code, fault.code), path=path).encode()
        headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))]
        start_response(STATUS[fault.status], headers)
        return [body]

    # ----------------------------------------------------------------- clients
    def env(self, tmp_dir) -> dict[str, str]:
        """Environment variables that point botocore, s3fs and fsspec at this server and nowhere else."""
        return {"AWS_ACCESS_KEY_ID": "k3rl-test", "AWS_SECRET_ACCESS_KEY": "k3rl-test-secret",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": self.endpoint,
                "AWS_ENDPOINT_URL": self.endpoint, "FSSPEC_S3_ENDPOINT_URL": self.endpoint,
                "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(tmp_dir / "no-aws-config"),
                "AWS_SHARED_CREDENTIALS_FILE": str(tmp_dir / "no-aws-credentials")}

    def configure(self, monkeypatch, tmp_dir) -> None:
        """Point this process's s3fs at the server (environment, and fsspec's ``s3`` config)."""
        import fsspec.config

        for k, v in self.env(tmp_dir).items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
        monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": self.endpoint})

    def filesystem(self):
        """An s3fs filesystem on this server, apart from fsspec's instance cache."""
        import s3fs

        return s3fs.S3FileSystem(key="k3rl-test", secret="k3rl-test-secret", endpoint_url=self.endpoint,
                                 skip_instance_cache=True)
