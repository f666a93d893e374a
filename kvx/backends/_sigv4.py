"""AWS Signature Version 4 for S3 object requests, with the signing key cached per day.

Only what the ``s3`` backend's lean GET/PUT path needs: header-based signing (no presigned
URLs, no chunked payload signing), ``x-amz-content-sha256: UNSIGNED-PAYLOAD`` (S3 accepts it
for any request; the body is then covered by TLS on https endpoints, not by the signature),
path-style or virtual-hosted paths given by the caller, optional query parameters and an
optional session token. Signed headers: ``host``, ``x-amz-content-sha256``, ``x-amz-date``
and ``x-amz-security-token`` when a token is used; anything else sent (``Range``,
``Content-Length``) is unsigned, which SigV4 allows.

Reference: https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-header-based-auth.html
"""

from __future__ import annotations

import hashlib
import hmac
import time
from urllib.parse import quote

__all__ = ["UNSIGNED_PAYLOAD", "Signer", "canonical_path"]

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
_ALGO = "AWS4-HMAC-SHA256"


def canonical_path(bucket: str, key: str) -> str:
    """The URI-encoded path-style path ``/bucket/key`` (S3 encodes each segment once, keeps ``/``)."""
    return quote(f"/{bucket}/{key}", safe="/~")


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


class Signer:
    """Signs S3 requests for one region with SigV4; thread-safe (caches are replaced, not mutated).

    Parameters
    ----------
    region
        Signing region (``us-east-1`` for most S3-compatible stores).
    service
        Signing service name (``s3``).
    """

    __slots__ = ("_date", "_key", "_scope", "region", "service")

    def __init__(self, region: str, service: str = "s3") -> None:
        self.region = region
        self.service = service
        # (secret, yyyymmdd) -> signing key; recomputed when the day or the secret changes
        self._key: tuple[str, str, bytes] = ("", "", b"")
        self._date: tuple[int, str] = (-1, "")
        self._scope = f"/{region}/{service}/aws4_request"

    def _amz_date(self) -> str:
        now = int(time.time())
        d = self._date
        if d[0] != now:
            d = (now, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)))
            self._date = d
        return d[1]

    def signing_key(self, secret: str, day: str) -> bytes:
        """``HMAC(HMAC(HMAC(HMAC("AWS4"+secret, day), region), service), "aws4_request")``, cached."""
        k = self._key
        if k[0] != secret or k[1] != day:
            s = _hmac(_hmac(_hmac(("AWS4" + secret).encode(), day), self.region), self.service)
            k = (secret, day, _hmac(s, "aws4_request"))
            self._key = k
        return k[2]

    def headers(self, method: str, host: str, path: str, access_key: str, secret_key: str,
                token: str | None = None, query: str = "", amz_date: str | None = None) -> dict[str, str]:
        """The headers that authenticate ``method host path?query`` (body: UNSIGNED-PAYLOAD).

        ``path`` must already be URI-encoded exactly as it is sent; ``query`` must be the
        canonical query string (parameters sorted by name, names and values URI-encoded).
        The returned dict holds ``Host``, ``x-amz-date``, ``x-amz-content-sha256``,
        ``Authorization`` and ``x-amz-security-token`` when ``token`` is given.
        """
        amz = amz_date or self._amz_date()
        day = amz[:8]
        if token:
            canon_h = (f"host:{host}\nx-amz-content-sha256:{UNSIGNED_PAYLOAD}\nx-amz-date:{amz}\n"
                       f"x-amz-security-token:{token}\n")
            signed = "host;x-amz-content-sha256;x-amz-date;x-amz-security-token"
        else:
            canon_h = f"host:{host}\nx-amz-content-sha256:{UNSIGNED_PAYLOAD}\nx-amz-date:{amz}\n"
            signed = "host;x-amz-content-sha256;x-amz-date"
        creq = f"{method}\n{path}\n{query}\n{canon_h}\n{signed}\n{UNSIGNED_PAYLOAD}"
        scope = day + self._scope
        sts = f"{_ALGO}\n{amz}\n{scope}\n{hashlib.sha256(creq.encode()).hexdigest()}"
        sig = hmac.new(self.signing_key(secret_key, day), sts.encode(), hashlib.sha256).hexdigest()
        h = {"Host": host, "x-amz-date": amz, "x-amz-content-sha256": UNSIGNED_PAYLOAD,
             "Authorization": f"{_ALGO} Credential={access_key}/{scope}, SignedHeaders={signed}, Signature={sig}"}
        if token:
            h["x-amz-security-token"] = token
        return h
