"""kvxfer.engine.TransferEngine: a drop-in for Mooncake's Python TransferEngine
(``from mooncake.engine import TransferEngine``) over libkvxfer.

Same method names, arguments, return codes and semantics as Mooncake's
``mooncake-integration/transfer_engine/transfer_engine_py.cpp`` (see
python/README.md for the method table). Differences, all documented there:

* failures return ``-status`` where status is the kvx_status code (so every
  failure is negative, as in Mooncake, and the code says why: -8 a peer range
  outside every registered region, -10 timed out, -12 peer lost, -17 not
  supported by the transport, ...); the text goes to the "kvxfer" logger and
  to ``engine.last_error``. transfer_check_status keeps Mooncake's 1/0/-1/-2,
  and transfer_submit_write and batch_transfer_async_* return 0 when the
  batch could not be submitted (unknown or unreachable peer, bad range), as
  Mooncake's do; transfer_check_status(0) then returns -1;
* metadata: "P2PHANDSHAKE" (peers are "host:rpc_port"), etcd
  ("etcd://host:port" or a bare "host:port", Mooncake's default type) and
  Mooncake's HTTP metadata server ("http://host:port/metadata"; kvxfer
  serves one itself: kvxfer.MetadataServer, `kvxfer metadata-server`). With
  a metadata server the segment is named local_hostname as given, as in
  Mooncake; redis:// is not supported;
* protocols: "tcp", "rdma", and kvxfer's same-host "shm" (memory from
  allocate_managed_buffer / kvxfer.HostBuffer only) and "cma" (any host
  memory: numpy arrays, bytearrays, a caller's tensors; cross-memory
  attach), and "auto" (rdma, else cma: it registers every host memory shm
  does and the caller's own); MC_FORCE_TCP turns any of them into "tcp", as
  in Mooncake;
* local_hostname may be a host name ("localhost", this machine's name): the
  engine binds its local address and peers name it "name:rpc_port";
* addresses and lengths are integers as Mooncake's binding takes them: int,
  numpy integer scalars, any object with __index__ (and, as a kvxfer
  extension, buffer objects);
* READs are one-sided reads of the peer's registered memory on every
  transport (tcp: the peer's transport answers from its registered region;
  rdma: RDMA READ work requests; shm: a copy from the mapped region; cma:
  process_vm_readv), with
  the same bounds, epochs and fencing as WRITEs: transfer_sync_read and
  batch_transfer_sync_read go through kvx_segment_read,
  batch_transfer_async_read and transfer_submit_read (kvxfer's mirror of
  transfer_submit_write) submit a kvx read batch (kvx_batch_submit_read)
  polled like a write batch.

Environment (read when a TransferEngine is constructed / initialized):
MC_TRANSFER_TIMEOUT (seconds, at least 5, default 30; a transfer may take that
plus one second per GiB), MC_METADATA_SERVER (used when metadata_server is
empty), MC_FORCE_TCP (use tcp whatever the protocol; 0/false/no/off = unset),
MC_TCP_BIND_ADDRESS (data-plane bind host), MC_LEGACY_RPC_PORT_BINDING (bind
the port given in local_hostname instead of a free one).
"""

from __future__ import annotations

import collections
import ctypes
import enum
import ipaddress
import logging
import os
import threading
import time

from . import _lib
from ._lib import Closable, KvxError
from ._memory import HostBuffer, address_of, as_int, check_address, u64_array

log = logging.getLogger("kvxfer")

P2PHANDSHAKE = "P2PHANDSHAKE"

#: Module attributes Mooncake's extension defines (build features).
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_INTRA_NVLINK = False
SUPPORT_MUSA = False
#: Mooncake's *_on_cuda stream-triggered methods are not provided.
SUPPORT_CUDA = False

_PROTOCOLS = ("tcp", "rdma", "shm", "cma", "auto")
_DEFAULT_TIMEOUT_S = 30
_MIN_TIMEOUT_S = 5


