"""From a URL (or icechunk repository) to a read-only zarr store, with errors for humans.

Object stores go through obstore (never fsspec). Credentials live only inside the obstore
client: what this module keeps for display and errors is the URL without user info or query
string, and failures are re-worded from the store's error *code*, never its full response.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import zarr
import zarr.errors
import zarr.storage
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

from ..errors import (
    ConfigTypeError,
    MissingDependencyError,
    StoreAccessError,
    StoreConnectionError,
    StoreError,
    StoreNotFoundError,
    UnknownNameError,
)

OBJECT_STORE_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "azure", "http",
                        "https", "memory")

# obstore retries requests itself (5xx, connection errors, timeouts) before we see an error;
# its default (10 retries within 3 minutes) makes a dead endpoint look like a hang.
DEFAULT_RETRY_CONFIG = {
    "max_retries": 3,
    "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2),
                "base": 2},
    "retry_timeout": timedelta(seconds=30),
}
DEFAULT_CLIENT_OPTIONS = {"connect_timeout": "5s", "timeout": "60s"}


@dataclass(frozen=True, eq=False)
class OpenedStore:
    """A zarr store plus what errors and the loader state may say about it."""

    store: Any
    display: str  # for messages: no credentials
    snapshot_id: str | None = None
    obstore: Any = None
    endpoint: str | None = None


def redact_url(url: str) -> str:
    """Drop user info and query strings (where signed URLs keep their secrets)."""
    parts = urlsplit(url)
    if not parts.scheme:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>]+")


def redact_urls(text: str) -> str:
    """``redact_url`` for every URL inside ``text`` (error messages, store descriptions)."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text)


def _with_defaults(options: Mapping[str, Any] | None) -> dict[str, Any]:
    opts = dict(options or {})
    opts.setdefault("retry_config", DEFAULT_RETRY_CONFIG)
    client = dict(DEFAULT_CLIENT_OPTIONS)
    client.update(opts.get("client_options") or {})
    if "allow_http" in opts:  # a client option (obstore panics on it at the top level)
        client.setdefault("allow_http", opts.pop("allow_http"))
    # obstore wants strings for client options (measured): accept Python bools/numbers too.
    opts["client_options"] = {k: (str(v).lower() if isinstance(v, bool) else
                                  v if isinstance(v, (str, timedelta)) else str(v))
                              for k, v in client.items()}
    return opts


def open_url(url: str | os.PathLike[str],
             storage_options: Mapping[str, Any] | None = None) -> OpenedStore:
    """A read-only zarr store for a local path, ``file://`` or object-store URL."""
    text = os.fspath(url)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if not isinstance(url, str) or (scheme not in ("file", *OBJECT_STORE_SCHEMES)
                                    and Path(text).expanduser().exists()):
        scheme = ""  # a path object, or a local path with a colon in it ("run:1.zarr")
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        # a file:// URL escapes its path ("%20" for a space), as Path.as_uri() writes it
        path = Path(unquote(parts.path) if scheme == "file" else text).expanduser()
        if not path.exists():
            raise StoreNotFoundError(
                f"Zarr store not found: {redact_url(text)!r} (looked for the directory "
                f"{str(path)!r}). Give an existing local path, a file:// URL, or an "
                "object-store URL such as s3://bucket/path.zarr."
            )
        return OpenedStore(zarr.storage.LocalStore(path, read_only=True),
                           f"file://{path.resolve()}")
    if scheme in OBJECT_STORE_SCHEMES:
        import obstore.store

        opts = _with_defaults(storage_options)
        try:
            obs = obstore.store.from_url(text, **opts)
        except BaseException as e:  # bad option names or values: say which, without values
            if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
                raise  # KeyboardInterrupt and the like; a Rust panic is a bad option too
            raise StoreError(
                f"cannot configure an object store for {redact_url(text)!r}: "
                f"{type(e).__name__}: {_first_line(e)} (storage_options keys given: "
                f"{sorted((storage_options or {}).keys())})"
            ) from None
        endpoint = opts.get("endpoint") or opts.get("endpoint_url") or opts.get("aws_endpoint")
        return OpenedStore(zarr.storage.ObjectStore(obs, read_only=True), redact_url(text),
                           obstore=obs, endpoint=redact_url(str(endpoint)) if endpoint else None)
    raise StoreError(
        f"unsupported store URL scheme {scheme!r} in {redact_url(text)!r}; use a local path, "
        f"file://, or one of {', '.join(s + '://' for s in OBJECT_STORE_SCHEMES)}"
    )


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _s3_code(e: BaseException) -> str | None:
    m = re.search(r"<Code>(\w+)</Code>", str(e))
    return m.group(1) if m else None


