"""Where a run's files live: a local folder or a URI of any filesystem Ray supports (through pyarrow).

    scaling.storage_path      "" (= <efftx home>/runs), a local path, file:///abs/path, s3://bucket/prefix,
                              gs://bucket/prefix, hdfs://host/path, abfs://container@account/path
    scaling.storage_endpoint  S3-compatible stores only: http(s)://host[:port] (MinIO, Ceph, moto, ...);
                              "" = $AWS_ENDPOINT_URL_S3, else $AWS_ENDPOINT_URL, else AWS itself

Everything a run writes goes there: Ray Train's checkpoints (``RunConfig(storage_path, storage_filesystem)``),
the run record ``efftx_run.json`` and the export folder; resume reads the record and the checkpoints back from
there, and export loading (:func:`efftx.export.resolve_export`) downloads a URI export into a local cache.

A :class:`Storage` is a pyarrow filesystem plus the root path on it; every path it takes is a path *on that
filesystem* (``bucket/prefix/run/...`` for S3, an absolute path locally), and :meth:`Storage.uri` turns one back
into what a user types. Local paths use pyarrow's LocalFileSystem for listing and deleting, but files are written
through :func:`efftx.export.atomic_write` (temp file + rename), as before URIs were supported.

Credentials come from the standard places: for S3 the variables ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN`` (read on the driver and carried inside the filesystem object,
which Ray pickles to every worker; without them, the AWS SDK's default chain on each node), ``AWS_REGION`` /
``AWS_DEFAULT_REGION``; for GCS and the others pyarrow's defaults. They never enter the run config (which is
logged to MLflow). :meth:`Storage.check` probes the storage on the driver before anything starts: an unreachable
endpoint, a missing bucket, refused credentials are a LaunchError naming the URI and what to do.

Imports nothing of efftx but its errors at module level (efftx.config validates the keys with it).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

from efftx.errors import ConfigError, ExportError, LaunchError

# URI schemes pyarrow (and so Ray Train) has filesystems for; "" and file are local.
REMOTE_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
PROBE_PREFIX = ".efftx_storage_probe"


def scheme(path: str) -> str:
    """The URI scheme of ``path`` (lower case), "" for a plain path."""
    m = _SCHEME.match(str(path))
    return m.group(1).lower() if m else ""


def is_uri(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a remote filesystem (s3://, gs://, ...), i.e. is not a local path or file://."""
    return scheme(str(path)) in REMOTE_SCHEMES


def check_keys(path: str, endpoint: str, key: str = "scaling.storage_path",
               endpoint_key: str = "scaling.storage_endpoint") -> None:
    """Syntax checks of the storage keys (no I/O): ConfigError naming the key and the value."""
    s = scheme(path)
    if s and s != "file" and s not in REMOTE_SCHEMES:
        raise ConfigError(f"{key}={path!r}: unsupported URI scheme {s}:// (use a local path, file://, "
                          f"{', '.join(x + '://' for x in REMOTE_SCHEMES)})")
    if s == "file" and (urlparse(path).netloc not in ("", "localhost") or not urlparse(path).path.startswith("/")):
        raise ConfigError(f"{key}={path!r}: a file:// URI needs an absolute path (file:///abs/path)")
    if s in REMOTE_SCHEMES:
        parsed = urlparse(path)
        if not parsed.netloc:
            raise ConfigError(f"{key}={path!r} names no bucket or host (for example s3://my-bucket/runs)")
        if parsed.query or parsed.fragment:
            raise ConfigError(f"{key}={path!r}: put options in their own keys (scaling.storage_endpoint), not "
                              f"in the URI's query")
    if endpoint:
        if s not in ("s3",):
            raise ConfigError(f"{endpoint_key}={endpoint!r} applies to s3:// storage only, but {key} is "
                              f"{path or '(the default local folder)'!r}")
        e = urlparse(endpoint)
        if e.scheme not in ("http", "https") or not e.hostname or (e.path or "/") != "/" or e.query:
            raise ConfigError(f"{endpoint_key}={endpoint!r} must be http(s)://host[:port] (e.g. "
                              f"http://127.0.0.1:9000 for a local MinIO)")


def normalize(path: str) -> str:
    """The form a run stores: a local path (``~`` expanded, absolute; file:// turned into the path) or the URI
    without a trailing slash."""
    path = str(path)
    if is_uri(path):
        return path.rstrip("/") if not path.endswith("://") else path
    if scheme(path) == "file":
        path = urlparse(path).path
    return str(Path(path).expanduser().resolve())


def env_endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""


def _s3_filesystem(endpoint: str):
    from pyarrow import fs as pafs

    kwargs: dict[str, Any] = {}
    endpoint = endpoint or env_endpoint()
    if endpoint:
        e = urlparse(endpoint)
        kwargs["endpoint_override"] = e.netloc
        kwargs["scheme"] = e.scheme or "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region or endpoint:
        kwargs["region"] = region or "us-east-1"  # S3-compatible stores ignore it; AWS resolves the bucket's
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:  # explicit, so the pickled filesystem carries them to the workers
        kwargs.update(access_key=key, secret_key=secret, session_token=os.environ.get("AWS_SESSION_TOKEN") or None)
    return pafs.S3FileSystem(connect_timeout=10, **kwargs)


