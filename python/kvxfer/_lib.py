"""ctypes binding of libkvxfer.so (include/kvxfer.h): loading, structs,
prototypes, status codes and the error type.

Everything here mirrors the C header one to one; the public classes live in
kvxfer.engine (Mooncake-compatible TransferEngine) and kvxfer.sglang
(SGLang-shaped KV classes). tests/test_abi.py compiles a C program against
the header and checks every struct size and field offset below.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from ctypes import (
    POINTER,
    Structure,
    c_char_p,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
)

#: Environment variable naming the library file (first place searched).
LIBRARY_ENV = "KVXFER_LIBRARY"
#: File names looked for in the package directory and on the linker path.
LIBRARY_NAMES = ("libkvxfer.so", "libkvxfer.so.0")
#: The C ABI major version this package speaks (KVX_VERSION_MAJOR).
ABI_MAJOR = 0

# ---------------------------------------------------------------------------
# Status codes (kvx_status). Values are stable; new ones are only appended.
# ---------------------------------------------------------------------------
OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_BAD_HANDLE = 2
ERR_BUFFER_TOO_SMALL = 3
ERR_UNAVAILABLE = 4
ERR_UNSUPPORTED_MEMORY = 5
ERR_NOT_REGISTERED = 6
ERR_UNKNOWN_REGION = 7
ERR_OUT_OF_BOUNDS = 8
ERR_BUSY = 9
ERR_TIMEOUT = 10
ERR_CLOSED = 11
ERR_PEER_LOST = 12
ERR_CANCELED = 13
ERR_TRANSFER_FAILED = 14
ERR_BOOTSTRAP = 15
ERR_ROOM_MISMATCH = 16
ERR_NOT_SUPPORTED = 17
ERR_INTERNAL = 18
ERR_NOT_FOUND = 19
ERR_METADATA = 20

STATUS_NAMES = {
    OK: "KVX_OK",
    ERR_INVALID_ARGUMENT: "KVX_ERR_INVALID_ARGUMENT",
    ERR_BAD_HANDLE: "KVX_ERR_BAD_HANDLE",
    ERR_BUFFER_TOO_SMALL: "KVX_ERR_BUFFER_TOO_SMALL",
    ERR_UNAVAILABLE: "KVX_ERR_UNAVAILABLE",
    ERR_UNSUPPORTED_MEMORY: "KVX_ERR_UNSUPPORTED_MEMORY",
    ERR_NOT_REGISTERED: "KVX_ERR_NOT_REGISTERED",
    ERR_UNKNOWN_REGION: "KVX_ERR_UNKNOWN_REGION",
    ERR_OUT_OF_BOUNDS: "KVX_ERR_OUT_OF_BOUNDS",
    ERR_BUSY: "KVX_ERR_BUSY",
    ERR_TIMEOUT: "KVX_ERR_TIMEOUT",
    ERR_CLOSED: "KVX_ERR_CLOSED",
    ERR_PEER_LOST: "KVX_ERR_PEER_LOST",
    ERR_CANCELED: "KVX_ERR_CANCELED",
    ERR_TRANSFER_FAILED: "KVX_ERR_TRANSFER_FAILED",
    ERR_BOOTSTRAP: "KVX_ERR_BOOTSTRAP",
    ERR_ROOM_MISMATCH: "KVX_ERR_ROOM_MISMATCH",
    ERR_NOT_SUPPORTED: "KVX_ERR_NOT_SUPPORTED",
    ERR_INTERNAL: "KVX_ERR_INTERNAL",
    ERR_NOT_FOUND: "KVX_ERR_NOT_FOUND",
    ERR_METADATA: "KVX_ERR_METADATA",
}

ROLE_PREFILL = 0
ROLE_DECODE = 1

# kvx_transfer_state
TRANSFER_EMPTY = 0
TRANSFER_PENDING = 1
TRANSFER_COMPLETED = 2
TRANSFER_FAILED = 3
TRANSFER_CANCELED = 4

# KVX_REGION_PEER_ADDRESS: remote_offset is a virtual address in the peer.
REGION_PEER_ADDRESS = 0xFFFFFFFF

KV_CONFIG_SIZE_V1 = 96
KV_CONFIG_SIZE_V2 = 216
KV_CONFIG_SIZE_V3 = 232
KV_CONFIG_SIZE_V4 = 240
KV_CONFIG_SIZE_V5 = 256

# kvx_kv_config.control_auth values (KVX_CONTROL_AUTH_*).
CONTROL_AUTH_ENV = 0
CONTROL_AUTH_ON = 1
CONTROL_AUTH_OFF = 2
ENGINE_CONFIG_SIZE_V1 = 40


# ---------------------------------------------------------------------------
# Structs (field for field as in include/kvxfer.h)
# ---------------------------------------------------------------------------
class EngineConfig(Structure):
    """kvx_engine_config."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("role", c_int32),
        ("transport", c_char_p),
        ("listen_host", c_char_p),
        ("bootstrap_addr", c_char_p),
        ("listen_port", c_uint16),
        ("reserved0", c_uint16),
        ("streams", c_uint32),
        ("local_hostname", c_char_p),
        ("metadata_server", c_char_p),
        ("segment_name", c_char_p),
        ("rpc_timeout_ms", c_uint32),
        ("reserved1", c_uint32),
        ("devices", c_char_p),
    ]


