"""HTTP server speaking the container service's JSON protocol (``kiln cluster serve``).

    POST /   X-Amz-Target: AmazonEC2ContainerServiceV20141113.<Action>
             Content-Type: application/x-amz-json-1.1

so ``boto3.client("ecs", endpoint_url="http://127.0.0.1:PORT", ...)`` works against it.  Errors
are ``{"__type": "<ECS error name>", "message": ...}`` with a 4xx status; every response carries
a fresh ``x-amzn-RequestId``.

Authentication (required for any non-loopback address): SigV4, verified against credentials the
server reads from a file (``kiln.cluster.sigv4``), and/or a bearer token for the CLI
(``Authorization: Bearer <token>``).  Both are checked before the body is read (SigV4's signature
itself covers the body, so it is compared once the body is in).

The HTTP layer is ``http.server`` with the hardening a public endpoint needs: TCP_NODELAY and one
write per response, a timeout on every read (slow or half-sent requests are dropped), a cap on
open connections (more get ``ThrottlingException`` and are closed), a body-size cap, and a
Content-Length that must be a plain number.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import socket
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kiln.cluster import sigv4
from kiln.cluster.errors import (
    AccessDeniedException,
    ClientException,
    ECSError,
    ServerException,
    ThrottlingException,
    UnknownOperationException,
)
from kiln.cluster.service import ClusterService

log = logging.getLogger(__name__)

TARGET_PREFIX = "AmazonEC2ContainerServiceV20141113."
MAX_BODY = 1024 * 1024
READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 256


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _error_bytes(e: ECSError, request_id: str) -> bytes:
    data = json.dumps({"__type": e.code, "message": e.message}).encode()
    head = (
        f"HTTP/1.1 {e.status} Error\r\nContent-Type: application/x-amz-json-1.1\r\n"
        f"Content-Length: {len(data)}\r\nx-amzn-RequestId: {request_id}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + data


class _Handler(BaseHTTPRequestHandler):
    server: ClusterHTTPServer
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S  # every read of a request: headers and body
    wbufsize = 64 * 1024  # one write per response (flushed after each request)

    def setup(self) -> None:
        super().setup()
        self.request.settimeout(self.server.read_timeout)
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _reply(self, status: int, doc: dict[str, Any], request_id: str) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/x-amz-json-1.1")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-amzn-RequestId", request_id)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        request_id = str(uuid.uuid4())
        if self.path == "/health":
            self._reply(200, {"status": "ok"}, request_id)
        else:
            e = ClientException("use POST / with an X-Amz-Target header")
            self._reply(e.status, {"__type": e.code, "message": e.message}, request_id)

    def do_POST(self) -> None:
        request_id = str(uuid.uuid4())
        try:
            result = self._handle()
            self._reply(200, result, request_id)
        except ECSError as e:
            self._reply(e.status, {"__type": e.code, "message": e.message}, request_id)
        except (TimeoutError, ConnectionError):
            self.close_connection = True  # the client went quiet or away mid-request
        except Exception as e:  # a bug: reported as the service's ServerException
            log.exception("request %s failed", request_id)
            err = ServerException(f"internal error {type(e).__name__}; request id {request_id}")
            self._reply(err.status, {"__type": err.code, "message": err.message}, request_id)

    def _length(self) -> int:
        raw = self.headers.get("Content-Length")
        if raw is None:
            return 0
        if not raw.strip().isdigit() or not raw.strip().isascii():
            self.close_connection = True  # the framing of what follows is unknown
            raise ClientException(f"invalid Content-Length {raw!r}")
        length = int(raw)
        if length > MAX_BODY:
            self.close_connection = True
            raise ClientException(f"request body too large ({length} > {MAX_BODY} bytes)")
        return length

    def _handle(self) -> dict[str, Any]:
        length = self._length()
        auth = self._authenticate_headers()
        raw = self.rfile.read(length) if length else b""
        if len(raw) != length:
            self.close_connection = True
            raise ClientException("request body shorter than its Content-Length")
        if auth is not None:
            sigv4.verify(
                auth,
                self.server.credentials,
                self.command,
                self.path,
                dict(self.headers.items()),
                raw,
            )
        target = self.headers.get("X-Amz-Target") or ""
        if not target.startswith(TARGET_PREFIX):
            raise UnknownOperationException(f"missing or unknown X-Amz-Target {target!r}")
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, RecursionError) as e:
            raise ClientException(f"request body is not JSON: {type(e).__name__}") from None
        return self.server.service.call(target[len(TARGET_PREFIX) :], body)

    def _authenticate_headers(self) -> sigv4.Authorization | None:
        """Check credentials before reading the body; the SigV4 signature is checked after."""
        token, creds = self.server.token, self.server.credentials
        if token is None and not creds:
            return None
        header = self.headers.get("Authorization") or ""
        if header.startswith("Bearer ") and token is not None:
            given = header[len("Bearer ") :].strip().encode("utf-8", "replace")
            if hmac.compare_digest(given, token.encode()):
                return None
            raise AccessDeniedException("a valid token is required")
        if header.startswith(sigv4.ALGORITHM) and creds:
            return sigv4.parse(header, creds)
        raise AccessDeniedException(
            "this server requires authentication: SigV4 with the server's credentials"
            + (" or a bearer token" if token is not None else "")
        )


class ClusterHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        host: str,
        port: int,
        service: ClusterService,
        token: str | None = None,
        credentials: dict[str, str] | None = None,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout: float = READ_TIMEOUT_S,
    ) -> None:
        if not is_loopback(host) and not token and not credentials:
            raise ValueError(
                f"refusing to listen on non-loopback address {host!r} without authentication"
                " (--credentials-file or --token-file)"
            )
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.service = service
        self.token = token or None
        self.credentials = dict(credentials or {})
        self._slots = threading.BoundedSemaphore(max_connections)
        self.read_timeout = read_timeout
        super().__init__((host, port), _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            err = ThrottlingException("too many open connections; retry later")
            try:
                request.settimeout(1.0)
                request.sendall(_error_bytes(err, str(uuid.uuid4())))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        if ":" in str(host):
            host = f"[{host}]"
        return f"http://{host}:{port}"
