"""Addresses of Python buffers, and host memory from kvx_alloc_host.

kvxfer moves bytes between addresses. Callers pass integers as Mooncake's
pybind11 binding accepts them (int, numpy integer scalars such as np.uint64 or
np.int64, any object with __index__) or, as a kvxfer extension, any object
exposing a contiguous buffer:
bytearray, memoryview, array.array, mmap, bytes (read-only: a source only) and
numpy arrays (numpy is never imported here; arrays are recognised by their
``ctypes.data``/``nbytes`` attributes).

Batch calls take each of their per-entry arguments (addresses, lengths) as
one array handed to C in place (u64_array): a numpy integer array, any
buffer of 64-bit integers, or a list converted in C; no Python code runs
per entry.
"""

from __future__ import annotations

import array
import ctypes
import operator
import sys
import threading

from . import _lib
from ._lib import Closable


def address_of(obj, what: str = "buffer", writable: bool = False) -> tuple[int, int, object]:
    """(address, length in bytes, keep-alive object) of obj.

    obj is an address (length 0 = unknown): an int, a numpy integer scalar
    or any object with __index__; a numpy array (must be C-contiguous); or an
    object with the buffer protocol. The keep-alive object must be held as
    long as the address is used; for writable buffers it is a ctypes view
    that also stops a bytearray from being resized. Raises TypeError naming
    `what` when obj is none of these, when writable is true and obj is
    read-only (bytes), and ValueError for an address outside 0..2**64-1."""
    if isinstance(obj, bool):
        raise TypeError(f"{what}: a bool is not an address or a buffer")
    if isinstance(obj, int):
        return check_address(obj, what), 0, None
    if hasattr(obj, "__array_interface__") and hasattr(obj, "ctypes") and hasattr(obj, "nbytes"):
        flags = getattr(obj, "flags", None)
        if flags is not None and not flags["C_CONTIGUOUS"]:
            raise TypeError(f"{what}: the numpy array is not C-contiguous; pass np.ascontiguousarray(a) or an address")
        return int(obj.ctypes.data), int(obj.nbytes), obj
    if hasattr(type(obj), "__index__"):
        # numpy integer scalars (np.uint64, np.int64, ...) also export a
        # read-only one-element buffer: they are addresses, as in Mooncake.
        return check_address(operator.index(obj), what), 0, None
    if isinstance(obj, bytes):
        if writable:
            raise TypeError(f"{what}: bytes are read-only; register a bytearray, a numpy array or HostBuffer memory")
        addr = ctypes.cast(ctypes.c_char_p(obj), ctypes.c_void_p).value or 0
        return addr, len(obj), obj
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{what}: {type(obj).__name__} is neither an address (int) nor a buffer (bytearray, memoryview, "
            "numpy array, mmap, ...)"
        ) from None
    if not mv.c_contiguous:
        raise TypeError(f"{what}: the buffer is not contiguous")
    n = mv.nbytes
    if mv.readonly:
        raise TypeError(
            f"{what}: the buffer is read-only; pass bytes, a bytearray, a writable memoryview or a numpy array"
        )
    view = (ctypes.c_char * n).from_buffer(mv) if n else None
    return (ctypes.addressof(view) if view is not None else 0), n, (view, mv)


class U64Array:
    """A C uint64_t array made from a batch argument without a per-entry
    Python loop: ``ptr`` (its first element's address, 0 when empty), ``n``
    (elements) and ``keep`` (hold while the pointer is used)."""

    __slots__ = ("ptr", "n", "keep", "_sum")

    def __init__(self, ptr: int, n: int, keep, total=None):
        self.ptr = ptr
        self.n = n
        self.keep = keep
        self._sum = total

    def sum(self) -> int:
        """The elements' sum (computed once, in C where possible)."""
        if self._sum is None:
            np = _numpy()
            if np is not None and self.n:
                a = np.ctypeslib.as_array((ctypes.c_uint64 * self.n).from_address(self.ptr))
                self._sum = int(a.sum(dtype=np.float64))  # a timeout's bytes: no overflow
            else:
                self._sum = sum((ctypes.c_uint64 * self.n).from_address(self.ptr)) if self.n else 0
        return self._sum


def _numpy():
    """numpy when the program already imported it (kvxfer never imports it
    for a caller that does not use it)."""
    return sys.modules.get("numpy")


