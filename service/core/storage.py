"""Storage URIs -> filesystems. Local paths, gs:// (through gcsfs), memory:// and any fsspec URI.

fsspec is used by the service's own reads and writes; Ray gets the same filesystem wrapped as
a pyarrow filesystem (`ray_storage`), because Ray would otherwise map gs:// to pyarrow's own
GCS client (different auth, no emulator support).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import fsspec
import pyarrow.fs as pafs
from fsspec.implementations.local import LocalFileSystem

from service.core.errors import StorageError, storage_full


def split(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """URI -> (fsspec filesystem, path inside it)."""
    if "://" not in uri:
        return fsspec.filesystem("file"), os.path.abspath(uri)
    protocol = uri.split("://", 1)[0]
    if protocol in ("gs", "gcs") and os.environ.get("STORAGE_EMULATOR_HOST"):
        # gcsfs picks its extended client at import time unless GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT
        # was false by then; that client probes bucket types over gRPC, which an emulator does
        # not serve. Take the plain client whatever the import order was.
        from gcsfs.core import GCSFileSystem

        fs = GCSFileSystem(**_options(protocol))
        return fs, fs._strip_protocol(uri)
    try:
        fs, path = fsspec.core.url_to_fs(uri, **_options(protocol))
    except (ImportError, ValueError) as e:
        raise StorageError(f"{uri}: unsupported storage URI ({e})") from None
    return fs, path


def _options(protocol: str) -> dict:
    if protocol in ("gs", "gcs") and os.environ.get("STORAGE_EMULATOR_HOST"):
        # An emulator on loopback (tests, local development): anonymous access.
        return {"token": "anon", "project": "test", "endpoint_url": os.environ["STORAGE_EMULATOR_HOST"]}
    return {}


FORWARDED_ENV = ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")
"""Environment the storage layer reads, passed on to the Ray processes the service starts
(coordinator, trials, training workers), which may not inherit the driver's environment."""


def forwarded_env() -> dict[str, str]:
    return {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}


def absolute(uri: str) -> str:
    """Relative local paths become absolute (Ray workers change directory)."""
    return uri if "://" in uri else os.path.abspath(uri)


def ray_storage(uri: str) -> tuple[pafs.FileSystem | None, str]:
    """(storage_filesystem, storage_path) for Ray's RunConfig."""
    if "://" not in uri or uri.startswith("file://"):
        return None, absolute(uri.removeprefix("file://"))
    fs, path = split(uri)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


AUDIT_ENV = "PLAYBOOK_STORAGE_AUDIT"


def audit(uri: str) -> None:
    """With PLAYBOOK_STORAGE_AUDIT=DIR, every process appends the URIs it writes to
    DIR/<pid>.log: a cheap way to check which process wrote what (e.g. rank 0 only). The
    attempt fence adds the writes it refused, as `refused <uri>`."""
    folder = os.environ.get(AUDIT_ENV)
    if folder:
        with open(os.path.join(folder, f"{os.getpid()}.log"), "a") as f:
            f.write(uri + "\n")


T = TypeVar("T")
PERMANENT_ERRORS = (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)
"""Errors that a retry cannot fix; every other OSError (a dropped connection, a timeout, a 5xx
from an object store) is taken as transient."""
PERMANENT_ERRNOS = {errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM}
TRANSIENT_HTTP_CODES = {"408", "429", "500", "502", "503", "504"}
"""As strings: gcsfs's HttpError.code may be an int or a str."""


def storage_errors() -> tuple[type[BaseException], ...]:
    """What a storage call raises when storage fails: OSError, and gcsfs's HttpError (not an
    OSError) once gcsfs is in use. gcsfs is never imported here just to name its error."""
    retry = sys.modules.get("gcsfs.retry")
    return (OSError, retry.HttpError) if retry else (OSError,)


def is_transient(e: BaseException) -> bool:
    if isinstance(e, OSError):
        if str(e).startswith("Forbidden"):  # gcsfs's HTTP 403: an OSError without errno
            return False
        return not isinstance(e, PERMANENT_ERRORS) and e.errno not in PERMANENT_ERRNOS
    code = getattr(e, "code", None)  # gcsfs HttpError, after gcsfs's own retries
    return isinstance(e, storage_errors()) and str(code) in TRANSIENT_HTTP_CODES


