"""HTTP server speaking the container service's JSON protocol (``kiln cluster serve``).

    POST /   X-Amz-Target: AmazonEC2ContainerServiceV20141113.<Action>
             Content-Type: application/x-amz-json-1.1

so ``boto3.client("ecs", endpoint_url="http://127.0.0.1:PORT", ...)`` works against it.  Errors
are ``{"__type": "ClientException", "message": ...}`` with HTTP 400 (500 for ServerException).

Only this machine can reach it by default (127.0.0.1).  Binding any other address requires a
token; with a token every request must carry it, either as ``Authorization: Bearer <token>`` or
as the access key id of a SigV4 ``Authorization`` header (``aws_access_key_id=<token>`` in boto3).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kiln.cluster.errors import AccessDeniedException, ClientException, ECSError, ServerException
from kiln.cluster.service import ClusterService

log = logging.getLogger(__name__)

TARGET_PREFIX = "AmazonEC2ContainerServiceV20141113."
MAX_BODY = 8 * 1024 * 1024


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_from_header(header: str) -> str | None:
    """The token a request presents: a Bearer token or a SigV4 access key id."""
    if header.startswith("Bearer "):
        return header[len("Bearer ") :].strip()
    match = re.search(r"Credential=([^/,\s]+)/", header)
    return match.group(1) if match else None


class _Handler(BaseHTTPRequestHandler):
    server: ClusterHTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _reply(self, status: int, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/x-amz-json-1.1")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-amzn-RequestId", "00000000-0000-0000-0000-000000000000")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: ECSError) -> None:
        self._reply(e.status, {"__type": e.code, "message": e.message})

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, {"status": "ok"})
        else:
            self._error(ClientException("use POST / with an X-Amz-Target header"))

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                raise ClientException("request body too large")
            raw = self.rfile.read(length) if length else b""
            token = self.server.token
            if token is not None:
                given = token_from_header(self.headers.get("Authorization") or "")
                if given is None or not hmac.compare_digest(given, token):
                    raise AccessDeniedException("a valid token is required")
            target = self.headers.get("X-Amz-Target") or ""
            if not target.startswith(TARGET_PREFIX):
                raise ClientException(f"missing or unknown X-Amz-Target {target!r}")
            try:
                body = json.loads(raw or b"{}")
            except ValueError as e:
                raise ClientException(f"request body is not JSON: {e}") from e
            result = self.server.service.call(target[len(TARGET_PREFIX) :], body)
            self._reply(200, result)
        except ECSError as e:
            self._error(e)
        except Exception as e:  # surface as the service's ServerException
            log.exception("request failed")
            self._error(ServerException(f"{type(e).__name__}: {e}"))


class ClusterHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, host: str, port: int, service: ClusterService, token: str | None = None
    ) -> None:
        if not is_loopback(host) and not token:
            raise ValueError(
                f"refusing to listen on non-loopback address {host!r} without a token (--token)"
            )
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.service = service
        self.token = token or None
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        if ":" in str(host):
            host = f"[{host}]"
        return f"http://{host}:{port}"