def explain(opened: OpenedStore, exc: BaseException) -> BaseException:
    """Turn a failure to open the group into an error that says what to fix."""
    import obstore.exceptions as oe

    from ..io.retry import http_status

    where = opened.display + (f" (endpoint {opened.endpoint})" if opened.endpoint else "")
    not_found = (FileNotFoundError, zarr.errors.GroupNotFoundError, oe.NotFoundError)
    if isinstance(exc, zarr.errors.ContainsArrayError) or (
            isinstance(exc, not_found) and _holds_array(opened)):
        parent, _, name = opened.display.rstrip("/").rpartition("/")
        return StoreError(
            f"{opened.display} is a Zarr array, not a group: open_source reads the variables "
            f"of a group. Open the group that holds it and name the variable: "
            f"open_source({parent!r}, variables=[{name!r}])"
        )
    if isinstance(exc, oe.BaseError) and _plain_http_refused(opened):
        return StoreConnectionError(
            f"cannot read from {where}: the endpoint is plain http:// and obstore refuses "
            "non-TLS requests unless they are allowed (its error says only \"builder "
            "error\"). For a plain-HTTP endpoint such as moto or MinIO, pass "
            "storage_options={..., 'client_options': {'allow_http': True}} (or "
            "'allow_http': True)."
        )
    if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError)) or (
            http_status(exc) in (401, 403)):
        code = _s3_code(exc) or "403 Forbidden"
        return StoreAccessError(
            f"access to {where} was denied ({code}). Check the credentials and region in "
            "storage_options (access_key_id / secret_access_key / region, or the "
            "environment's credentials) and that they may read this bucket."
        )
    if isinstance(exc, oe.BaseError) and not isinstance(exc, oe.NotFoundError):
        return StoreConnectionError(
            f"cannot read from {where}: {_first_line(exc)}. Check that the endpoint is "
            "reachable; retries and timeouts are set with storage_options "
            "retry_config / client_options (e.g. {'timeout': '30s'})."
        )
    if isinstance(exc, not_found):
        hint = _probe(opened)
        return StoreNotFoundError(
            f"no Zarr group at {where}: {hint} Point open_source at the group that holds "
            "the variables (the directory with zarr.json or .zgroup)."
        )
    return exc


def _plain_http_refused(opened: OpenedStore) -> bool:
    """The object store talks to a plain ``http://`` endpoint without ``allow_http``: obstore
    then fails every request with a bare "builder error"."""
    obs = opened.obstore
    if obs is None:
        return False
    config = getattr(obs, "config", None) or {}
    target = str(config.get("endpoint") or getattr(obs, "url", None) or "")
    allowed = str((getattr(obs, "client_options", None) or {}).get("allow_http", "")).lower()
    return target.lower().startswith("http://") and allowed != "true" and (
        os.environ.get("AWS_ALLOW_HTTP", "").lower() != "true")


def _holds_array(opened: OpenedStore) -> bool:
    """Whether the store's root is an array (zarr v2 reports a missing group there)."""
    try:
        zarr.open_array(opened.store, mode="r")
    except Exception:
        return False
    return True


def _probe(opened: OpenedStore) -> str:
    """Why is the group missing: no bucket, or nothing at that prefix?"""
    if opened.obstore is None:
        return "there is no zarr.json or .zgroup there."
    import obstore

    try:
        listing = obstore.list_with_delimiter(opened.obstore)
    except Exception as e:
        code = _s3_code(e)
        if code == "NoSuchBucket" or "NoSuchBucket" in str(e) or "bucket" in str(e).lower():
            return "the bucket does not exist."
        return f"listing it failed too ({type(e).__name__})."
    keys = [o["path"] for o in listing.get("objects", [])][:5]
    prefixes = list(listing.get("common_prefixes", []))[:5]
    if not keys and not prefixes:
        return "nothing is stored under that prefix."
    return f"found no zarr.json there; it holds {keys + prefixes}."