class WriteRequest(Structure):
    """kvx_write_request (48 bytes)."""

    _fields_ = [
        ("local_addr", c_uint64),
        ("remote_offset", c_uint64),
        ("length", c_uint64),
        ("local_stride", c_uint64),
        ("remote_stride", c_uint64),
        ("remote_region", c_uint32),
        ("count", c_uint32),
    ]


class TransferStatus(Structure):
    """kvx_transfer_status."""

    _fields_ = [("state", c_int32), ("error", c_int32), ("bytes_done", c_uint64)]


class RegionInfo(Structure):
    """kvx_region_info: one region of a peer's segment descriptor."""

    _fields_ = [("addr", c_uint64), ("length", c_uint64), ("region", c_uint32), ("kind", c_int32)]


class KVConfig(Structure):
    """kvx_kv_config."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("page_size", c_uint32),
        ("model", c_char_p),
        ("num_layers", c_uint32),
        ("num_kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("dtype_bytes", c_uint32),
        ("num_pages", c_uint32),
        ("tp_size", c_uint32),
        ("tp_rank", c_uint32),
        ("pp_size", c_uint32),
        ("pp_rank", c_uint32),
        ("dp_size", c_uint32),
        ("dp_rank", c_uint32),
        ("checksum", c_uint32),
        ("kv_cache_dtype", c_char_p),
        ("control_host", c_char_p),
        ("control_port", c_uint16),
        ("reserved0", c_uint16),
        ("bootstrap_timeout_ms", c_uint32),
        ("waiting_timeout_ms", c_uint32),
        ("reserved1", c_uint32),
        ("num_kv_buffers", c_uint32),
        ("num_aux_buffers", c_uint32),
        ("kv_data_ptrs", POINTER(c_uint64)),
        ("kv_data_lens", POINTER(c_uint64)),
        ("kv_item_lens", POINTER(c_uint64)),
        ("aux_data_ptrs", POINTER(c_uint64)),
        ("aux_data_lens", POINTER(c_uint64)),
        ("aux_item_lens", POINTER(c_uint64)),
        ("num_state_buffers", c_uint32),
        ("kv_head_num", c_uint32),
        ("state_data_ptrs", POINTER(c_uint64)),
        ("state_data_lens", POINTER(c_uint64)),
        ("state_item_lens", POINTER(c_uint64)),
        ("total_kv_head_num", c_uint32),
        ("is_mla", c_uint32),
        ("prefill_start_layer", c_uint32),
        ("system_dp_rank", c_uint32),
        ("kv_location", c_char_p),
        ("ib_device", c_char_p),
        ("bootstrap_auth_token", c_char_p),
        ("advertise_host", c_char_p),
        ("control_auth", c_uint32),
        ("max_peers", c_uint32),
        ("decode_allocation_policy", c_char_p),
        ("dsv41_spec_layout", c_char_p),
        ("prefill_http_port", c_uint32),
        ("reserved2", c_uint32),
    ]


class KVLayout(Structure):
    """kvx_kv_layout."""

    _fields_ = [
        ("item_len", c_uint64),
        ("buffer_len", c_uint64),
        ("pool_len", c_uint64),
        ("num_buffers", c_uint32),
        ("num_pages", c_uint32),
        ("page_size", c_uint32),
        ("reserved", c_uint32),
    ]


class TransferMetric(Structure):
    """kvx_transfer_metric."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("prefix_tokens", c_uint32),
        ("latency_us", c_uint64),
        ("bytes", c_uint64),
        ("aux_bytes", c_uint64),
        ("skipped_bytes", c_uint64),
        ("pages", c_uint32),
        ("reserved", c_uint32),
    ]


