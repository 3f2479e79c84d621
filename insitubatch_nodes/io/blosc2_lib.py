"""Blosc frames decoded by c-blosc2 with one decompression context per decode thread.

numcodecs' ``blosc.decompress`` (c-blosc 1) builds a fresh context for every chunk (a
zstd frame's context is ~100 kB set up and freed each time) and python-blosc2's
``decompress`` either holds the GIL or, with ``set_releasegil``, serializes every thread on
c-blosc2's global context. c-blosc2's own ``blosc2_decompress_ctx`` on a context kept per
thread does neither: 1.03-1.22x numcodecs per chunk on one thread and on two
(``benchmarks/bench_decoders.py``, DESIGN.md "Decoders"). It decodes c-blosc 1 frames
too, but is laxer with a damaged header, so only frames whose header is as c-blosc 1
writes it are given to it (``blosc_frame.written_by_blosc1``); the rest go to numcodecs. The library
is the one the python-blosc2 wheel ships for other packages to link against
(``blosc2/lib``, with its headers and CMake files); it is opened with ctypes, which
releases the GIL for each call, and never imported as a Python module.
"""

from __future__ import annotations

import ctypes
import importlib.util
import struct
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import LocalFileError
from .blosc_frame import written_by_blosc1
from .partial.ranges import Ranges

if TYPE_CHECKING:
    from typing_extensions import Buffer

_MAJORS = ("2", "3")  # c-blosc2 versions whose blosc2_dparams _DParams matches
_NAMES = {"linux": ("libblosc2.so",), "darwin": ("libblosc2.dylib",),
          "win32": ("libblosc2.dll", "blosc2.dll")}


class _DParams(ctypes.Structure):
    """``blosc2_dparams`` (blosc2.h): passed by value; c-blosc2 2.x reads the fields before
    ``typesize``, which 3.x added at the end."""

    _fields_ = [("nthreads", ctypes.c_int16), ("schunk", ctypes.c_void_p),
                ("postfilter", ctypes.c_void_p), ("postparams", ctypes.c_void_p),
                ("typesize", ctypes.c_int32)]