def describe(e: BaseException) -> str:
    """An error as one line (gcsfs puts the server's message on a second line)."""
    return " ".join(str(e).split()) or type(e).__name__


def with_retries(fn: Callable[[], T], attempts: int = 5, first_delay_s: float = 0.05) -> T:
    """Call `fn`, retrying transient storage errors with exponential backoff (0.05, 0.1, 0.2,
    ... s); a permanent error, or the last transient one, is raised."""
    for attempt in range(attempts):
        try:
            return fn()
        except storage_errors() as e:
            if attempt == attempts - 1 or not is_transient(e):
                raise
            time.sleep(first_delay_s * 2**attempt)
    raise AssertionError("unreachable")


def write_bytes_atomic(uri: str, data: bytes) -> None:
    """Write a whole file so that readers see the old or the new content, never a torn one.
    Transient storage errors are retried (`with_retries`); the whole write is redone each time.
    A full disk raises StorageFull."""
    audit(uri)
    fs, path = split(uri)
    try:
        with_retries(lambda: _write_once(fs, path, data))
    except storage_errors() as e:
        raise storage_full(uri, e) or StorageError(f"{uri}: cannot write ({describe(e)})") from None


COMPOSE_MIN_BYTES = 256 * 1024
"""An object store appends by composing [object, new part] into the object: 3 requests (PUT the
part, compose, DELETE the part) instead of 1 PUT, worth it once the object is this large."""


def append_bytes(uri: str, data: bytes, size: int) -> bool:
    """Append `data` to a file of `size` bytes written by this process. True when appended;
    False where appending is not cheaper than a whole write: the caller rewrites it whole.

    A local file takes one `write` on an O_APPEND descriptor (a reader sees whole lines, or
    nothing new); an object store with compose (gcsfs' `merge`: GCS composes its objects,
    "useful for making appends to an existing object") one compose once it holds
    COMPOSE_MIN_BYTES. Not retried: a failed append may have half happened, so the caller
    rewrites the whole file instead. Raises StorageError."""
    fs, path = split(uri)
    try:
        if isinstance(fs, LocalFileSystem):
            audit(uri)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            try:
                if os.write(fd, data) != len(data):
                    raise OSError(errno.EIO, "short append")
            finally:
                os.close(fd)
            return True
        if not hasattr(fs, "merge") or size < COMPOSE_MIN_BYTES:
            return False
        audit(uri)
        part = f"{path}.part-{uuid.uuid4().hex[:8]}"
        with fs.open(part, "wb") as f:
            f.write(data)
        try:
            fs.merge(path, [path, part])
        finally:
            fs.rm_file(part)
        fs.invalidate_cache(path)
        return True
    except storage_errors() as e:
        raise StorageError(f"{uri}: cannot append ({describe(e)})") from None


def _write_once(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    if not isinstance(fs, LocalFileSystem):  # object stores: a single PUT is atomic
        with fs.open(path, "wb") as f:
            f.write(data)
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with fs.open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # a failed write leaves no stray file behind
            os.remove(tmp)


def write_json(uri: str, obj) -> None:
    write_bytes_atomic(uri, json.dumps(obj, indent=1, default=str).encode())


def read_json(uri: str, default=None):
    """The JSON object stored at `uri`; `default` where there is none."""
    return parse_json(read_bytes(uri), uri) if exists(uri) else default


def parse_json(data: bytes, uri: str):
    """`data`, read from `uri`, as JSON; a StorageError naming the file where it is not JSON
    (a file only the service writes, atomically, so changed or torn by something else)."""
    try:
        return json.loads(data)
    except ValueError as e:
        raise StorageError(f"{uri}: not a valid JSON file ({e})") from None


def read_bytes(uri: str) -> bytes:
    fs, path = split(uri)
    with fs.open(path, "rb") as f:
        return f.read()


def open_read(uri: str):
    """The file at `uri` opened for reading in binary (a context manager)."""
    fs, path = split(uri)
    return fs.open(path, "rb")


def size(uri: str) -> int:
    """The size of the file at `uri` in bytes, from its listing (FileNotFoundError when absent)."""
    fs, path = split(uri)
    return fs.size(path)


def exists(uri: str) -> bool:
    fs, path = split(uri)
    return fs.exists(path)