@dataclass
class Storage:
    """A pyarrow filesystem and the root of a storage path on it. Picklable (Ray ships it to the workers)."""

    fs: Any  # pyarrow.fs.FileSystem
    root: str  # the storage path on ``fs``
    prefix: str = ""  # what turns a path on ``fs`` into a URI ("s3://"); "" = local
    endpoint: str = ""

    # ------------------------------------------------------------------ construction
    @classmethod
    def local(cls, root: str | os.PathLike = "/") -> "Storage":
        from pyarrow import fs as pafs

        return cls(pafs.LocalFileSystem(), str(root))

    @classmethod
    def open(cls, path: str, endpoint: str = "") -> "Storage":
        """The storage of ``path`` (a local path or a URI; ``endpoint``: S3-compatible stores). ConfigError when
        pyarrow has no filesystem for it."""
        check_keys(path, endpoint, key="storage path", endpoint_key="storage endpoint")
        path = normalize(path)
        s = scheme(path)
        if not is_uri(path):
            return cls.local(path)
        if s == "s3":
            rest = path[len("s3://"):]
            return cls(_s3_filesystem(endpoint), rest.rstrip("/"), "s3://", endpoint or env_endpoint())
        from pyarrow import fs as pafs

        try:
            fs, root = pafs.FileSystem.from_uri(path)
        except (ValueError, OSError, ImportError) as exc:
            raise ConfigError(f"cannot open storage {path}: {exc}") from None
        return cls(fs, root.rstrip("/"), f"{s}://")

    @property
    def is_local(self) -> bool:
        return not self.prefix

    # ------------------------------------------------------------------ paths
    def join(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts) if not self.is_local else str(Path(self.root, *parts))

    def uri(self, path: str | os.PathLike | None = None) -> str:
        """What a user types for ``path`` (a path on the filesystem; None = the root)."""
        return f"{self.prefix}{path if path is not None else self.root}"

    def norm(self, path: str | os.PathLike) -> PurePosixPath | Path:
        """A comparable path object: resolved Path locally, PurePosixPath on a remote filesystem."""
        return Path(path).resolve() if self.is_local else PurePosixPath(str(path).rstrip("/"))

    # ------------------------------------------------------------------ files
    def info(self, path: str | os.PathLike):
        return self.fs.get_file_info(str(path))

    def is_dir(self, path: str | os.PathLike) -> bool:
        from pyarrow import fs as pafs

        return self.info(path).type == pafs.FileType.Directory

    def is_file(self, path: str | os.PathLike) -> bool:
        from pyarrow import fs as pafs

        return self.info(path).type == pafs.FileType.File

    def list_dirs(self, path: str | os.PathLike, prefix: str = "") -> list[str]:
        """Paths of the sub-folders of ``path`` whose name starts with ``prefix`` ([] when it does not exist)."""
        from pyarrow import fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(str(path), allow_not_found=True))
        return [i.path for i in infos if i.type == pafs.FileType.Directory and i.base_name.startswith(prefix)]

    def file_sizes(self, path: str | os.PathLike) -> dict[str, int]:
        """``{relative posix path: size}`` of every file under ``path`` ({} when it does not exist)."""
        from pyarrow import fs as pafs

        root = str(path).rstrip("/")
        infos = self.fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        return {posixpath.relpath(Path(i.path).as_posix() if self.is_local else i.path,
                                  Path(root).as_posix() if self.is_local else root): i.size
                for i in infos if i.type == pafs.FileType.File}

    def read_bytes(self, path: str | os.PathLike) -> bytes:
        with self.fs.open_input_stream(str(path)) as f:
            return f.read()

    def read_text(self, path: str | os.PathLike) -> str:
        return self.read_bytes(path).decode()

    def sha256(self, path: str | os.PathLike) -> str:
        h = hashlib.sha256()
        with self.fs.open_input_stream(str(path)) as f:
            while block := f.read(1 << 20):
                h.update(block)
        return h.hexdigest()

    def write(self, path: str | os.PathLike, data: str | bytes) -> None:
        """Write a whole file: locally through a temp file + rename; on an object store one PUT (atomic there)."""
        data = data.encode() if isinstance(data, str) else data
        if self.is_local:
            from efftx.export import atomic_write

            Path(path).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, data)
            return
        with self.fs.open_output_stream(str(path)) as f:
            f.write(data)

    def delete_file(self, path: str | os.PathLike) -> None:
        self.fs.delete_file(str(path))

    def rmtree(self, path: str | os.PathLike) -> None:
        if self.is_local:
            shutil.rmtree(path, ignore_errors=True)
            return
        try:
            self.fs.delete_dir(str(path))
        except FileNotFoundError:
            pass

    def upload_dir(self, local: str | os.PathLike, path: str, last: tuple[str, ...] = ()) -> None:
        """Copy the files of the local folder ``local`` to ``path`` (replacing files of the same name); the files
        named in ``last`` are copied after all others (a reader that checks for them sees a whole folder)."""
        files = sorted((p for p in Path(local).rglob("*") if p.is_file()),
                       key=lambda p: (p.name in last, last.index(p.name) if p.name in last else 0, str(p)))
        for p in files:
            self.write(posixpath.join(path, p.relative_to(local).as_posix()), p.read_bytes())

    def download_dir(self, path: str | os.PathLike, local: str | os.PathLike) -> Path:
        """Copy every file under ``path`` into the local folder ``local`` (created); returns it."""
        local = Path(local)
        local.mkdir(parents=True, exist_ok=True)
        for rel in self.file_sizes(path):
            dest = local / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            with self.fs.open_input_stream(posixpath.join(str(path), rel)) as src, open(dest, "wb") as out:
                while block := src.read(1 << 22):
                    out.write(block)
        return local

    # ------------------------------------------------------------------ checks
    def check(self, what: str = "scaling.storage_path") -> None:
        """On the driver, before anything starts: the storage answers, its bucket exists and a file can be written
        and deleted under the root. LaunchError naming the URI and what to do otherwise. A local root is not
        probed (it is created as needed, as before)."""
        if self.is_local:
            return
        uri = self.uri()
        bucket = self.root.split("/", 1)[0]
        try:
            from pyarrow import fs as pafs

            if self.info(bucket).type == pafs.FileType.NotFound:
                raise LaunchError(f"{what}={uri}: the bucket {self.prefix}{bucket} does not exist"
                                  f"{self._where()}; create it, or point {what} at an existing one")
            probe = posixpath.join(self.root, f"{PROBE_PREFIX}-{secrets.token_hex(4)}")
            self.write(probe, b"efftx")
            self.delete_file(probe)
        except LaunchError:
            raise
        except Exception as exc:  # pyarrow raises OSError with the SDK's error name in the text
            raise LaunchError(f"{what}={uri} is not usable{self._where()}: {_short(exc)}; {_hint(exc, self)}"
                              ) from None

    def _where(self) -> str:
        return f" (endpoint {self.endpoint})" if self.endpoint else ""


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) < 300 else text[:297] + "..."