class AgentConfig(Structure):
    """kvx_agent_config."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("control_port", c_uint32),
        ("name", c_char_p),
        ("transport", c_char_p),
        ("local_hostname", c_char_p),
        ("timeout_ms", c_uint32),
        ("drain_timeout_ms", c_uint32),
        ("transfer_timeout_ms", c_uint32),
        ("max_notifs", c_uint32),
    ]


class AgentDesc(Structure):
    """kvx_agent_desc (24 bytes): NIXL's (addr, len, dev_id)."""

    _fields_ = [("addr", c_uint64), ("len", c_uint64), ("device", c_int32), ("reserved", c_uint32)]


class XferTelemetry(Structure):
    """kvx_xfer_telemetry (40 bytes, microseconds)."""

    _fields_ = [
        ("start_us", c_int64),
        ("post_us", c_int64),
        ("xfer_us", c_int64),
        ("total_bytes", c_uint64),
        ("desc_count", c_uint64),
    ]


# kvx_agent memory kinds, operations and transfer states.
AGENT_MEM_DRAM = 0
AGENT_MEM_VRAM = 1
XFER_WRITE = 0
XFER_READ = 1
XFER_NOT_POSTED = 0
XFER_PROC = 1
XFER_DONE = 2
XFER_ERR = 3
XFER_CANCELED = 4
AGENT_LOCAL = "NIXL_INIT_AGENT"


#: C struct name for each ctypes struct (used by the ABI test).
C_STRUCTS = {
    "kvx_engine_config": EngineConfig,
    "kvx_write_request": WriteRequest,
    "kvx_transfer_status": TransferStatus,
    "kvx_region_info": RegionInfo,
    "kvx_kv_config": KVConfig,
    "kvx_kv_layout": KVLayout,
    "kvx_transfer_metric": TransferMetric,
    "kvx_agent_config": AgentConfig,
    "kvx_agent_desc": AgentDesc,
    "kvx_xfer_telemetry": XferTelemetry,
}

u64p = POINTER(c_uint64)
i32p = POINTER(c_int32)