class _Lib:
    """The opened library and its per-thread contexts."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        lib.blosc2_get_version_string.restype = ctypes.c_char_p
        lib.blosc2_get_version_string.argtypes = []
        self.version = lib.blosc2_get_version_string().decode()
        major = self.version.split(".")[0]
        if major not in _MAJORS:  # another major may lay out blosc2_dparams otherwise
            raise LocalFileError(f"{path} is c-blosc2 {self.version}; this binding knows majors "
                                 f"{', '.join(_MAJORS)} (numcodecs decodes blosc instead)")
        lib.blosc2_init.restype = None
        lib.blosc2_init.argtypes = []
        lib.blosc2_create_dctx.restype = ctypes.c_void_p
        lib.blosc2_create_dctx.argtypes = [_DParams]
        lib.blosc2_free_ctx.restype = None
        lib.blosc2_free_ctx.argtypes = [ctypes.c_void_p]
        lib.blosc2_decompress_ctx.restype = ctypes.c_int
        lib.blosc2_decompress_ctx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                                              ctypes.c_void_p, ctypes.c_int32]
        lib.blosc2_getitem_ctx.restype = ctypes.c_int
        lib.blosc2_getitem_ctx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                                           ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_int32]
        lib.blosc2_init()
        self.path = path
        self._lib = lib
        self._decompress = lib.blosc2_decompress_ctx
        self._getitem = lib.blosc2_getitem_ctx
        self._local = threading.local()

    def decompress_into(self, data: Buffer, out: np.ndarray) -> bool:
        """Decode the blosc frame ``data`` into ``out`` (C-contiguous); True when it filled
        ``out`` exactly. False for anything else (an error, another size, a codec this build
        lacks): the caller hands the frame to numcodecs, which decides."""
        view = memoryview(data)
        n, size = view.nbytes, out.nbytes
        if not out.flags.c_contiguous or n > _MAX or size > _MAX or n < 16:
            return False
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if not written_by_blosc1(view, size):
            return False
        ctx = self._context()
        # Addresses without numpy's __array_interface__ dicts (~1 us each, per chunk, while
        # holding the GIL): ctypes takes bytes as they are and views a writable buffer.
        src = data if isinstance(data, bytes) else _address(data)
        if self._decompress(ctx.ptr, src, n, _address(out), size) == size:
            return True
        # Whatever state a failed frame left in the context is not carried to the next.
        self._local.ctx = None
        return False


    def _context(self) -> _Context:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._local.ctx = _Context(self._lib)
        return ctx

    def decode_ranges(self, frame: memoryview, out: np.ndarray, ranges: Ranges,
                      typesize: int) -> bool:
        """Decode the decoded-byte ``ranges`` of the blosc frame ``frame`` (bytes; its
        header checked by the caller, ``blocks.parse_header``) into the same bytes of
        ``out`` (C-contiguous), one ``blosc2_getitem_ctx`` each: only the blocks holding
        them are decoded. Ranges are whole items of ``typesize``. True when each filled
        exactly; False on any error (the caller decides what a failure means)."""
        n = frame.nbytes
        if not out.flags.c_contiguous or n > _MAX or out.nbytes > _MAX:
            return False
        ctx = self._context()
        base = _address(out)
        src = _address(frame)
        for lo, hi in ranges:
            size = hi - lo
            if self._getitem(ctx.ptr, src, n, lo // typesize, size // typesize, base + lo,
                             size) != size:
                self._local.ctx = None  # a failed frame's state is not carried on
                return False
        return True

    def decode_bounded(self, frame: memoryview, out: np.ndarray, ranges: Ranges,
                       ends: tuple[int, ...], typesize: int) -> int | None:
        """``decode_ranges`` of a frame only partly read (``partial.sparse.LaidOutFrame``:
        writable, its unread bytes stale), each range (within one block) bounded by the end
        ``ends[i]`` of its block's bytes: c-blosc2 reads nothing past the size it is given,
        and refuses a size below the header's, so the header says that end while the block
        decodes (restored after). The index of the first range that did not fill exactly,
        ``None`` when all did."""
        n = frame.nbytes
        if not out.flags.c_contiguous or n > _MAX or out.nbytes > _MAX or n < 16:
            return 0
        ctx = self._context()
        base, src = _address(out), _address(frame)
        cbytes = _CBYTES.unpack_from(frame, 12)[0]
        try:
            for i, ((lo, hi), end) in enumerate(zip(ranges, ends, strict=True)):
                size = hi - lo
                _CBYTES.pack_into(frame, 12, end)
                if self._getitem(ctx.ptr, src, end, lo // typesize, size // typesize,
                                 base + lo, size) != size:
                    self._local.ctx = None  # a failed frame's state is not carried on
                    return i
        finally:
            _CBYTES.pack_into(frame, 12, cbytes)
        return None


_CBYTES = struct.Struct("<i")  # a blosc header's frame size, at byte 12


def _address(buf: object) -> int:
    """Where a C-contiguous buffer's bytes start (read-only ones through numpy)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))  # type: ignore[arg-type]  # an ndarray too
    except (TypeError, ValueError):  # read-only, or empty
        return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)  # type: ignore[call-overload]  # any buffer works


_MAX = 0x7FFFFFFF  # c-blosc2 takes int32 sizes


class _Context:
    """One thread's decompression context, freed with the thread's local data."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._free = lib.blosc2_free_ctx
        self.ptr = lib.blosc2_create_dctx(_DParams(nthreads=1, typesize=8))
        if not self.ptr:
            raise MemoryError("c-blosc2 could not create a decompression context")

    def __del__(self) -> None:
        # not contextlib.suppress: at interpreter shutdown module globals may be gone already
        try:  # noqa: SIM105
            self._free(self.ptr)
        except Exception:
            pass


_lock = threading.Lock()
_loaded: list[_Lib | None] = []  # [] until tried once; then [the library or None]


def library_path() -> Path | None:
    """Where the installed python-blosc2 wheel keeps its shared c-blosc2 library, without
    importing the package (its import pulls in numexpr and more); ``None`` if not found."""
    try:
        spec = importlib.util.find_spec("blosc2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        for name in _NAMES.get(sys.platform, ()):
            path = Path(root) / "lib" / name
            if path.is_file():
                return path
    return None


def load() -> _Lib | None:
    """The c-blosc2 library (opened once per process), or ``None`` where python-blosc2 is not
    installed or its library does not open: numcodecs decodes blosc then."""
    with _lock:
        if not _loaded:
            path = library_path()
            lib = None
            if path is not None:
                try:
                    lib = _Lib(path)
                except (OSError, AttributeError, ValueError):
                    lib = None
            _loaded.append(lib)
        return _loaded[0]
