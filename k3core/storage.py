"""Storage failures as a user can act on them: which ones no retry fixes, and one line that says so.

Owns: ``storage_call(action, uri)``, which turns an error raised by an fsspec filesystem (s3fs and
botocore under it, the local filesystem, ...) into a ``StorageError`` that names the object, what
was being done to it, the cause and the fix; and the split between permanent failures (access
denied, no credentials, a bucket that does not exist: the same call fails until the user changes
something) and the rest. Does not own: retrying. Transient S3 errors (503 SlowDown, 500, a dropped
connection) are retried by botocore (``AWS_RETRY_MODE``, ``AWS_MAX_ATTEMPTS``) and then by s3fs;
a failure that outlasts those reaches a pipeline stage, which Prefect retries unless it is
permanent. Endpoint and credentials come from the standard variables (``AWS_ENDPOINT_URL_S3`` or
``FSSPEC_S3_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or ``AWS_PROFILE``);
nothing here reads or sets them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["StorageError", "StorageAccessDenied", "StorageNotFound", "storage_call", "storage_error"]


class StorageError(OSError):
    """A storage call that failed. ``uri``: the object or prefix; ``action``: what was being done
    (``write``, ``read``, ``list``); ``permanent``: retrying cannot help until the user changes
    credentials, permissions or the URL. The client's own exception is ``__cause__``."""

    permanent = False

    def __init__(self, message: str, *, uri: str = "", action: str = ""):
        super().__init__(message)
        self.uri, self.action = uri, action

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


class StorageAccessDenied(StorageError, PermissionError):
    """Access denied or no usable credentials: permanent."""

    permanent = True


class StorageNotFound(StorageError, FileNotFoundError):
    """The object is not there. Permanent when the bucket itself does not exist (``bucket_missing``)."""

    def __init__(self, message: str, *, uri: str = "", action: str = "", bucket_missing: bool = False):
        super().__init__(message, uri=uri, action=action)
        self.bucket_missing = bucket_missing
        self.permanent = bucket_missing


_CREDENTIAL_ERRORS = {"NoCredentialsError", "PartialCredentialsError", "NoAuthTokenError", "CredentialRetrievalError"}
_CONNECTION_ERRORS = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                      "ProxyConnectionError", "ClientConnectorError", "ServerDisconnectedError"}


def _names(exc: BaseException) -> set[str]:
    return {c.__name__ for c in type(exc).__mro__}


def _is_storage_exception(exc: BaseException) -> bool:
    """An error from the filesystem or its client library, not from k3rl's own code."""
    if isinstance(exc, StorageError):
        return False
    if isinstance(exc, OSError):
        return True
    root = type(exc).__module__.split(".")[0]
    return root in ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "adlfs", "azure", "requests",
                    "urllib3", "huggingface_hub")


def _s3_hint(uri: str, text: str) -> str:
    return text if uri.startswith(("s3://", "s3a://")) else ""


def storage_error(action: str, uri: str, exc: BaseException) -> StorageError:
    """The ``StorageError`` for ``exc`` raised while doing ``action`` to ``uri``."""
    names = _names(exc)
    cause = str(exc) or type(exc).__name__
    where = f"cannot {action} {uri}"
    if names & _CREDENTIAL_ERRORS:
        return StorageAccessDenied(
            f"{where}: no usable credentials ({cause}); " + (_s3_hint(uri, "set AWS_ACCESS_KEY_ID and "
                                                             "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
                                                             or "configure this storage's credentials"),
            uri=uri, action=action)
    if isinstance(exc, PermissionError):
        if "://" not in uri or uri.startswith("file://"):
            return StorageAccessDenied(f"{where}: permission denied ({cause}); choose a directory this user may "
                                       f"{action}, or change its permissions", uri=uri, action=action)
        return StorageAccessDenied(
            f"{where}: access denied ({cause}); the credentials in use may not {action} there: check them "
            + (_s3_hint(uri, "(AWS_ACCESS_KEY_ID, AWS_PROFILE) ") or "") + "and the bucket's policy"
            + (", or choose another location" if action == "write" else ""), uri=uri, action=action)
    if isinstance(exc, FileNotFoundError):
        bucket = "bucket" in cause.lower() and ("not exist" in cause.lower() or "nosuchbucket" in cause.lower())
        if bucket:
            return StorageNotFound(f"{where}: the bucket does not exist ({cause}); create it, or fix the URL",
                                   uri=uri, action=action, bucket_missing=True)
        return StorageNotFound(f"{where}: not found ({cause})", uri=uri, action=action)
    if names & _CONNECTION_ERRORS or isinstance(exc, (ConnectionError, TimeoutError)):
        return StorageError(
            f"{where}: the storage endpoint did not answer after the client's retries ({cause}); check "
            + (_s3_hint(uri, "AWS_ENDPOINT_URL_S3 (or FSSPEC_S3_ENDPOINT_URL) and ") or "") + "the network",
            uri=uri, action=action)
    return StorageError(f"{where}: {type(exc).__name__}: {cause}", uri=uri, action=action)


@contextlib.contextmanager
def storage_call(action: str, uri: str) -> Iterator[None]:
    """Run a block of filesystem calls on ``uri``; an error from the filesystem or its client leaves
    as a ``StorageError`` naming ``uri`` (the original as its ``__cause__``). Other errors pass."""
    try:
        yield
    except Exception as e:
        if not _is_storage_exception(e):
            raise
        raise storage_error(action, uri, e) from e