# name: (restype, argtypes). Every function returns an int kvx_status unless
# the restype says otherwise.
_PROTOTYPES = {
    "kvx_version": (c_char_p, []),
    "kvx_strerror": (c_char_p, [c_int]),
    "kvx_last_error": (c_char_p, []),
    "kvx_bootstrap_start": (c_int, [c_char_p, c_uint16, u64p]),
    "kvx_bootstrap_addr": (c_int, [c_uint64, c_char_p, c_size_t, POINTER(c_size_t)]),
    "kvx_room_timeline": (c_int, [c_uint64, c_char_p, c_size_t, POINTER(c_size_t)]),
    "kvx_bootstrap_stop": (c_int, [c_uint64]),
    "kvx_metadata_server_start": (c_int, [c_char_p, c_uint16, u64p]),
    "kvx_metadata_server_addr": (c_int, [c_uint64, c_char_p, c_size_t, POINTER(c_size_t)]),
    "kvx_metadata_server_stop": (c_int, [c_uint64]),
    "kvx_engine_create": (c_int, [POINTER(EngineConfig), u64p]),
    "kvx_engine_destroy": (c_int, [c_uint64]),
    "kvx_engine_transport": (c_int, [c_uint64, c_char_p, c_size_t, POINTER(c_size_t)]),
    "kvx_engine_rpc_port": (c_int, [c_uint64, POINTER(c_uint16)]),
    "kvx_engine_segment_name": (c_int, [c_uint64, c_char_p, c_size_t, POINTER(c_size_t)]),
    "kvx_alloc_host": (c_int, [c_char_p, c_uint64, u64p, POINTER(c_void_p), u64p]),
    "kvx_free_host": (c_int, [c_uint64]),
    "kvx_register_memory": (c_int, [c_uint64, c_void_p, c_uint64, c_char_p, POINTER(c_uint32)]),
    "kvx_pointer_device": (c_int, [c_void_p, POINTER(c_int)]),
    "kvx_deregister_memory": (c_int, [c_uint64, c_uint32]),
    "kvx_segment_open_name": (c_int, [c_uint64, c_char_p, u64p]),
    "kvx_segment_regions": (c_int, [c_uint64, POINTER(RegionInfo), c_uint32, POINTER(c_uint32)]),
    "kvx_segment_refresh": (c_int, [c_uint64]),
    "kvx_segment_close": (c_int, [c_uint64]),
    "kvx_segment_read": (c_int, [c_uint64, POINTER(WriteRequest), c_uint32, c_uint32]),
    "kvx_batch_alloc": (c_int, [c_uint64, c_uint32, u64p]),
    "kvx_batch_submit": (c_int, [c_uint64, POINTER(WriteRequest), c_uint32]),
    "kvx_batch_submit_read": (c_int, [c_uint64, POINTER(WriteRequest), c_uint32]),
    "kvx_metrics_text": (c_int, [c_char_p, c_size_t, POINTER(c_size_t)]),
    "kvx_batch_submit_soa": (c_int, [c_uint64, c_uint32, c_void_p, c_void_p, c_void_p, c_uint32]),
    "kvx_segment_write_soa": (c_int, [c_uint64, c_uint32, c_void_p, c_void_p, c_void_p, c_uint32, c_uint32]),
    "kvx_segment_read_soa": (c_int, [c_uint64, c_uint32, c_void_p, c_void_p, c_void_p, c_uint32, c_uint32]),
    "kvx_batch_submit_read_soa": (c_int, [c_uint64, c_uint32, c_void_p, c_void_p, c_void_p, c_uint32]),
    "kvx_batch_status": (c_int, [c_uint64, c_uint32, POINTER(TransferStatus)]),
    "kvx_batch_wait": (c_int, [c_uint64, c_uint32]),
    "kvx_batch_cancel": (c_int, [c_uint64]),
    "kvx_batch_free": (c_int, [c_uint64]),
    "kvx_kv_create": (c_int, [c_uint64, POINTER(KVConfig), u64p]),
    "kvx_kv_destroy": (c_int, [c_uint64]),
    "kvx_kv_layout_get": (c_int, [c_uint64, POINTER(KVLayout)]),
    "kvx_kv_transports": (c_int, [c_uint64, c_char_p, c_size_t, POINTER(c_size_t)]),
    "kvx_kv_sender_create": (c_int, [c_uint64, c_uint64, u64p]),
    "kvx_kv_sender_init_aux": (c_int, [c_uint64, c_uint32, c_int64]),
    "kvx_kv_sender_prefix_len": (c_int, [c_uint64, POINTER(c_uint32)]),
    "kvx_kv_sender_mark_prefill_complete": (c_int, [c_uint64]),
    "kvx_kv_sender_state": (c_int, [c_uint64, i32p, c_uint32]),
    "kvx_kv_sender_send": (c_int, [c_uint64, i32p, c_uint32, c_int]),
    "kvx_kv_sender_send_layers": (c_int, [c_uint64, i32p, c_uint32, c_uint32, c_uint32, c_void_p]),
    "kvx_kv_sender_flush": (c_int, [c_uint64, c_uint32]),
    "kvx_kv_receiver_create_dp": (c_int, [c_uint64, c_char_p, c_uint64, c_int32, u64p]),
    "kvx_kv_receiver_send_metadata": (
        c_int,
        [c_uint64, i32p, c_uint32, c_int64, i32p, c_uint32, c_uint32],
    ),
    "kvx_kv_receiver_aux_row": (c_int, [c_uint64, c_uint32, c_void_p, c_size_t, POINTER(c_size_t)]),
    "kvx_kv_metric": (c_int, [c_uint64, POINTER(TransferMetric)]),
    "kvx_kv_set_tokens": (c_int, [c_uint64, c_uint32]),
    "kvx_kv_poll": (c_int, [c_uint64, i32p]),
    "kvx_kv_wait": (c_int, [c_uint64, c_int32, c_uint32, i32p]),
    "kvx_kv_failure": (c_int, [c_uint64]),
    "kvx_kv_abort": (c_int, [c_uint64]),
    "kvx_kv_close": (c_int, [c_uint64]),
    "kvx_agent_create": (c_int, [POINTER(AgentConfig), u64p]),
    "kvx_agent_destroy": (c_int, [c_uint64]),
    "kvx_agent_metadata": (c_int, [c_uint64, c_void_p, c_size_t, POINTER(c_size_t)]),
    "kvx_agent_register": (c_int, [c_uint64, c_uint32, POINTER(AgentDesc), c_uint32, u64p]),
    "kvx_agent_deregister": (c_int, [c_uint64, c_uint64]),
    "kvx_agent_add_remote": (c_int, [c_uint64, c_void_p, c_size_t, c_char_p, c_size_t, POINTER(c_size_t)]),
    "kvx_agent_remove_remote": (c_int, [c_uint64, c_char_p]),
    "kvx_agent_prep_dlist": (c_int, [c_uint64, c_char_p, c_uint32, POINTER(AgentDesc), c_uint32, u64p]),
    "kvx_agent_release_dlist": (c_int, [c_uint64, c_uint64]),
    "kvx_agent_make_xfer": (
        c_int,
        [c_uint64, c_uint32, c_uint64, c_void_p, c_uint64, c_void_p, c_uint32, c_void_p, c_size_t, u64p],
    ),
    "kvx_agent_post": (c_int, [c_uint64, c_uint64, c_void_p, c_size_t, i32p]),
    "kvx_agent_xfer_state": (c_int, [c_uint64, c_uint64, i32p]),
    "kvx_agent_xfer_wait": (c_int, [c_uint64, c_uint64, c_uint32, i32p]),
    "kvx_agent_xfer_cancel": (c_int, [c_uint64, c_uint64, i32p]),
    "kvx_agent_xfer_release": (c_int, [c_uint64, c_uint64]),
    "kvx_agent_xfer_telemetry": (c_int, [c_uint64, c_uint64, POINTER(XferTelemetry)]),
    "kvx_agent_send_notif": (c_int, [c_uint64, c_char_p, c_void_p, c_size_t]),
    "kvx_agent_get_notifs": (c_int, [c_uint64, c_void_p, c_size_t, POINTER(c_size_t)]),
}


