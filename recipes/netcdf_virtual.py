"""Train from NetCDF files in place: virtualizarr writes references to their HDF5 chunks
into an icechunk repository, and the loader reads those byte ranges as they are stored.

    python recipes/netcdf_virtual.py     # in an empty folder: writes t2m.nc and t2m-virtual/

Needs the ``virtual`` extra (virtualizarr, icechunk, h5netcdf). Values are served as stored
(no CF masking or scaling).
"""

import shutil
import warnings
from pathlib import Path

import icechunk
import numpy as np
import xarray as xr
from obspec_utils.registry import ObjectStoreRegistry
from obstore.store import LocalStore
from virtualizarr import open_virtual_dataset
from virtualizarr.parsers import HDFParser

import insitubatch_nodes as ib

nc = Path("t2m.nc").resolve()   # as archives write them: shuffle + zlib, a chunk per step
time = np.arange("2020-01-01", "2020-01-17", dtype="datetime64[D]").astype("datetime64[ns]")
xr.Dataset({"t2m": (("time", "lat", "lon"), np.random.rand(16, 32, 64).astype("float32"))},
           coords={"time": time}).to_netcdf(nc, engine="h5netcdf", encoding={
               "t2m": {"zlib": True, "shuffle": True, "chunksizes": (1, 32, 64)}})

prefix = f"file://{nc.parent}/"
with warnings.catch_warnings():   # zarr: HDF5's filters are not Zarr v3 codecs
    warnings.filterwarnings("ignore", "Numcodecs codecs are not in the Zarr version 3")
    vds = open_virtual_dataset(f"file://{nc}", parser=HDFParser(),
                               registry=ObjectStoreRegistry({"file://": LocalStore()}))
config = icechunk.RepositoryConfig.default()   # the file's folder: a virtual chunk container
config.set_virtual_chunk_container(
    icechunk.VirtualChunkContainer(prefix, icechunk.local_filesystem_store(str(nc.parent))))
shutil.rmtree("t2m-virtual", ignore_errors=True)   # a repository is created in an empty place
repo = icechunk.Repository.create(icechunk.local_filesystem_storage("t2m-virtual"), config)
session = repo.writable_session("main")
vds.vz.to_icechunk(session.store)
session.commit("virtual references to t2m.nc")

source = ib.open_icechunk("t2m-virtual", virtual_chunk_access={prefix: None})
splits = ib.split_by_coordinate(source, {"train": (None, "2020-01-12"),
                                         "val": ("2020-01-14", None)})
for batch in ib.build_loader(source, splits, "train", batch_size=4):
    assert batch["t2m"].shape == (4, 32, 64)   # each read a byte range of t2m.nc