class TransferOpcode(enum.IntEnum):
    """Mooncake's TransferOpcode (pybind names Read/Write; READ/WRITE as in its
    documentation)."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


#: Module-level aliases, as pybind's export_values() provides.
Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """Mooncake's TransferNotify(name, msg). kvxfer transfers carry no
    notifications: passing one to transfer_sync returns -17."""

    def __init__(self, name: str = "", msg: str = ""):
        self.name = name
        self.msg = msg

    def __repr__(self):
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


def transfer_timeout_s(env=None) -> int:
    """MC_TRANSFER_TIMEOUT in seconds as Mooncake reads it: max(5, value),
    default 30; a value that is not an integer is reported and ignored."""
    env = os.environ if env is None else env
    raw = env.get("MC_TRANSFER_TIMEOUT")
    if raw is None or raw == "":
        return _DEFAULT_TIMEOUT_S
    try:
        return max(_MIN_TIMEOUT_S, int(raw))
    except ValueError:
        log.warning("kvxfer: MC_TRANSFER_TIMEOUT=%r is not a number of seconds; using %d s", raw, _DEFAULT_TIMEOUT_S)
        return _DEFAULT_TIMEOUT_S


def split_host_port(s: str) -> tuple[str, int | None]:
    """"host", "host:port", "[v6]", "[v6]:port" or a bare IPv6 address ->
    (host, port or None)."""
    s = s.strip()
    if s.startswith("["):
        end = s.find("]")
        if end < 0:
            raise ValueError(f"{s!r}: '[' without ']'")
        host, rest = s[1:end], s[end + 1 :]
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise ValueError(f"{s!r}: expected ':port' after ']'")
        return host, int(rest[1:])
    if s.count(":") == 1:
        host, port = s.split(":")
        return host, int(port)
    return s, None


def parse_metadata_server(metadata_server: str | None, metadata_type: str | None = None) -> str:
    """Mooncake's metadata connection string -> kvx_engine_config.metadata_server.

    "P2PHANDSHAKE" -> "P2PHANDSHAKE"; "etcd://...", "http://..." and
    "https://..." as they are; a string without a scheme gets metadata_type's
    (Mooncake's default type etcd: "host:port" -> "etcd://host:port"; with
    metadata_type "http", "host:port/metadata" -> "http://host:port/metadata").
    Raises ValueError for metadata types kvxfer does not have (redis)."""
    ms = (metadata_server or "").strip()
    if ms == "" or ms == P2PHANDSHAKE:
        return P2PHANDSHAKE
    if "://" in ms:
        scheme = ms.split("://", 1)[0].lower()
        ms = scheme + ms[len(scheme):]
    else:
        scheme = (metadata_type or "etcd").strip().lower() or "etcd"
        if scheme in ("p2p", "p2phandshake"):
            return P2PHANDSHAKE
        ms = f"{scheme}://{ms}"
    if scheme not in ("etcd", "http", "https"):
        raise ValueError(
            f"metadata server {metadata_server!r}: kvxfer supports P2PHANDSHAKE, etcd (etcd://host:port) and "
            f"Mooncake's HTTP metadata server (http://host:port/metadata), not {scheme}://; use one of those "
            "(`kvxfer metadata-server` or kvxfer.MetadataServer serves the HTTP one)"
        )
    return ms


_FALSE = ("0", "false", "no", "off")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def force_tcp(env=None) -> bool:
    """Whether MC_FORCE_TCP asks for the tcp transport whatever protocol
    initialize() names. Mooncake's engine checks only that the variable is
    set; kvxfer also reads an explicit 0/false/no/off as unset."""
    env = os.environ if env is None else env
    v = env.get("MC_FORCE_TCP")
    return v is not None and v.strip().lower() not in _FALSE


class InnerTransferEngine:
    """What get_engine() returns: Mooncake's Python name for its C++ engine
    object, which Mooncake hands to its other components (Store, EP). In
    kvxfer it stands for the engine it came from: ``handle`` is the
    kvx_engine_t (get_engine_ptr()), ``segment_name`` and ``transport`` the
    engine's. Holding it does not keep the engine open."""

    __slots__ = ("handle", "segment_name", "transport")

    def __init__(self, handle: int, segment_name: str, transport: str):
        self.handle = handle
        self.segment_name = segment_name
        self.transport = transport

    def __repr__(self):
        return f"<kvxfer InnerTransferEngine {self.segment_name} ({self.transport}) handle={self.handle}>"


def _location(location) -> bytes:
    """Mooncake memory location ("*", "cpu:0", "cuda:1") -> kvx location:
    "*" (or nothing) is detected by the library (device memory through the
    CUDA driver's cuPointerGetAttribute, else host memory), as Mooncake
    does."""
    loc = (location or "*").strip().lower()
    if loc in ("*", ""):
        return b"*"
    if loc in ("cpu", "host") or loc.startswith("cpu:"):
        return b"host"
    return loc.encode()


class _Async:
    """One asynchronous batch: a kvx batch of writes or of reads."""

    __slots__ = ("handle", "start_ns", "timeout_ns", "timed_out", "target")

    def __init__(self, handle, timeout_ns, target):
        self.handle = handle
        self.start_ns = time.monotonic_ns()
        self.timeout_ns = timeout_ns
        self.timed_out = False
        self.target = target