def _hint(exc: BaseException, storage: Storage) -> str:
    text = str(exc).upper()
    if "NETWORK_CONNECTION" in text or "COULD NOT CONNECT" in text or "COULDN'T CONNECT" in text \
            or "TIMEOUT" in text or "RESOLVE" in text:
        where = storage.endpoint or "the store"
        return (f"nothing answers at {where}: check scaling.storage_endpoint (or $AWS_ENDPOINT_URL) and that the "
                f"server is running")
    if any(k in text for k in ("ACCESS_DENIED", "ACCESSDENIED", "INVALIDACCESSKEYID", "INVALID_ACCESS_KEY",
                               "SIGNATURE", "FORBIDDEN", "403", "CREDENTIAL", "UNAUTHORIZED")):
        return ("the credentials were refused: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
                "AWS_SESSION_TOKEN for temporary ones) to a key that may read and write this bucket")
    return "check the URI, the endpoint and the credentials"


# ------------------------------------------------------------------ exports at a URI, cached locally

def fetch_dir(uri: str, cache_root: str | os.PathLike, endpoint: str = "") -> Path:
    """A local copy of the folder at ``uri`` (a remote URI), in ``cache_root/<hash of the URI>``: downloaded when
    the cache is missing or differs from the remote folder (file names and sizes), otherwise reused. The new copy
    is built beside the old and swapped in. ExportError naming the URI when it cannot be read."""
    uri = normalize(uri)
    try:
        storage = Storage.open(uri, endpoint)
        listing = storage.file_sizes(storage.root)
    except (ConfigError, LaunchError) as exc:
        raise ExportError(f"cannot read {uri}: {exc}") from None
    except Exception as exc:
        raise ExportError(f"cannot read {uri}: {_short(exc)}") from None
    if not listing:
        raise ExportError(f"{uri} is empty or does not exist (expected an efftx export folder)")
    cache_root = Path(cache_root)
    dest = cache_root / hashlib.sha256(uri.encode()).hexdigest()[:20]
    stamp = {"uri": uri, "files": listing}
    stamp_file = dest / ".efftx_source.json"
    try:
        if json.loads(stamp_file.read_text()) == stamp:
            return dest
    except (OSError, ValueError):
        pass
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=cache_root))
    try:
        storage.download_dir(storage.root, tmp)
        (tmp / stamp_file.name).write_text(json.dumps(stamp))
        try:  # another process (a second Serve replica) swapped in the same files meanwhile: keep its copy
            if json.loads(stamp_file.read_text()) == stamp:
                shutil.rmtree(tmp, ignore_errors=True)
                return dest
        except (OSError, ValueError):
            pass
        old = dest.with_name(dest.name + f".old-{secrets.token_hex(3)}")
        if dest.exists():
            dest.rename(old)
        tmp.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and dest.is_dir() and stamp_file.is_file():
            return dest  # another process swapped in a copy first
        raise ExportError(f"cannot download {uri}: {_short(exc)}") from None
    return dest
