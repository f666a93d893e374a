"""``s3``: OBJECT registrations on an S3-compatible object store (own SigV4 GET/PUT + boto3).

An :class:`~kvx.ObjectRegion` ``(bucket, key, nbytes)`` is one object. Transfers are loopback:
the local list is HOST memory of this agent, the other list is OBJECT descriptors (one per
object; ``addr`` is a byte offset inside the object, ``dev`` the registration slot).

- **Writes** (memory -> object) are whole-object only: each descriptor must cover its object
  exactly (offset 0, ``nbytes`` == registered size), checked vectorized at post. Objects up to
  :data:`MULTIPART_THRESHOLD` go as one ``PutObject`` (atomic); larger ones as a multipart
  upload of :data:`PART_BYTES` parts uploaded in parallel, made visible atomically by
  ``CompleteMultipartUpload`` and aborted on any failure or cancel. A reader therefore sees the
  old object, the new object, or no object -- never a torn one.
- **Reads** (object -> memory) are whole or ranged GETs that stream the body straight into the
  destination memory (``readinto`` on a ``ctypes`` view of the address; no intermediate
  ``bytes``). Reads larger than :data:`MULTIPART_THRESHOLD` are split into :data:`PART_BYTES`
  ranges fetched in parallel.
- **Lean path**: with a configured endpoint, single-object PUTs and all GETs skip botocore:
  kvx signs them itself (SigV4, :mod:`kvx.backends._sigv4`, ``UNSIGNED-PAYLOAD``, signing key
  cached per day) and sends them on one kept-alive ``http.client`` connection per worker,
  with the same retries, bounds and error mapping. boto3 still does bucket checks/creation,
  multipart uploads, credential resolution, and everything against AWS's own endpoints.
- **Concurrency**: a pool of ``KVX_S3_THREADS`` worker threads; every object operation (PUT,
  part, ranged GET) is one queued unit. ``post`` only queues and returns; the request completes
  when every unit of the transfer has finished. ``cancel`` drops queued units (in-flight ones
  run to their end; multipart uploads are aborted).
- **Bounds**: botocore ``standard`` retry mode, mirrored by the lean path (3 attempts,
  exponential backoff with jitter; throttling, 5xx, connection errors and timeouts retried),
  connect timeout ``min(5, peer_timeout)`` s, read timeout ``peer_timeout`` s per socket read.
  A dead endpoint fails a transfer in a few seconds; a silent one within the retry budget of
  read timeouts; the agent's ``transfer_timeout`` bounds everything.
- **Buckets** are checked (``HeadBucket``) at ``register`` and created when missing; objects are
  not created by ``register``: reading a never-written object fails the transfer with
  :class:`~kvx.errors.RemoteError` naming the key.

Endpoint and credentials: ``KVX_S3_ENDPOINT`` (overrides), else ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``; credentials, profile and region from the standard AWS chain
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
``AWS_REGION`` / ``AWS_DEFAULT_REGION``; region defaults to ``us-east-1``).
"""

from __future__ import annotations

from .backend import MULTIPART_THRESHOLD, PART_BYTES, S3Backend
from .errors import _StatusError, errors, translate
from .settings import S3Options, S3Settings, make_client, settings_from_env

__all__ = ["MULTIPART_THRESHOLD", "PART_BYTES", "S3Backend", "S3Options", "S3Settings", "_StatusError", "errors",
           "make_client", "settings_from_env", "translate"]