class LibraryNotFoundError(ImportError):
    """libkvxfer.so could not be loaded from any of the three places searched
    (KVXFER_LIBRARY, the package directory, the linker path); the message says
    what was tried at each and how to build the library."""


class KvxError(RuntimeError):
    """A failed kvx_ call: ``status`` is the kvx_status code, ``op`` the C
    function, and the message is the library's kvx_last_error() text (what was
    wrong and what to do)."""

    def __init__(self, status: int, op: str, message: str):
        self.status = status
        self.op = op
        self.message = message
        super().__init__(f"{message} [{STATUS_NAMES.get(status, status)}]" if message else f"{op}: {STATUS_NAMES.get(status, status)}")


class Closable:
    """close() from the context manager and from garbage collection (a
    safety net: call close() explicitly)."""

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_lock = threading.Lock()
_lib = None


def _package_dir() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def _load() -> ctypes.CDLL:
    tried = []
    env = os.environ.get(LIBRARY_ENV, "")
    if env:
        try:
            return ctypes.CDLL(env)
        except OSError as e:
            raise LibraryNotFoundError(
                f"kvxfer: {LIBRARY_ENV}={env} cannot be loaded: {e}. Point {LIBRARY_ENV} at a libkvxfer.so "
                "built with `make python-lib` (build/python/libkvxfer.so), or unset it to search the package "
                "directory and the linker path."
            ) from e
    tried.append(f"{LIBRARY_ENV} is not set")
    pkg = _package_dir()
    found_pkg = False
    for name in LIBRARY_NAMES:
        path = os.path.join(pkg, name)
        if os.path.exists(path):
            found_pkg = True
            try:
                return ctypes.CDLL(path)
            except OSError as e:
                tried.append(f"{path}: {e}")
    if not found_pkg:
        tried.append(f"no {' or '.join(LIBRARY_NAMES)} in the package directory {pkg}")
    for name in reversed(LIBRARY_NAMES):
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            err = str(e)
    found = ctypes.util.find_library("kvxfer")
    if found:
        try:
            return ctypes.CDLL(found)
        except OSError as e:
            err = str(e)
    tried.append(
        f"not on the linker path (dlopen {LIBRARY_NAMES[1]}: {err}; LD_LIBRARY_PATH="
        f"{os.environ.get('LD_LIBRARY_PATH', '')!r}, ldconfig cache)"
    )
    raise LibraryNotFoundError(
        "kvxfer: libkvxfer.so not found: "
        + "; ".join(tried)
        + ". Build it with `make python-lib` and set KVXFER_LIBRARY=build/python/libkvxfer.so, copy it into the "
        "package directory (`make python-lib` then `pip install ./python` does that), or install it "
        "(`cmake --install build`) on the linker path."
    )