def u64_array(v, what: str, addresses: bool = False) -> U64Array:
    """v as a C array of uint64_t, without a Python loop over its elements:

    * a numpy integer array (1-D; any integer dtype): np.ascontiguousarray(v,
      dtype=np.uint64), the data pointer passed as is (no copy when v already
      is contiguous uint64); a signed array with a negative element is
      refused (ValueError naming the first such index);
    * any other object with the buffer protocol holding 64-bit integers
      (format Q, L, q or l, or raw bytes whose length is a multiple of 8,
      e.g. array.array('Q')), read in place as unsigned 64-bit values;
    * a list or tuple of ints (or numpy integer scalars, or any __index__
      object), converted in C (array.array('Q')). When addresses is true an
      element may also be a buffer object (kvxfer's extension of Mooncake's
      addresses): such a sequence is converted element by element.

    Raises TypeError naming `what` (and the index of a bad element) for
    anything else, ValueError for a negative or over-64-bit element."""
    if isinstance(v, (list, tuple)):
        keeps: list = []
        try:
            a = array.array("Q", v)
        except (TypeError, OverflowError):
            a = array.array("Q", (_element(x, what, i, addresses, keeps) for i, x in enumerate(v)))
        return U64Array(a.buffer_info()[0] if len(a) else 0, len(a), (a, keeps))
    if hasattr(v, "__array_interface__") and hasattr(v, "dtype"):
        np = _numpy()
    else:
        np = None
    if np is not None:
        if getattr(v, "ndim", 1) != 1:
            raise TypeError(f"{what}: a {v.ndim}-D array; pass a 1-D array (a.ravel())")
        if v.dtype.kind not in "iu":
            raise TypeError(f"{what}: a numpy array of {v.dtype}; want an integer dtype (np.uint64)")
        if v.dtype.kind == "i" and v.size and (v < 0).any():
            i = int(np.argmax(v < 0))
            raise ValueError(f"{what}[{i}]: {int(v[i])} is negative (want 0..2**64-1; a negative value is usually an error code)")
        a = np.ascontiguousarray(v, dtype=np.uint64)
        return U64Array(int(a.ctypes.data) if a.size else 0, int(a.size), a)
    try:
        mv = memoryview(v)
    except TypeError:
        raise TypeError(f"{what}: {type(v).__name__} is not a list, a numpy array or a buffer of 64-bit integers") from None
    if not mv.c_contiguous:
        raise TypeError(f"{what}: the buffer is not contiguous")
    if mv.format in ("Q", "L", "q", "l", "<Q", "<q", "=Q", "=q") and mv.itemsize == 8:
        pass
    elif mv.itemsize == 1 and mv.format in ("B", "b", "c") and mv.nbytes % 8 == 0:
        pass
    else:
        raise TypeError(f"{what}: a buffer of format {mv.format!r} ({mv.nbytes} bytes); want 64-bit integers (format 'Q')")
    n = mv.nbytes // 8
    if n == 0:
        return U64Array(0, 0, mv)
    if mv.readonly:
        addr, _, keep = address_of(bytes(mv) if not isinstance(v, bytes) else v, what)
        return U64Array(addr, n, (keep, v))
    view = (ctypes.c_char * mv.nbytes).from_buffer(mv)
    return U64Array(ctypes.addressof(view), n, (view, mv))


def _element(x, what: str, i: int, addresses: bool, keeps: list) -> int:
    """One element of a batch list: an address or length (or, for
    addresses, a buffer object's address, its keep-alive added to keeps),
    with its index in errors."""
    name = f"{what}[{i}]"
    if addresses:
        addr, _, keep = address_of(x, name)
        if keep is not None:
            keeps.append(keep)
        return addr
    return check_address(as_int(x, name), name)


def check_address(v: int, what: str = "address") -> int:
    """v when it is a valid 64-bit address (0..2**64-1), else ValueError
    naming `what` (a negative number is often a failed call's return code
    used as an address)."""
    if v < 0 or v >= 1 << 64:
        raise ValueError(f"{what}: {v} is not an address (want 0..2**64-1; a negative value is usually an error code)")
    return v


def as_int(v, what: str) -> int:
    """An integer argument (length, capacity, address, batch id) as Mooncake's
    binding converts it: int, numpy integer or any __index__ object; TypeError
    naming `what` otherwise (floats and strings are refused, as pybind11
    does)."""
    if isinstance(v, bool):
        raise TypeError(f"{what}: a bool is not an integer")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{what}: {type(v).__name__} {v!r} is not an integer") from None