class TransferEngine(Closable):
    """Mooncake's Python TransferEngine over libkvxfer (see the module doc).

    Thread-safe. Call initialize() first. close() (or the context manager, or
    garbage collection) frees the engine, its segments and managed buffers;
    memory registered with register_memory stays owned by the caller.

    Raises kvxfer.LibraryNotFoundError when libkvxfer.so cannot be found (the
    message names KVXFER_LIBRARY, the package directory and the linker path).
    """

    def __init__(self):
        self._l = _lib.lib()
        self._engine = 0
        self._lock = threading.Lock()
        self._segments: dict[str, int] = {}
        # addr -> (region id, length, keep-alive, host memory?)
        self._regions: dict[int, tuple[int, int, object, bool]] = {}
        self._managed: dict[int, tuple[HostBuffer, int]] = {}  # addr -> (buffer, length asked)
        self._async: dict[int, _Async] = {}
        # batch id -> final transfer_check_status value, oldest first
        self._finished: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._zombies: list[int] = []  # kvx batches cancelled but not yet terminal
        self._transport = ""
        self._name = ""
        self.last_error = ""
        self.last_code = 0
        self._submit_error: tuple[int, str] = (0, "")
        self._inner = None
        self.transfer_timeout_ns = transfer_timeout_s() * 1_000_000_000

    # ------------------------------------------------------------------
    # helpers
    # ------------------------------------------------------------------
    def _fail(self, status: int, message: str, level=logging.WARNING) -> int:
        code = -status if status > 0 else -1
        self.last_error = message
        self.last_code = code
        log.log(level, "kvxfer: %s", message)
        return code

    def _not_initialized(self, op: str) -> int:
        return self._fail(_lib.ERR_BAD_HANDLE, f"{op}: the engine is not initialized; call initialize() first")

    def _timeout_ms(self, total_bytes: int) -> int:
        # Mooncake: MC_TRANSFER_TIMEOUT plus one nanosecond per byte (1 GiB/s).
        return min(0xFFFFFFFF, (self.transfer_timeout_ns + total_bytes) // 1_000_000 + 1)

    def _segment(self, target: str, op: str) -> tuple[int, int]:
        """(segment handle, 0) or (0, negative code) for target "host:rpc_port"."""
        if not self._engine:
            return 0, self._not_initialized(op)
        if not isinstance(target, str) or not target:
            return 0, self._fail(_lib.ERR_INVALID_ARGUMENT, f"{op}: target_hostname {target!r} is not a segment name (host:rpc_port)")
        with self._lock:
            h = self._segments.get(target)
        if h:
            return h, 0
        out = ctypes.c_uint64(0)
        rc, msg = _lib.try_call("kvx_segment_open_name", self._engine, target.encode(), ctypes.byref(out))
        if rc != _lib.OK:
            return 0, self._fail(rc, f"{op}: open segment {target}: {msg}")
        with self._lock:
            old = self._segments.get(target)
            if old:  # another thread opened it meanwhile
                _lib.try_call("kvx_segment_close", out.value)
                return old, 0
            self._segments[target] = out.value
        return out.value, 0

    def _drop_segment(self, target: str, handle: int) -> None:
        """Forget a segment whose peer is lost, so the next call reopens it
        (a restarted peer has a new epoch), as Mooncake closes it."""
        with self._lock:
            if self._segments.get(target) == handle:
                del self._segments[target]
            else:
                return
        _lib.try_call("kvx_segment_close", handle)

    def _arrays(self, op, buffers, peer_addresses, lengths):
        """The three per-entry arguments as C uint64_t arrays (u64_array: a
        numpy array or any buffer of 64-bit integers is passed in place, a
        list is converted in C): (buffers, peer addresses, lengths, n)."""
        bufs = u64_array(buffers, f"{op}: buffers", addresses=True)
        peers = u64_array(peer_addresses, f"{op}: peer_buffer_addresses")
        lens = u64_array(lengths, f"{op}: lengths")
        n = bufs.n
        if n != peers.n or n != lens.n:
            raise ValueError(
                f"{op}: buffers ({n}), peer_buffer_addresses ({peers.n}) and lengths ({lens.n}) "
                "have different sizes"
            )
        if n == 0:
            raise ValueError(f"{op}: no requests (empty lists)")
        return bufs, peers, lens, n

    def _lost(self, rc: int) -> bool:
        return rc in (_lib.ERR_PEER_LOST, _lib.ERR_CLOSED, _lib.ERR_BAD_HANDLE)

    def _submit(self, op, target, buffers, peer_addresses, lengths, read=False) -> tuple[int, int, int]:
        """Submit WRITEs (READs with read=True) as one kvx batch
        (kvx_batch_submit_soa: the arrays go to C as they are; the library
        checks every entry and names the index of a bad one): (batch, total
        bytes, 0) or (0, 0, code)."""
        try:
            bufs, peers, lens, n = self._arrays(op, buffers, peer_addresses, lengths)
        except (ValueError, TypeError) as e:
            return 0, 0, self._fail(_lib.ERR_INVALID_ARGUMENT, str(e))
        seg, code = self._segment(target, op)
        if code:
            return 0, 0, code
        self._reap()
        b = ctypes.c_uint64(0)
        rc, msg = _lib.try_call("kvx_batch_alloc", seg, n, ctypes.byref(b))
        if rc == _lib.OK:
            rc, msg = _lib.try_call("kvx_batch_submit_read_soa" if read else "kvx_batch_submit_soa", b.value, n,
                                    bufs.ptr, peers.ptr, lens.ptr, _lib.REGION_PEER_ADDRESS)
            if rc != _lib.OK:
                _lib.try_call("kvx_batch_free", b.value)
        if rc != _lib.OK:
            if self._lost(rc):
                self._drop_segment(target, seg)
            return 0, 0, self._fail(rc, f"{op} {'from' if read else 'to'} {target}: {msg}")
        return b.value, lens.sum(), 0

    def _sync(self, op, target, buffers, peer_addresses, lengths, read=False) -> int:
        """WRITEs (READs with read=True) sent and waited for in one C call
        (kvx_segment_write_soa / _read_soa: no batch handle, one entry into
        the library instead of four); 0 or a negative code. A timed-out
        transfer was cancelled and has stopped when this returns."""
        try:
            bufs, peers, lens, n = self._arrays(op, buffers, peer_addresses, lengths)
        except (ValueError, TypeError) as e:
            return self._fail(_lib.ERR_INVALID_ARGUMENT, str(e))
        seg, code = self._segment(target, op)
        if code:
            return code
        self._reap()
        timeout_ms = self._timeout_ms(lens.sum())
        rc, msg = _lib.try_call("kvx_segment_read_soa" if read else "kvx_segment_write_soa", seg, n,
                                bufs.ptr, peers.ptr, lens.ptr, _lib.REGION_PEER_ADDRESS, timeout_ms)
        if rc == _lib.OK:
            return 0
        if self._lost(rc):
            self._drop_segment(target, seg)
        if rc == _lib.ERR_TIMEOUT:
            return self._fail(rc, f"{op} {'from' if read else 'to'} {target}: not done after {timeout_ms} ms (MC_TRANSFER_TIMEOUT "
                              f"{self.transfer_timeout_ns // 1_000_000_000} s + 1 s/GiB); cancelled: {msg}")
        return self._fail(rc, f"{op} {'from' if read else 'to'} {target}: {msg}")

    def _free_or_park(self, batch: int) -> None:
        rc, _ = _lib.try_call("kvx_batch_free", batch)
        if rc == _lib.ERR_BUSY:
            with self._lock:
                self._zombies.append(batch)

    def _reap(self) -> None:
        """Free cancelled batches that have since become terminal."""
        if not self._zombies:
            return
        with self._lock:
            zs, self._zombies = self._zombies, []
        for b in zs:
            self._free_or_park(b)

    # ------------------------------------------------------------------
    # initialization
    # ------------------------------------------------------------------
    def initialize(self, local_hostname, metadata_server, protocol, device_name) -> int:
        """Start the engine: local_hostname is "host" or "host:port" (an IP
        or a host name of this machine; the segment RPC listener's port is
        chosen free, as Mooncake does, unless MC_LEGACY_RPC_PORT_BINDING is
        set), metadata_server "P2PHANDSHAKE" (the segment is named
        "host:rpc_port"), etcd or "http://host:port/metadata" (the segment is
        named local_hostname as given), protocol "tcp" | "rdma" | "shm" |
        "cma" | "auto" (MC_FORCE_TCP: tcp), device_name a comma list of RDMA devices
        or "". Returns 0, or a negative code with the reason logged."""
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name, None)

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name, metadata_type) -> int:
        """initialize() with an explicit metadata type ("etcd", "http", "p2p")
        for a metadata_server given without a scheme."""
        op = "initialize"
        if self._engine:
            return self._fail(_lib.ERR_BUSY, f"{op}: this engine is already initialized as {self._name}; create another TransferEngine")
        proto = (protocol or "auto").strip().lower()
        if force_tcp() and proto != "tcp":
            log.info("kvxfer: MC_FORCE_TCP is set: using the tcp transport instead of %r, as Mooncake does", protocol)
            proto = "tcp"
        if proto not in _PROTOCOLS:
            return self._fail(
                _lib.ERR_NOT_SUPPORTED,
                f"{op}: protocol {protocol!r} is not available in kvxfer; use one of {', '.join(_PROTOCOLS)}",
                logging.ERROR,
            )
        if not metadata_server:
            metadata_server = os.environ.get("MC_METADATA_SERVER", "") or P2PHANDSHAKE
        try:
            meta = parse_metadata_server(metadata_server, metadata_type)
        except ValueError as e:
            return self._fail(_lib.ERR_NOT_SUPPORTED, f"{op}: {e}", logging.ERROR)
        local = (local_hostname or "127.0.0.1").strip()
        try:
            host, port = split_host_port(local)
        except ValueError as e:
            return self._fail(_lib.ERR_INVALID_ARGUMENT, f"{op}: local_hostname {local_hostname!r}: {e}", logging.ERROR)
        legacy = bool(os.environ.get("MC_LEGACY_RPC_PORT_BINDING"))
        segment_name = None
        if meta != P2PHANDSHAKE:
            # With a metadata server Mooncake names the segment local_hostname
            # as given ("127.0.0.1:12345", or any name) and serves its RPC on
            # a free port of this machine's address, published with it: a
            # name that is not an IP address is not bound (every interface
            # is, advertising the default-route address, as Mooncake's
            # findLocalIpAddresses does) unless MC_LEGACY_RPC_PORT_BINDING.
            segment_name = local
            if not legacy:
                if os.environ.get("MC_TCP_BIND_ADDRESS"):  # Mooncake's RPC address in this mode
                    host = os.environ["MC_TCP_BIND_ADDRESS"]
                elif not _is_ip(host):
                    host = "0.0.0.0"
        if (port is not None or segment_name) and not legacy:
            local = f"[{host}]" if ":" in host else host  # Mooncake: a free RPC port
        bind = os.environ.get("MC_TCP_BIND_ADDRESS", "") or host
        cfg = _lib.EngineConfig()
        cfg.struct_size = ctypes.sizeof(cfg)
        cfg.role = _lib.ROLE_PREFILL
        cfg.transport = proto.encode()
        cfg.listen_host = bind.encode()
        cfg.local_hostname = local.encode()
        cfg.metadata_server = meta.encode()
        cfg.segment_name = segment_name.encode() if segment_name else None
        cfg.devices = (device_name or "").encode()
        out = ctypes.c_uint64(0)
        rc, msg = _lib.try_call("kvx_engine_create", ctypes.byref(cfg), ctypes.byref(out))
        if rc != _lib.OK:
            return self._fail(rc, f"{op}({local_hostname!r}, {metadata_server!r}, {protocol!r}, {device_name!r}): {msg}", logging.ERROR)
        self._engine = out.value
        self._transport = _lib.get_string("kvx_engine_transport", self._engine)
        self._name = _lib.get_string("kvx_engine_segment_name", self._engine)
        log.info("kvxfer: engine %s on transport %s (metadata %s)", self._name, self._transport, meta)
        return 0

    def get_rpc_port(self) -> int:
        """The segment RPC listener's port (peers name this engine
        "host:<rpc_port>"); -2 (not initialized) on failure."""
        if not self._engine:
            return self._not_initialized("get_rpc_port")
        port = ctypes.c_uint16(0)
        rc, msg = _lib.try_call("kvx_engine_rpc_port", self._engine, ctypes.byref(port))
        if rc != _lib.OK:
            return self._fail(rc, f"get_rpc_port: {msg}")
        return port.value

    @property
    def segment_name(self) -> str:
        """kvxfer extension: the name peers open this engine by ("host:rpc_port")."""
        return self._name

    @property
    def transport(self) -> str:
        """kvxfer extension: the transport in use ("tcp", "shm", "cma", "rdma")."""
        return self._transport

    def get_engine_ptr(self) -> int:
        """The kvx_engine_t handle (for C callers of libkvxfer); Mooncake
        returns its C++ engine pointer. 0 before initialize()."""
        return self._engine

    def get_engine(self):
        """Mooncake returns its C++ engine (an InnerTransferEngine) for its
        other components; kvxfer returns an InnerTransferEngine naming this
        engine (the same object on every call), or None before initialize()
        (Mooncake's engine is null then)."""
        if not self._engine:
            return None
        with self._lock:
            if self._inner is None or self._inner.handle != self._engine:
                self._inner = InnerTransferEngine(self._engine, self._name, self._transport)
            return self._inner

    def get_local_topology(self, device_name=None) -> str:
        """Not provided: raises NotImplementedError (the C ABI exports no
        topology; `kvxfer topo` prints the machine's GPU/NIC layout)."""
        raise NotImplementedError("kvxfer: get_local_topology is not in kvxfer's C ABI; run `kvxfer topo` for the GPU/NIC layout")

    # ------------------------------------------------------------------
    # memory
    # ------------------------------------------------------------------
    def register_memory(self, buffer_addr, capacity=None, location="*") -> int:
        """Register [buffer_addr, +capacity) for transfers (both directions:
        local source and target of peers' writes). buffer_addr is an address
        or, as a kvxfer extension, a buffer object (bytearray, numpy array,
        ...; capacity defaults to its size and the object is kept alive while
        registered). location "*"/"cpu:N" = host memory, "cuda:N" = device
        memory. Returns 0 or a negative code."""
        op = "register_memory"
        if not self._engine:
            return self._not_initialized(op)
        try:
            addr, n, keep = address_of(buffer_addr, f"{op}: buffer_addr", writable=True)
            length = as_int(capacity, f"{op}: capacity") if capacity is not None else n
        except (TypeError, ValueError) as e:
            return self._fail(_lib.ERR_INVALID_ARGUMENT, str(e))
        if length <= 0 or addr == 0:
            return self._fail(_lib.ERR_INVALID_ARGUMENT, f"{op}: address {addr:#x} length {length}: want a non-null address and capacity > 0 bytes")
        if n and length > n:
            return self._fail(_lib.ERR_INVALID_ARGUMENT, f"{op}: capacity {length} is larger than the {n}-byte buffer")
        region = ctypes.c_uint32(0)
        rc, msg = _lib.try_call("kvx_register_memory", self._engine, addr, length, _location(location), ctypes.byref(region))
        if rc == _lib.ERR_UNSUPPORTED_MEMORY and self._transport == "shm":
            msg += "; in Python allocate it with engine.allocate_managed_buffer(n) or kvxfer.HostBuffer(n), or initialize with protocol \"cma\" (or \"auto\"), which registers any host memory"
        if rc != _lib.OK:
            return self._fail(rc, f"{op}: {msg}")
        loc = _location(location)
        host = loc == b"host"
        if loc == b"*":
            # Detected by the library at registration; ask it the same way,
            # so read/write_bytes_to_buffer know whether the CPU may touch it.
            dev = ctypes.c_int(-1)
            rc, _ = _lib.try_call("kvx_pointer_device", addr, ctypes.byref(dev))
            host = rc == _lib.OK and dev.value < 0
        with self._lock:
            self._regions[addr] = (region.value, length, keep, host)
        return 0

    def unregister_memory(self, buffer_addr) -> int:
        """Deregister the region registered at buffer_addr (its first byte).
        Returns 0 or a negative code (-6 when nothing is registered there)."""
        op = "unregister_memory"
        if not self._engine:
            return self._not_initialized(op)
        try:
            addr, _, _ = address_of(buffer_addr, f"{op}: buffer_addr")
        except (TypeError, ValueError) as e:
            return self._fail(_lib.ERR_INVALID_ARGUMENT, str(e))
        with self._lock:
            entry = self._regions.pop(addr, None)
        if entry is None:
            return self._fail(_lib.ERR_NOT_REGISTERED, f"{op}: no region is registered at {addr:#x} (pass the address given to register_memory)")
        rc, msg = _lib.try_call("kvx_deregister_memory", self._engine, entry[0])
        if rc != _lib.OK:
            return self._fail(rc, f"{op}: {msg}")
        return 0

    def batch_register_memory(self, buffer_addresses, capacities, location="*") -> int:
        """register_memory for each (address, capacity); all or nothing: on a
        failure the ones registered by this call are deregistered again."""
        if len(buffer_addresses) != len(capacities):
            return self._fail(_lib.ERR_INVALID_ARGUMENT, f"batch_register_memory: {len(buffer_addresses)} addresses but {len(capacities)} capacities")
        done = []
        for a, c in zip(buffer_addresses, capacities):
            rc = self.register_memory(a, c, location)
            if rc != 0:
                for d in done:
                    self.unregister_memory(d)
                return rc
            done.append(a)
        return 0

    def batch_unregister_memory(self, buffer_addresses) -> int:
        """unregister_memory for each address; 0, or the first failure's code
        (the others are still deregistered)."""
        first = 0
        for a in buffer_addresses:
            rc = self.unregister_memory(a)
            if rc != 0 and first == 0:
                first = rc
        return first

    def allocate_managed_buffer(self, length) -> int:
        """Allocate and register `length` bytes of zeroed host memory owned by
        the engine (kvx_alloc_host: shareable, so the shm transport can move
        it). Returns its address, or 0 on failure. One mapping per call (the
        length rounded up to the page size); Mooncake carves slabs instead."""
        op = "allocate_managed_buffer"
        if not self._engine:
            self._not_initialized(op)
            return 0
        try:
            length = as_int(length, f"{op}: length")
            hb = HostBuffer(length, "mooncake-managed")
        except (KvxError, ValueError, TypeError) as e:
            self._fail(getattr(e, "status", _lib.ERR_INVALID_ARGUMENT), f"{op}({length}): {e}")
            return 0
        region = ctypes.c_uint32(0)
        rc, msg = _lib.try_call("kvx_register_memory", self._engine, hb.addr, hb.nbytes, b"host", ctypes.byref(region))
        if rc != _lib.OK:
            hb.close()
            self._fail(rc, f"{op}({length}): {msg}")
            return 0
        with self._lock:
            self._regions[hb.addr] = (region.value, hb.nbytes, None, True)
            self._managed[hb.addr] = (hb, length)
        return hb.addr

    def free_managed_buffer(self, buffer_addr, length) -> int:
        """Deregister and unmap a buffer from allocate_managed_buffer. Returns 0
        or a negative code (-6 for an address it did not return)."""
        op = "free_managed_buffer"
        try:
            addr = check_address(as_int(buffer_addr, f"{op}: buffer_addr"), f"{op}: buffer_addr")
        except (TypeError, ValueError) as e:
            return self._fail(_lib.ERR_INVALID_ARGUMENT, str(e))
        with self._lock:
            m = self._managed.pop(addr, None)
        if m is None:
            return self._fail(_lib.ERR_NOT_REGISTERED, f"{op}: {addr:#x} is not a managed buffer of this engine")
        rc = self.unregister_memory(m[0].addr)
        m[0].close()
        return rc

    def _host_range(self, op: str, what: str, addr: int, n: int) -> str:
        """"" when [addr, addr+n) lies inside one host region registered with
        this engine (register_memory or allocate_managed_buffer), else the
        reason, naming op, the argument and what to do. Nothing is touched
        before this check: an address the engine did not register may be
        unmapped (a crash, not an exception) or device memory."""
        with self._lock:
            regions = list(self._regions.items())
        for base, (_, length, _, host) in regions:
            if base <= addr and addr + n <= base + length:
                if not host:
                    return (f"{op}: {what} {addr:#x}+{n} lies in device memory registered at {base:#x}; "
                            "copy device memory with its framework (torch, cupy), not this call")
                return ""
        if addr == 0:
            return f"{op}: {what} is 0 (NULL)"
        return (f"{op}: {what} {addr:#x}+{n} bytes is not inside memory registered with this engine "
                "(allocate it with allocate_managed_buffer or register it with register_memory first)")

    def write_bytes_to_buffer(self, dest_address, src_ptr, length) -> int:
        """Copy `length` bytes of src_ptr (bytes-like) to dest_address, which
        must lie, with its `length` bytes, in host memory registered with this
        engine (allocate_managed_buffer or register_memory). Returns 0, or -1
        (invalid argument, last_error says why) for a source shorter than
        length or a destination outside registered host memory: nothing is
        written then."""
        op = "write_bytes_to_buffer"
        try:
            src = bytes(src_ptr) if not isinstance(src_ptr, bytes) else src_ptr
            length = as_int(length, f"{op}: length")
            dest = check_address(as_int(dest_address, f"{op}: dest_address"), f"{op}: dest_address")
        except (TypeError, ValueError) as e:
            return self._fail(_lib.ERR_INVALID_ARGUMENT, str(e))
        if length < 0 or length > len(src):
            return self._fail(_lib.ERR_INVALID_ARGUMENT, f"{op}: length {length} but {len(src)} source bytes")
        if length == 0:
            return 0
        why = self._host_range(op, "dest_address", dest, length)
        if why:
            return self._fail(_lib.ERR_INVALID_ARGUMENT, why)
        ctypes.memmove(dest, src, length)
        return 0

    def read_bytes_from_buffer(self, source_address, length) -> bytes:
        """`length` bytes at source_address as bytes; the range must lie in
        host memory registered with this engine (allocate_managed_buffer or
        register_memory). Raises ValueError naming the argument otherwise
        (nothing is read)."""
        op = "read_bytes_from_buffer"
        addr = check_address(as_int(source_address, f"{op}: source_address"), f"{op}: source_address")
        n = as_int(length, f"{op}: length")
        if n < 0:
            raise ValueError(f"{op}: length {n}: want >= 0 bytes")
        if n == 0:
            return b""
        why = self._host_range(op, "source_address", addr, n)
        if why:
            raise ValueError(why)
        return ctypes.string_at(addr, n)

    # ------------------------------------------------------------------
    # transfers
    # ------------------------------------------------------------------
    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint="") -> int:
        """WRITE `length` bytes from local `buffer` (inside registered memory)
        to peer_buffer_address, a virtual address inside memory the peer
        registered; blocks until done. Returns 0 or a negative code (-8 when
        the peer range is outside every region the peer registered)."""
        return self.batch_transfer_sync_write(target_hostname, [buffer], [peer_buffer_address], [length], transport_hint)

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint="") -> int:
        """One transfer batch of WRITEs; blocks until all are done (0) or one
        failed / the timeout passed (negative)."""
        return self._sync("batch_transfer_sync_write", target_hostname, buffers, peer_buffer_addresses, lengths)

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length, transport_hint="") -> int:
        """READ `length` bytes at the peer's peer_buffer_address (inside
        memory the peer registered) into local `buffer` (inside registered
        memory); blocks until they landed. Returns 0 or a negative code (-8
        when the peer range is outside every region the peer registered, or
        was deregistered; -12 when the peer is lost mid-read)."""
        return self.batch_transfer_sync_read(target_hostname, [buffer], [peer_buffer_address], [length], transport_hint)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint="") -> int:
        """Several READs (see transfer_sync_read); 0 or negative."""
        return self._sync("batch_transfer_sync_read", target_hostname, buffers, peer_buffer_addresses, lengths, read=True)

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode, notify=None, transport_hint="") -> int:
        """transfer_sync_read or _write by opcode (TransferOpcode). A notify
        is not supported (-17)."""
        return self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address], [length], opcode, notify, transport_hint)

    def batch_transfer_sync(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify=None, transport_hint="") -> int:
        """batch_transfer_sync_read or _write by opcode; notify: -17."""
        if notify is not None:
            return self._fail(_lib.ERR_NOT_SUPPORTED, "transfer_sync: kvxfer transfers carry no TransferNotify; pass notify=None and signal the peer yourself")
        if int(opcode) == TransferOpcode.Read:
            return self.batch_transfer_sync_read(target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint)
        return self.batch_transfer_sync_write(target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint)

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint="") -> int:
        """Submit one WRITE; returns a batch id (> 0) for transfer_check_status,
        or 0 when it could not be submitted (Mooncake's failure sentinel: an
        unknown or unreachable peer, a range outside the peer's memory, ...;
        the reason is logged and in last_error, and transfer_check_status(0)
        returns -1)."""
        return self._submit_async("transfer_submit_write", target_hostname, [buffer], [peer_buffer_address], [length])

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint="") -> int:
        """Submit WRITEs as one batch; returns its id, or 0 on failure (as
        Mooncake). Poll with transfer_check_status / get_batch_transfer_status."""
        return self._submit_async("batch_transfer_async_write", target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint="") -> int:
        """Submit READs as one batch (kvx_batch_submit_read); returns its id,
        or 0 on failure (as Mooncake). Poll with transfer_check_status /
        get_batch_transfer_status, as for writes."""
        return self._submit_async("batch_transfer_async_read", target_hostname, buffers, peer_buffer_addresses, lengths, read=True)

    def transfer_submit_read(self, target_hostname, buffer, peer_buffer_address, length, transport_hint="") -> int:
        """kvxfer's mirror of transfer_submit_write: submit one READ; returns
        a batch id (> 0) for transfer_check_status, or 0 when it could not
        be submitted (the reason is logged and in last_error)."""
        return self._submit_async("transfer_submit_read", target_hostname, [buffer], [peer_buffer_address], [length], read=True)

    def batch_transfer_async(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint="") -> int:
        """batch_transfer_async_read or _write by opcode."""
        if int(opcode) == TransferOpcode.Read:
            return self.batch_transfer_async_read(target_hostname, buffers, peer_buffer_addresses, lengths)
        return self.batch_transfer_async_write(target_hostname, buffers, peer_buffer_addresses, lengths)

    def _submit_failed(self, code: int) -> None:
        """Remember why the last asynchronous submit returned 0, for
        transfer_check_status(0)."""
        self._submit_error = (code, self.last_error)

    def _submit_async(self, op, target, buffers, peer_addresses, lengths, read=False):
        batch, total, code = self._submit(op, target, buffers, peer_addresses, lengths, read)
        if code:
            self._submit_failed(code)
            return 0
        with self._lock:
            self._async[batch] = _Async(batch, self.transfer_timeout_ns + total, target)
        return batch

    def transfer_check_status(self, batch_id) -> int:
        """1 done, 0 in progress, -1 failed, -2 timed out (MC_TRANSFER_TIMEOUT
        + 1 s/GiB after submit: the batch is cancelled). A finished batch's
        resources are freed at the call that reports it; asking again about
        it returns the same final value (the last 4096 finished ids are
        remembered), so a completed batch polled twice never reads as
        failed. An id never submitted returns -1."""
        try:
            bid = as_int(batch_id, "transfer_check_status: batch_id")
        except TypeError as e:
            self._fail(_lib.ERR_INVALID_ARGUMENT, str(e))
            return -1
        if bid == 0:
            code, why = self._submit_error
            self._fail(_lib.ERR_INVALID_ARGUMENT, f"transfer_check_status: batch id 0 is the failure sentinel of a submit that did not go out"
                       + (f" (last one: {why}, code {code})" if why else ""))
            return -1
        with self._lock:
            known = bid in self._async
            final = self._finished.get(bid)
        if not known and final is not None:
            return final
        r = self._check_status(bid)
        if known and r != 0:
            with self._lock:
                if bid not in self._async:  # reported and freed: final
                    self._finished[bid] = r
                    while len(self._finished) > 4096:
                        self._finished.popitem(last=False)
        return r

    def _check_status(self, bid: int) -> int:
        with self._lock:
            a = self._async.get(bid)
        if a is None:
            self._fail(_lib.ERR_BAD_HANDLE, f"transfer_check_status: batch id {bid} is unknown (never submitted, or finished more than 4096 batches ago)")
            return -1
        if a.timed_out:
            self._try_forget(bid, a)
            return -2
        # The requests of one kvx_batch_submit complete (or fail) together:
        # request 0 speaks for the batch.
        st = _lib.TransferStatus()
        rc, msg = _lib.try_call("kvx_batch_status", a.handle, 0, ctypes.byref(st))
        if rc != _lib.OK:
            with self._lock:
                self._async.pop(bid, None)
            self._fail(rc, f"transfer_check_status: batch {bid}: {msg}")
            return -1
        state = st.state
        if state == _lib.TRANSFER_COMPLETED:
            with self._lock:
                self._async.pop(bid, None)
            self._free_or_park(a.handle)
            return 1
        if state != _lib.TRANSFER_PENDING:
            rc, msg = _lib.try_call("kvx_batch_wait", a.handle, 0)
            with self._lock:
                self._async.pop(bid, None)
            self._free_or_park(a.handle)
            if self._lost(rc):
                with self._lock:
                    seg = self._segments.get(a.target)
                if seg:
                    self._drop_segment(a.target, seg)
            self._fail(rc or _lib.ERR_TRANSFER_FAILED, f"transfer_check_status: batch {bid} to {a.target} failed: {msg}")
            return -1
        if time.monotonic_ns() - a.start_ns > a.timeout_ns:
            a.timed_out = True
            _lib.try_call("kvx_batch_cancel", a.handle)
            self._fail(_lib.ERR_TIMEOUT, f"transfer_check_status: batch {bid} to {a.target} still pending after "
                       f"{a.timeout_ns / 1e9:.1f} s (MC_TRANSFER_TIMEOUT + 1 s/GiB); cancelled")
            self._try_forget(bid, a)
            return -2
        return 0

    def _try_forget(self, bid, a):
        """Free a timed-out batch once it is terminal (then its id is unknown)."""
        rc, _ = _lib.try_call("kvx_batch_free", a.handle)
        if rc != _lib.ERR_BUSY:
            with self._lock:
                self._async.pop(bid, None)

    def get_batch_transfer_status(self, batch_ids) -> int:
        """Wait for every batch in batch_ids: 0 when all completed, -1 when
        one failed or timed out (the others are then abandoned and freed)."""
        failed = False
        for bid in batch_ids:
            if as_int(bid, "get_batch_transfer_status: batch_ids") == 0:
                self.transfer_check_status(0)  # logs why
                failed = True
                break
            while True:
                s = self.transfer_check_status(bid)
                if s == 1:
                    break
                if s < 0:
                    failed = True
                    break
                with self._lock:
                    a = self._async.get(int(bid))
                if a is None:
                    failed = True
                    break
                left_ms = max(1, (a.timeout_ns - (time.monotonic_ns() - a.start_ns)) // 1_000_000)
                _lib.try_call("kvx_batch_wait", a.handle, min(left_ms, 0xFFFFFFFF))
            if failed:
                break
        if failed:
            for bid in batch_ids:
                with self._lock:
                    a = self._async.pop(int(bid), None)
                if a is not None and a.handle:
                    _lib.try_call("kvx_batch_cancel", a.handle)
                    self._free_or_park(a.handle)
            return -1
        return 0

    # ------------------------------------------------------------------
    # segments
    # ------------------------------------------------------------------
    def get_first_buffer_address(self, segment_name) -> int:
        """Base address of the first region the peer registered (registration
        order), fetched fresh from the peer; 0 when it has none or cannot be
        reached."""
        op = "get_first_buffer_address"
        seg, code = self._segment(segment_name, op)
        if code:
            return 0
        rc, msg = _lib.try_call("kvx_segment_refresh", seg)
        if rc != _lib.OK:
            if self._lost(rc):
                self._drop_segment(segment_name, seg)
            self._fail(rc, f"{op}({segment_name}): {msg}")
            return 0
        regions = self.segment_regions(segment_name)
        return regions[0][0] if regions else 0

    def segment_regions(self, segment_name) -> list[tuple[int, int]]:
        """kvxfer extension: (base address, length) of every region the peer
        had registered when its descriptor was last fetched, in registration
        order. [] when the segment cannot be opened."""
        seg, code = self._segment(segment_name, "segment_regions")
        if code:
            return []
        n = ctypes.c_uint32(0)
        rc, msg = _lib.try_call("kvx_segment_regions", seg, None, 0, ctypes.byref(n))
        if rc != _lib.OK:
            self._fail(rc, f"segment_regions({segment_name}): {msg}")
            return []
        arr = (_lib.RegionInfo * max(1, n.value))()
        rc, msg = _lib.try_call("kvx_segment_regions", seg, arr, len(arr), ctypes.byref(n))
        if rc != _lib.OK:
            self._fail(rc, f"segment_regions({segment_name}): {msg}")
            return []
        return [(arr[i].addr, arr[i].length) for i in range(min(n.value, len(arr)))]

    def send_probe(self, peer_server_name) -> int:
        """Check that the peer answers (opens its segment, or fetches its
        descriptor again): 0, or a negative code."""
        seg, code = self._segment(peer_server_name, "send_probe")
        if code:
            return code
        rc, msg = _lib.try_call("kvx_segment_refresh", seg)
        if rc != _lib.OK:
            if self._lost(rc):
                self._drop_segment(peer_server_name, seg)
            return self._fail(rc, f"send_probe({peer_server_name}): {msg}")
        return 0

    def release_remote_segment(self, target_hostname) -> int:
        """Close the cached segment to target_hostname (the next transfer
        reopens it). Returns 0: kvxfer holds no NVLink import mappings."""
        with self._lock:
            h = self._segments.pop(target_hostname, None)
        if h:
            _lib.try_call("kvx_segment_close", h)
        return 0

    def warmup_efa_segment(self, segment_name) -> int:
        """No-op returning 0, as in Mooncake builds without EFA."""
        return 0

    def get_notifies(self) -> list:
        """Always [] : kvxfer transfers carry no TransferNotify messages."""
        return []

    # ------------------------------------------------------------------
    # lifetime
    # ------------------------------------------------------------------
    def close(self) -> None:
        """kvxfer extension (Mooncake frees in its destructor): close segments,
        free managed buffers and destroy the engine. Idempotent. Memory
        registered with register_memory stays the caller's."""
        with self._lock:
            eng, self._engine = self._engine, 0
            managed = list(self._managed.values())
            self._managed.clear()
            self._segments.clear()
            self._regions.clear()
            self._async.clear()
            self._zombies.clear()
        if eng:
            _lib.try_call("kvx_engine_destroy", eng)  # closes segments and batches
        for hb, _ in managed:
            hb.close()


#: As in Mooncake's binding, the opcode enum is also a class attribute
#: (TransferEngine.TransferOpcode.Read).
TransferEngine.TransferOpcode = TransferOpcode