def open_icechunk_store(location: Any, *, branch: str | None = None, tag: str | None = None,
                        snapshot_id: str | None = None,
                        storage_options: Mapping[str, Any] | None = None,
                        virtual_chunk_access: Mapping[str, Any] | None = None) -> OpenedStore:
    """A read-only session of an icechunk repository at a branch, tag or snapshot.

    ``location`` is a local path, ``s3://bucket/prefix`` (options: ``endpoint_url``,
    ``region``, ``access_key_id``, ``secret_access_key``, ``allow_http``...), an
    ``icechunk.Storage`` or an ``icechunk.Repository``. Default: branch ``main``.
    ``virtual_chunk_access`` authorizes reads of virtual chunks (references into NetCDF/HDF5
    files, e.g. written by virtualizarr): ``{url_prefix: None or icechunk credentials}`` for
    the repository's virtual chunk containers (``None``: local files, anonymous or the
    environment's credentials).
    """
    try:
        import icechunk
    except ImportError:
        raise MissingDependencyError("icechunk is not installed: pip install "
                                     "'insitubatch-nodes[icechunk]'") from None
    if sum(x is not None for x in (branch, tag, snapshot_id)) > 1:
        raise StoreError(f"give one of branch/tag/snapshot_id, got branch={branch!r}, "
                         f"tag={tag!r}, snapshot_id={snapshot_id!r}")
    if branch is None and tag is None and snapshot_id is None:
        branch = "main"
    access = _container_credentials(icechunk, virtual_chunk_access)
    if isinstance(location, icechunk.Repository):
        repo, display = location, "icechunk repository"
        if access is not None:
            repo = repo.reopen(authorize_virtual_chunk_access=access)
    else:
        if isinstance(location, icechunk.Storage):
            storage, display = location, "icechunk storage"
        else:
            text = os.fspath(location)
            parts = urlsplit(text)
            display = f"icechunk {redact_url(text)}"
            if parts.scheme == "s3":
                opts = dict(storage_options or {})
                storage = icechunk.s3_storage(bucket=parts.hostname or "",
                                              prefix=parts.path.lstrip("/") or None, **opts)
            elif parts.scheme in ("", "file"):
                path = Path(unquote(parts.path) if parts.scheme == "file" else text)
                if not path.exists():
                    raise StoreNotFoundError(f"no icechunk repository at {str(path)!r}")
                storage = icechunk.local_filesystem_storage(str(path))
            else:
                raise StoreError(f"icechunk location {redact_url(text)!r}: use a local path or "
                                 "s3://bucket/prefix, or pass an icechunk.Storage")
        try:
            repo = icechunk.Repository.open(storage, authorize_virtual_chunk_access=access)
        except Exception as e:
            raise StoreNotFoundError(f"cannot open {display}: {_first_line(e)}") from None
    containers, locked = _virtual_containers(repo, display, access)
    ref = (f"branch {branch!r}" if branch is not None else f"tag {tag!r}" if tag is not None
           else f"snapshot {snapshot_id!r}")
    try:
        session = repo.readonly_session(branch=branch, tag=tag, snapshot_id=snapshot_id)
    except Exception as e:
        known = {"branches": _safe(repo.list_branches), "tags": _safe(repo.list_tags)}
        raise UnknownNameError(f"{ref} not found in {display} ({_first_line(e).strip(' x')}); "
                               f"it has branches {known['branches']} and tags "
                               f"{known['tags']}") from None
    store: Store = session.store
    if containers:  # virtual chunks may be read: their refusals re-worded for humans
        store = VirtualChunkGate(store, f"{display} @ {ref}", containers, locked)
    return OpenedStore(store, f"{display} @ {ref}", snapshot_id=session.snapshot_id)


def _container_credentials(icechunk: Any, access: Mapping[str, Any] | None
                           ) -> dict[str, Any] | None:
    """``virtual_chunk_access`` as icechunk takes it: credentials wrapped per container kind
    (what ``icechunk.containers_credentials`` does), ``None`` kept as ``None``."""
    if access is None:
        return None
    kinds = (icechunk.Credentials.S3, icechunk.Credentials.Gcs, icechunk.Credentials.Azure)
    out: dict[str, Any] = {}
    for prefix, cred in access.items():
        if cred is None or isinstance(cred, kinds):
            out[prefix] = cred
            continue
        try:
            out.update(icechunk.containers_credentials({prefix: cred}))
        except ValueError:
            raise ConfigTypeError(
                f"virtual_chunk_access[{redact_url(prefix)!r}] is a {type(cred).__name__}, not "
                "icechunk credentials: give None (local files, anonymous or the environment's "
                "credentials) or icechunk.s3_credentials(...) / gcs_credentials(...) / "
                "azure_credentials(...)") from None
    return out