class HostBuffer(Closable):
    """Zeroed, shareable host memory from kvx_alloc_host (memfd + mmap), owned
    by the library until close(). Required for buffers moved by the shm
    transport (it shares memory by file descriptor); usable with every
    transport. ``addr`` is the first byte, ``nbytes`` the length (the request
    rounded up to the page size). ``view()`` is a writable memoryview,
    ``numpy(dtype)`` a numpy array over the same memory. Deregister it from
    every engine before close(); close() is idempotent."""

    def __init__(self, nbytes: int, name: str = "kvxfer-py"):
        if nbytes <= 0:
            raise ValueError(f"HostBuffer: nbytes is {nbytes}; want > 0 bytes")
        h = ctypes.c_uint64(0)
        addr = ctypes.c_void_p(0)
        got = ctypes.c_uint64(0)
        _lib.call("kvx_alloc_host", _lib.encode(name), nbytes, ctypes.byref(h), ctypes.byref(addr), ctypes.byref(got))
        self._handle = h.value
        self.addr = int(addr.value)
        self.nbytes = int(got.value)
        self._array = (ctypes.c_char * self.nbytes).from_address(self.addr)
        # Views and numpy arrays reference _array; _array references the
        # buffer, so the memory is not unmapped while a view is alive (unless
        # close() is called explicitly).
        self._array._owner = self

    def view(self) -> memoryview:
        """A writable memoryview of the whole buffer (valid until close)."""
        if self._handle == 0:
            raise ValueError("HostBuffer is closed")
        return memoryview(self._array).cast("B")

    def numpy(self, dtype="uint8", shape=None):
        """A numpy array over the buffer (numpy must be installed)."""
        import numpy as np

        a = np.frombuffer(self.view(), dtype=dtype)
        return a.reshape(shape) if shape is not None else a

    def close(self) -> None:
        """Unmap the memory (kvx_free_host). Idempotent."""
        if self._handle:
            h, self._handle = self._handle, 0
            self._array = None
            _lib.call("kvx_free_host", h)


_cuda_lock = threading.Lock()
_cuda = None  # the driver library, or False when it cannot be used

_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_MEMORYTYPE_DEVICE = 2
_CUDA_ERROR_INVALID_VALUE = 1
_CUDA_ERROR_INVALID_CONTEXT = 201


def _cuda_driver():
    global _cuda
    if _cuda is not None:
        return _cuda
    with _cuda_lock:
        if _cuda is None:
            try:
                drv = ctypes.CDLL("libcuda.so.1")
                drv.cuInit.argtypes = [ctypes.c_uint]
                drv.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
                # The versioned names cuda.h's macros pick, where they exist.
                for name, args in (("cuDevicePrimaryCtxRelease", [ctypes.c_int]),
                                   ("cuCtxPushCurrent", [ctypes.c_void_p]),
                                   ("cuCtxPopCurrent", [ctypes.POINTER(ctypes.c_void_p)])):
                    fn = getattr(drv, name + "_v2", None) or getattr(drv, name)
                    fn.argtypes = args
                    setattr(drv, "kvx_" + name, fn)
                drv.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
                _cuda = drv if drv.cuInit(0) == 0 else False
            except (OSError, AttributeError):
                _cuda = False
    return _cuda


def pointer_location(ptr: int) -> str:
    """"cuda:N" when ptr is CUDA device memory on GPU N, else "host".

    Asks the CUDA driver (cuPointerGetAttribute) when libcuda.so.1 loads and
    has a device; without one every pointer is host memory. Used for SGLang
    KVArgs, whose kv_data_ptrs are device pointers on a GPU server."""
    drv = _cuda_driver()
    if not drv or not ptr:
        return "host"
    mtype = ctypes.c_uint(0)
    rc = drv.cuPointerGetAttribute(ctypes.byref(mtype), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
    if rc == _CUDA_ERROR_INVALID_CONTEXT:
        # No context is current on this thread: ask under device 0's primary
        # context (unified addressing answers for every device there).
        ctx = ctypes.c_void_p(0)
        if drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0:
            try:
                if drv.kvx_cuCtxPushCurrent(ctx) == 0:
                    rc = drv.cuPointerGetAttribute(ctypes.byref(mtype), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
                    drv.kvx_cuCtxPopCurrent(ctypes.byref(ctypes.c_void_p(0)))
            finally:
                drv.kvx_cuDevicePrimaryCtxRelease(0)
    if rc == _CUDA_ERROR_INVALID_VALUE:
        return "host"  # not memory CUDA knows: plain host memory
    if rc != 0:
        raise RuntimeError(
            f"kvxfer: cuPointerGetAttribute({ptr:#x}) failed with CUDA error {rc}; cannot tell host from device "
            "memory: set KVArgs.kv_location to 'host' or 'cuda:N'"
        )
    if mtype.value != _CU_MEMORYTYPE_DEVICE:
        return "host"
    ordinal = ctypes.c_int(0)
    if drv.cuPointerGetAttribute(ctypes.byref(ordinal), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr) != 0:
        return "cuda:0"
    return f"cuda:{ordinal.value}"