def lib() -> ctypes.CDLL:
    """The loaded library with every prototype set (loaded once, thread-safe).
    Raises LibraryNotFoundError when it cannot be found, ImportError when it is
    too old for this package (a kvx_ function missing)."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        l = _load()
        missing = []
        for name, (res, args) in _PROTOTYPES.items():
            try:
                fn = getattr(l, name)
            except AttributeError:
                missing.append(name)
                continue
            fn.restype = res
            fn.argtypes = args
        if missing:
            raise ImportError(
                f"kvxfer: {l._name} lacks {', '.join(missing)}: it is older than this Python package; rebuild it "
                "from the same checkout (`make python-lib`)"
            )
        ver = l.kvx_version().decode()
        if int(ver.split(".")[0]) != ABI_MAJOR:
            raise ImportError(f"kvxfer: {l._name} is version {ver}; this package speaks C ABI {ABI_MAJOR}.x")
        _lib = l
        return l


def library_path() -> str:
    """The file the library was loaded from."""
    return lib()._name


def version() -> str:
    """The library's version string (kvx_version)."""
    return lib().kvx_version().decode()


def last_error() -> str:
    """kvx_last_error() of this thread (without the library's "kvxfer: "
    prefix)."""
    s = lib().kvx_last_error()
    msg = s.decode(errors="replace") if s else ""
    return msg[len("kvxfer: "):] if msg.startswith("kvxfer: ") else msg


def strerror(status: int) -> str:
    return lib().kvx_strerror(status).decode()


def call(op: str, *args) -> None:
    """Call kvx function `op`; raise KvxError with kvx_last_error() on failure."""
    rc = getattr(lib(), op)(*args)
    if rc != OK:
        raise KvxError(rc, op, last_error())


def try_call(op: str, *args) -> tuple[int, str]:
    """Call kvx function `op`; return (status, message) without raising."""
    rc = getattr(lib(), op)(*args)
    return (rc, last_error() if rc != OK else "")


def get_string(op: str, handle: int) -> str:
    """Call a buffer-filling kvx function (handle, buf, cap, *needed)."""
    needed = c_size_t(0)
    buf = ctypes.create_string_buffer(256)
    rc = getattr(lib(), op)(handle, buf, len(buf), ctypes.byref(needed))
    if rc == ERR_BUFFER_TOO_SMALL:
        buf = ctypes.create_string_buffer(needed.value)
        rc = getattr(lib(), op)(handle, buf, len(buf), ctypes.byref(needed))
    if rc != OK:
        raise KvxError(rc, op, last_error())
    return buf.value.decode()


def metrics_text() -> str:
    """The library's Prometheus metrics in the text format
    (kvx_metrics_text): the KV managers' kvxfer_* series and the segment
    engines' kvxfer_segment_requests_total / kvxfer_segment_descriptors_total
    (requests as submitted, descriptors after coalescing)."""
    needed = c_size_t(0)
    rc = lib().kvx_metrics_text(None, 0, ctypes.byref(needed))
    for _ in range(4):  # the text may grow between the calls
        buf = ctypes.create_string_buffer(needed.value + 4096)
        rc = lib().kvx_metrics_text(buf, len(buf), ctypes.byref(needed))
        if rc != ERR_BUFFER_TOO_SMALL:
            break
    if rc != OK:
        raise KvxError(rc, "kvx_metrics_text", last_error())
    return buf.value.decode()


def counter(text: str, name: str) -> float:
    """The sum over every series of counter `name` in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def encode(s):
    """str/None -> bytes/None for a const char * argument."""
    if s is None:
        return None
    return s.encode() if isinstance(s, str) else bytes(s)
