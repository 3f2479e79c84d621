"""The ways a stripe's stored chunks reach memory: the one picked per array, and its cache.

``StripeReader`` picks one when it is built (``read_path_for``) instead of switching on a mode
string at every read. Each path knows how to get a stripe's stored bytes (a file read on a
pool thread, obstore's async get, zarr's store API, or zarr's own ``getitem`` when we do not
decode the chain) and whether several stripes can share one pool task; the reader keeps the
keys, the decoding into the stripe buffer, and the retries. The paths live one per module
(``local_files``, ``async_gets``, ``cached_gets``, ``zarr_getitem``; their interface in
``read_path_base``) and are importable from here as before.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import zarr
import zarr.storage
from zarr.abc.store import Store
from zarr.core.metadata import ArrayV2Metadata
from zarr.storage import StorePath

from .async_gets import AsyncGets, ObjectStoreGets, ZarrStoreGets
from .cached_gets import CachedGets
from .chunk_cache import CacheScope, ChunkCache
from .local_files import LocalFiles
from .read_path_base import FrameCheck, Frames, ReadPath
from .zarr_getitem import CachedGetitem, CachingStore, ZarrGetitem

__all__ = ["CachedGets", "FrameCheck", "Frames", "LocalFiles", "ObjectStoreGets", "ReadPath",
           "cached", "read_path_for", "stable_name", "store_place"]

log = logging.getLogger("insitubatch_nodes")


# Where obstore takes an endpoint or an account from when the store's options do not say.
_PLACE_ENV = {"S3Store": (("endpoint", ("AWS_ENDPOINT_URL", "AWS_ENDPOINT")),),
              "AzureStore": (("endpoint", ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT")),
                             ("account_name", ("AZURE_STORAGE_ACCOUNT_NAME",
                                               "AZURE_STORAGE_ACCOUNT"))),
              "GCSStore": ()}


def store_place(store: Any) -> str:
    """What besides its URL says which server and account an obstore store reads (its
    endpoint, an Azure account), given in its options or taken from the environment as
    obstore does: a bucket of one name on MinIO and on AWS must not share cache entries."""
    config = {str(k).lower(): v for k, v in (getattr(store, "config", None) or {}).items()}
    place = ""
    for field, names in _PLACE_ENV.get(type(store).__name__, ()):
        value = config.get(field) or next((os.environ[n] for n in names if os.environ.get(n)),
                                          None)
        if value:
            place += f" at {value}" if field == "endpoint" else f" {field} {value}"
    if "endpoint" in config and type(store).__name__ not in _PLACE_ENV:
        place += f" at {config['endpoint']}"
    return place


def stable_name(url: str) -> bool:
    """Whether a store's name says which store it is across objects and processes: a URL,
    not a memory store's ``memory://<id>`` or an object's repr (``<IcechunkStore object at
    0x...>``, ``<FsspecStore(...)>``, which names neither endpoint nor snapshot)."""
    return not (url.startswith(("memory://", "<")) or " object at 0x" in url)


def cached(path: ReadPath, cache: ChunkCache, scope: CacheScope) -> ReadPath:
    """``path`` with its store reads through ``cache``; local files are never cached (their
    chunks are on local disk already). zarr's own ``getitem`` reads (chains we do not
    decode, sharding among them) go through a ``CachingStore``."""
    if isinstance(path, (CachedGets, CachedGetitem)):
        return path
    if not stable_name(scope.url):
        # A memory store's chunks are in memory already, and its name (``memory://<id>``)
        # is no place: another store may have the same id later or in another process; so
        # is a store object known only by its repr (``<... object at 0x...>``).
        log.info("insitubatch: chunks of %s are not cached: it has no name that stays its "
                 "own (open it by URL to cache it)", scope.url)
        return path
    gets = path.gets if isinstance(path, ZarrGetitem) else path
    if isinstance(gets, ObjectStoreGets):  # the same bucket name on another server
        place = store_place(gets.store)
        if place:
            scope = CacheScope.of(f"{scope.url}{place}", scope.snapshot_id)
    if isinstance(path, AsyncGets):
        return CachedGets(path, cache, scope)
    if isinstance(path, ZarrGetitem):
        arr = path.arr
        store = CachingStore(arr.store_path.store, cache, scope)
        return CachedGetitem(_on_store(arr, store), CachedGets(path.gets, cache, scope), store)
    return path


def _on_store(arr: zarr.Array, store: Store) -> zarr.Array:
    """``arr`` (its metadata, path and config) read through ``store``."""
    where, meta = StorePath(store, arr.store_path.path), arr.metadata
    config = arr.async_array.config
    if isinstance(meta, ArrayV2Metadata):  # one call per format: zarr's overloads are per format
        return zarr.Array(zarr.AsyncArray(meta, where, config))
    return zarr.Array(zarr.AsyncArray(meta, where, config))


def read_path_for(arr: zarr.Array, decodes: bool) -> ReadPath:
    """The path for ``arr``'s store; ``decodes``: our ``ChunkDecoder`` takes its chain (else
    zarr's ``getitem`` reads it, whatever the store)."""
    store = arr.store_path.store
    gets: AsyncGets
    if isinstance(store, zarr.storage.ObjectStore):
        gets = ObjectStoreGets(store.store)
    else:
        gets = ZarrStoreGets(store)
    if not decodes:
        return ZarrGetitem(arr, gets)
    if isinstance(store, zarr.storage.LocalStore):
        return LocalFiles(Path(store.root))
    return gets
