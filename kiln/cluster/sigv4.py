"""Verification of AWS Signature Version 4, the way boto3 already signs every ECS request.

The server holds credentials (access key id -> secret access key, read from a file: never from
the command line).  ``parse`` reads the ``Authorization`` header and checks the key id *before*
the body is read; ``verify`` recomputes the signature over the canonical request (method, path,
query, the signed headers, the SHA-256 of the body) and compares it in constant time.  An unknown
key id is ``UnrecognizedClientException``; a wrong signature, a malformed header, a missing
signed header or a clock skew over 15 minutes is ``InvalidSignatureException`` (both HTTP 403,
as the service answers).  Spec: the SigV4 signing process in AWS's general reference.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import hmac
import re
import urllib.parse
from collections.abc import Mapping

from kiln.cluster.errors import InvalidSignatureException, UnrecognizedClientException

ALGORITHM = "AWS4-HMAC-SHA256"
MAX_SKEW_S = 15 * 60
_HEADER = re.compile(
    r"AWS4-HMAC-SHA256 Credential=([^/,\s]+)/(\d{8})/([^/,\s]+)/([^/,\s]+)/aws4_request,\s*"
    r"SignedHeaders=([a-z0-9;\-]+),\s*Signature=([0-9a-f]{64})"
)


@dataclasses.dataclass(frozen=True)
class Authorization:
    key_id: str
    date: str
    region: str
    service: str
    signed_headers: tuple[str, ...]
    signature: str


def parse(header: str, credentials: Mapping[str, str]) -> Authorization:
    """The request's SigV4 authorization, its key id known to the server (before the body)."""
    match = _HEADER.fullmatch(header.strip())
    if match is None:
        raise InvalidSignatureException(
            "Authorization header is not a valid AWS4-HMAC-SHA256 signature"
        )
    key_id, date, region, service, signed, signature = match.groups()
    known = any(hmac.compare_digest(key_id.encode(), k.encode()) for k in credentials)
    if not known:
        raise UnrecognizedClientException("The security token included in the request is invalid.")
    return Authorization(key_id, date, region, service, tuple(signed.split(";")), signature)


def _canonical_query(query: str) -> str:
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    quoted = [
        (urllib.parse.quote(k, safe="-_.~"), urllib.parse.quote(v, safe="-_.~")) for k, v in pairs
    ]
    return "&".join(f"{k}={v}" for k, v in sorted(quoted))


def _signing_key(secret: str, date: str, region: str, service: str) -> bytes:
    key = ("AWS4" + secret).encode()
    for part in (date, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def verify(
    auth: Authorization,
    credentials: Mapping[str, str],
    method: str,
    target: str,
    headers: Mapping[str, str],
    body: bytes,
    now: dt.datetime | None = None,
) -> None:
    """Raise InvalidSignatureException unless ``auth`` signs this request with the key's secret."""
    lowered = {k.lower(): v for k, v in headers.items()}
    amz_date = lowered.get("x-amz-date", "")
    try:
        when = dt.datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.UTC)
    except ValueError:
        raise InvalidSignatureException("X-Amz-Date is missing or malformed") from None
    now = now or dt.datetime.now(dt.UTC)
    if abs((now - when).total_seconds()) > MAX_SKEW_S or amz_date[:8] != auth.date:
        raise InvalidSignatureException("Signature expired or not yet valid: check the clock")
    if "host" not in auth.signed_headers or "x-amz-date" not in auth.signed_headers:
        raise InvalidSignatureException("the signature must cover the host and x-amz-date headers")
    if any(name not in lowered for name in auth.signed_headers):
        raise InvalidSignatureException("a signed header is missing from the request")
    path, _, query = target.partition("?")
    canonical_headers = "".join(
        f"{name}:{' '.join(lowered[name].split())}\n" for name in auth.signed_headers
    )
    payload = lowered.get("x-amz-content-sha256") or hashlib.sha256(body).hexdigest()
    canonical = "\n".join(
        [
            method,
            urllib.parse.quote(path or "/", safe="/~"),
            _canonical_query(query),
            canonical_headers,
            ";".join(auth.signed_headers),
            payload,
        ]
    )
    scope = f"{auth.date}/{auth.region}/{auth.service}/aws4_request"
    to_sign = "\n".join(
        [ALGORITHM, amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    secret = next(
        v for k, v in credentials.items() if hmac.compare_digest(k.encode(), auth.key_id.encode())
    )
    key = _signing_key(secret, auth.date, auth.region, auth.service)
    expected = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected.encode(), auth.signature.encode()):
        raise InvalidSignatureException(
            "The request signature we calculated does not match the signature you provided."
        )


__all__ = ["Authorization", "parse", "verify"]