def _virtual_containers(repo: Any, display: str, access: Mapping[str, Any] | None
                        ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The repository's virtual chunk container prefixes, and those this session may not
    read; a prefix in ``access`` that names no container is refused (a typo would else only
    show when the first virtual chunk is read)."""
    containers = sorted((repo.config.virtual_chunk_containers or {}).keys())
    unknown = sorted(set(access or ()) - set(containers))
    if unknown:
        raise StoreError(
            f"virtual_chunk_access names {[redact_url(u) for u in unknown]}, but {display} has "
            f"no virtual chunk container with that url prefix; its containers: "
            f"{[redact_url(c) for c in containers]} (set when the repository is written, with "
            "icechunk.RepositoryConfig.set_virtual_chunk_container)")
    authorized = set(repo.authorized_virtual_container_prefixes)
    return tuple(containers), tuple(c for c in containers if c not in authorized)


# What object stores answer to bad credentials, as icechunk passes it on (S3 codes, HTTP).
_DENIED = re.compile(r"\b(AccessDenied|SignatureDoesNotMatch|InvalidAccessKeyId|ExpiredToken|"
                     r"InvalidToken|AuthorizationHeaderMalformed|Forbidden|Unauthorized|403|401)\b")


class VirtualChunkGate(WrapperStore[Any]):
    """An icechunk store whose repository has virtual chunk containers: a virtual chunk read
    that is refused (container not authorized, credentials denied) fails with a
    ``PermissionError`` naming the prefix and what to pass in ``virtual_chunk_access``,
    instead of icechunk's advice about its own API. Other errors pass unchanged."""

    def __init__(self, store: Any, display: str, containers: tuple[str, ...],
                 locked: tuple[str, ...]) -> None:
        super().__init__(store)
        self.display = display
        self.containers = containers  # every container's url prefix
        self.locked = locked  # those not authorized

    def _with_store(self, store: Any) -> VirtualChunkGate:
        return type(self)(store, self.display, self.containers, self.locked)

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        try:
            return await self._store.get(key, prototype, byte_range)
        except Exception as e:
            err = self._explain(key, e)
            if err is None:
                raise
            raise err from None

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]
                                 ) -> list[Buffer | None]:
        key_ranges = list(key_ranges)
        try:
            return await self._store.get_partial_values(prototype, key_ranges)
        except Exception as e:
            err = self._explain(key_ranges[0][0] if key_ranges else "", e)
            if err is None:
                raise
            raise err from None

    def _explain(self, key: str, exc: Exception) -> PermissionError | None:
        """Icechunk's refusal of a virtual chunk, re-worded (else ``None``)."""
        text = str(exc)
        if "virtual reference" in text and (denied := _DENIED.search(text)):
            opened = [redact_url(c) for c in self.containers if c not in self.locked]
            return StoreAccessError(
                f"chunk {key!r} of {self.display} is a virtual reference whose read was denied "
                f"({denied.group(1)}): check the credentials given in virtual_chunk_access for "
                f"{' or '.join(opened) or 'its container'} (icechunk.s3_credentials(...) and "
                "the like; None takes the environment's)")
        if "authorize" not in text:
            return None
        found = re.search(r"url prefix (\S+?),? ", text)
        prefix = found.group(1) if found else None
        prefixes = [prefix] if prefix in self.locked else list(self.locked)
        example = ", ".join(f"{redact_url(p)!r}: None" for p in prefixes)
        return StoreAccessError(
            f"chunk {key!r} of {self.display} is a virtual reference into "
            f"{' or '.join(redact_url(p) for p in prefixes)}, which this session is not "
            f"authorized to read: open it with open_icechunk(..., virtual_chunk_access={{"
            f"{example}}}) (None: local files, anonymous or the environment's credentials; "
            "else icechunk.s3_credentials(...) and the like for that prefix)")


def _safe(fn: Any) -> list[str]:
    try:
        return sorted(fn())
    except Exception:
        return []
