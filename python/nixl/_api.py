"""NIXL's Python API (``nixl._api``) on kvxfer: ``nixl_agent`` and
``nixl_agent_config`` with the calls, argument shapes and return
conventions vLLM's NixlConnector uses, backed by kvxfer.Agent
(libkvxfer's kvx_agent_*).

What differs from NIXL, by design:

* the metadata is kvxfer's versioned byte string (both ends run kvxfer);
  get_serialized_descs uses a versioned binary format, never pickle;
* backends ("UCX", ...) are accepted as names; every transfer moves on the
  kvxfer transport of the agent ($KVXFER_TRANSPORT: tcp, shm or rdma;
  $KVXFER_HOST: the address it binds and advertises, 127.0.0.1 by default);
* a transfer's notification reaches the remote agent only after the data
  landed, and a transfer whose notification could not be delivered is
  "ERR"; releasing an in-flight transfer cancels it and nothing moves
  afterwards; remove_remote_agent fences the removed agent;
* invalid arguments raise the matching nixl._bindings exception with a
  message naming what was wrong, where NIXL prints and returns None;
* NIXL's metadata-server and listener features (send_local_metadata,
  fetch_remote_metadata, partial metadata) are not provided: they raise
  nixlNotSupportedError. Exchange get_agent_metadata() out of band, as
  vLLM does.
"""

from __future__ import annotations

import struct
import threading
from typing import Optional

import kvxfer
from kvxfer import _lib
from kvxfer.agent import STATE_NAMES, Agent

from . import _bindings as nixlBind

DEFAULT_COMM_PORT = nixlBind.DEFAULT_COMM_PORT

# Opaque handle types, as NIXL names them.
nixl_backend_handle = int
nixl_prepped_dlist_handle = int
nixl_xfer_handle = int

_ERRORS = {
    _lib.ERR_INVALID_ARGUMENT: nixlBind.nixlInvalidParamError,
    _lib.ERR_BAD_HANDLE: nixlBind.nixlInvalidParamError,
    _lib.ERR_OUT_OF_BOUNDS: nixlBind.nixlInvalidParamError,
    _lib.ERR_NOT_REGISTERED: nixlBind.nixlInvalidParamError,
    _lib.ERR_UNKNOWN_REGION: nixlBind.nixlInvalidParamError,
    _lib.ERR_NOT_FOUND: nixlBind.nixlNotFoundError,
    _lib.ERR_BUSY: nixlBind.nixlRepostActiveError,
    _lib.ERR_PEER_LOST: nixlBind.nixlRemoteDisconnectError,
    _lib.ERR_TIMEOUT: nixlBind.nixlRemoteDisconnectError,
    _lib.ERR_CANCELED: nixlBind.nixlCancelledError,
    _lib.ERR_NOT_SUPPORTED: nixlBind.nixlNotSupportedError,
    _lib.ERR_UNSUPPORTED_MEMORY: nixlBind.nixlNotSupportedError,
}


def _nixl_error(e: kvxfer.KvxError) -> nixlBind.nixlError:
    cls = _ERRORS.get(e.status, nixlBind.nixlBackendError)
    return cls(e.message or str(e), e.status, e.op)


class _Translate:
    """Context manager: a kvxfer.KvxError leaves as the nixl exception of
    its status, an argument error as nixlInvalidParamError."""

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if exc is not None and isinstance(exc, kvxfer.KvxError) and not isinstance(exc, nixlBind.nixlError):
            raise _nixl_error(exc) from exc
        if isinstance(exc, (ValueError, TypeError)):  # kvxfer.agent's argument checks
            raise nixlBind.nixlInvalidParamError(str(exc)) from exc
        return False


_translate = _Translate()


class nixl_agent_config:
    """NIXL's agent configuration. kvxfer reads backends (names kept for
    get_plugin_list) and ignores the thread options: its agent has no
    progress thread to configure. capture_telemetry is always on."""

    def __init__(self, enable_prog_thread: bool = True, enable_listen_thread: bool = False, listen_port: int = 0,
                 capture_telemetry: bool = False, num_threads: int = 0, backends: Optional[list[str]] = None,
                 **extra):
        self.backends = list(backends) if backends is not None else ["UCX"]
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        #: Options of newer NIXL releases, accepted and not used.
        self.extra = extra


class nixl_agent:
    """NIXL's agent on kvxfer. agent_name must be unique among the agents
    that talk to each other (vLLM uses a UUID)."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None, instantiate_all: bool = False):
        conf = nixl_conf or nixl_agent_config()
        self.name = agent_name
        self._agent = Agent(agent_name)
        self._lock = threading.Lock()
        self.notifs: dict[str, list[bytes]] = {}
        self.plugin_list = list(conf.backends) or ["UCX"]
        self.backends: dict[str, nixl_backend_handle] = {b: i for i, b in enumerate(self.plugin_list)}
        self.backend_mems = {b: ["DRAM", "VRAM"] for b in self.plugin_list}
        self.backend_options: dict[str, dict[str, str]] = {b: {} for b in self.plugin_list}
        self.nixl_mems = dict(nixlBind.MEM_TYPES)
        self.nixl_ops = {"WRITE": nixlBind.NIXL_WRITE, "READ": nixlBind.NIXL_READ}
        self._xfer_dlists: dict[int, tuple[int, int]] = {}  # initialize_xfer's own prepared lists
        self._remotes: set[str] = set()

    # -- plugins and backends (names only) ---------------------------------
    def get_plugin_list(self) -> list[str]:
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        return ["DRAM", "VRAM"] if backend in self.backends else []

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        return {}

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return list(self.backend_mems.get(backend, []))

    def get_backend_params(self, backend: str) -> dict[str, str]:
        return dict(self.backend_options.get(backend, {}))

    def create_backend(self, backend: str, initParams: Optional[dict[str, str]] = None):
        """Records the backend name; kvxfer's transport serves every one."""
        with self._lock:
            if backend not in self.backends:
                self.backends[backend] = len(self.backends)
                self.plugin_list.append(backend)
                self.backend_mems[backend] = ["DRAM", "VRAM"]
                self.backend_options[backend] = dict(initParams or {})

    # -- descriptor lists ----------------------------------------------------
    def _mem(self, mem_type) -> int:
        if mem_type not in self.nixl_mems:
            raise nixlBind.nixlInvalidParamError(
                f"nixl_agent {self.name!r}: memory type {mem_type!r}: want one of {sorted(self.nixl_mems)}")
        return self.nixl_mems[mem_type]

    @staticmethod
    def _tensor_desc(t, width: int):
        """(addr, len, dev_id[, ""]) and "cuda"/"cpu" of a tensor-like object."""
        dev = t.get_device()
        mem = "cuda" if str(t.device).startswith("cuda") else "cpu"
        d = (t.data_ptr(), t.numel() * t.element_size(), dev if dev >= 0 else 0)
        return (d + ("",) if width == 4 else d), mem

    def _descs(self, cls, descs, mem_type, is_sorted):
        if isinstance(descs, cls):
            return descs
        if isinstance(descs, nixlBind._DList):
            raise nixlBind.nixlInvalidParamError(
                f"nixl_agent {self.name!r}: a {type(descs).__name__} was given where a {cls.__name__} is needed "
                f"(use {'get_reg_descs' if cls is nixlBind.nixlRegDList else 'get_xfer_descs'})")
        if hasattr(descs, "data_ptr"):
            d, mem = self._tensor_desc(descs, cls.width)
            return cls(self._mem(mem), [d], is_sorted)
        descs = list(descs)
        if not descs:
            if mem_type is None:
                raise nixlBind.nixlInvalidParamError(f"nixl_agent {self.name!r}: an empty list needs a mem_type")
            return cls(self._mem(mem_type), [], is_sorted)
        if hasattr(descs[0], "data_ptr"):
            out, mem0 = [], None
            for i, t in enumerate(descs):
                d, mem = self._tensor_desc(t, cls.width)
                if mem0 is not None and mem != mem0:
                    raise nixlBind.nixlInvalidParamError(
                        f"nixl_agent {self.name!r}: tensor {i} is {mem} memory, tensor 0 {mem0}: one memory type per list")
                mem0 = mem
                out.append(d)
            return cls(self._mem(mem0), out, is_sorted)
        if mem_type is None:
            raise nixlBind.nixlInvalidParamError(
                f"nixl_agent {self.name!r}: a list of tuples needs a mem_type (\"DRAM\" or \"VRAM\")")
        return cls(self._mem(mem_type), descs, is_sorted)

    def get_reg_descs(self, descs, mem_type: Optional[str] = None, is_sorted: bool = False) -> nixlBind.nixlRegDList:
        """A registration list from (addr, len, dev_id, meta) tuples with
        mem_type, a tensor, a list of tensors, or a nixlRegDList."""
        return self._descs(nixlBind.nixlRegDList, descs, mem_type, is_sorted)

    def get_xfer_descs(self, descs, mem_type: Optional[str] = None, is_sorted: bool = False) -> nixlBind.nixlXferDList:
        """A transfer list from (addr, len, dev_id) tuples with mem_type, a
        tensor, a list of tensors, or a nixlXferDList."""
        return self._descs(nixlBind.nixlXferDList, descs, mem_type, is_sorted)

    @staticmethod
    def _kind(dl) -> str:
        seg = dl.getType()
        if seg not in (nixlBind.DRAM_SEG, nixlBind.VRAM_SEG):
            raise nixlBind.nixlNotSupportedError(
                f"nixl: {nixlBind.seg_name(seg)} memory is not supported by kvxfer (DRAM and VRAM only)")
        return "DRAM" if seg == nixlBind.DRAM_SEG else "VRAM"

    # -- memory ------------------------------------------------------------
    def register_memory(self, reg_list, mem_type: Optional[str] = None, is_sorted: bool = False,
                        backends: Optional[list[str]] = None) -> nixlBind.nixlRegDList:
        """Register the list (all or nothing); returns it for
        deregister_memory."""
        descs = self.get_reg_descs(reg_list, mem_type, is_sorted)
        if getattr(descs, "_kvx_reg", None):
            raise nixlBind.nixlInvalidParamError(f"nixl_agent {self.name!r}: this descriptor list is registered already")
        with _translate:
            descs._kvx_reg = self._agent.register([d[:3] for d in descs.descs], self._kind(descs))
        return descs

    def deregister_memory(self, dereg_list: nixlBind.nixlRegDList, backends: Optional[list[str]] = None):
        reg = getattr(dereg_list, "_kvx_reg", None)
        if not reg:
            raise nixlBind.nixlNotFoundError(
                f"nixl_agent {self.name!r}: deregister_memory: the list was not registered by register_memory "
                "(or was deregistered already)")
        with _translate:
            self._agent.deregister(reg)
        dereg_list._kvx_reg = None

    # -- metadata and remote agents ------------------------------------------
    def get_agent_metadata(self) -> bytes:
        with _translate:
            return self._agent.metadata()

    def add_remote_agent(self, metadata: bytes) -> str:
        """Load a remote agent's metadata (connects to it); returns its name."""
        with _translate:
            name = self._agent.add_remote(bytes(metadata))
        with self._lock:
            self._remotes.add(name)
        return name

    def remove_remote_agent(self, agent: str):
        with self._lock:
            self._remotes.discard(agent)
        with _translate:
            self._agent.remove_remote(agent)

    def make_connection(self, remote_agent: str, backends: Optional[list[str]] = None):
        """kvxfer connects in add_remote_agent; this checks the agent is added."""
        if not self.check_remote_metadata(remote_agent):
            raise nixlBind.nixlNotFoundError(f"nixl_agent {self.name!r}: remote agent {remote_agent!r} is not added")

    def check_remote_metadata(self, agent: str, descs=None) -> bool:
        """True when agent was added (descriptors are checked at prep)."""
        with self._lock:
            return agent in self._remotes

    def _unsupported(self, what: str):
        raise nixlBind.nixlNotSupportedError(
            f"nixl_agent {self.name!r}: {what} is not supported by kvxfer's nixl package: exchange "
            "get_agent_metadata() out of band and load it with add_remote_agent")

    def get_partial_agent_metadata(self, *a, **k) -> bytes:
        self._unsupported("partial metadata")

    def send_local_metadata(self, *a, **k):
        self._unsupported("send_local_metadata (NIXL's metadata server/listener)")

    def send_partial_agent_metadata(self, *a, **k):
        self._unsupported("send_partial_agent_metadata")

    def fetch_remote_metadata(self, *a, **k):
        self._unsupported("fetch_remote_metadata (NIXL's metadata server/listener)")

    def invalidate_local_metadata(self, *a, **k):
        self._unsupported("invalidate_local_metadata")

    # -- prepared lists and transfers ----------------------------------------
    def prep_xfer_dlist(self, agent_name: str, xfer_list, mem_type: Optional[str] = None, is_sorted: bool = False,
                        backends: Optional[list[str]] = None) -> nixl_prepped_dlist_handle:
        """Prepare a transfer list: agent_name "NIXL_INIT_AGENT" (or "") for
        this agent's memory, else an added remote agent's name."""
        descs = self.get_xfer_descs(xfer_list, mem_type, is_sorted)
        if agent_name == self.name:
            raise nixlBind.nixlNotSupportedError(
                f"nixl_agent {self.name!r}: loopback transfers (prep_xfer_dlist with the agent's own name) are not "
                "supported by kvxfer; use two agents")
        local = agent_name in ("NIXL_INIT_AGENT", "")
        with _translate:
            return self._agent.prep_dlist("" if local else agent_name, descs.descs, self._kind(descs))

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle):
        with _translate:
            self._agent.release_dlist(handle)

    def make_prepped_xfer(self, operation: str, local_xfer_side: nixl_prepped_dlist_handle, local_indices,
                          remote_xfer_side: nixl_prepped_dlist_handle, remote_indices, notif_msg: bytes = b"",
                          backends: Optional[list[str]] = None, skip_desc_merge: bool = False) -> nixl_xfer_handle:
        """A transfer of local_xfer_side[local_indices[i]] and
        remote_xfer_side[remote_indices[i]]; notif_msg goes to the remote
        agent once the data landed."""
        if operation not in self.nixl_ops:
            raise nixlBind.nixlInvalidParamError(f"nixl_agent {self.name!r}: operation {operation!r}: want \"READ\" or \"WRITE\"")
        with _translate:
            return self._agent.make_xfer(operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices,
                                         notif_msg or None)

    def initialize_xfer(self, operation: str, local_descs, remote_descs, remote_agent: str, notif_msg: bytes = b"",
                        backends: Optional[list[str]] = None) -> nixl_xfer_handle:
        """make_prepped_xfer over two lists prepared for this transfer only
        (released with it)."""
        ld = self.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs)
        try:
            rd = self.prep_xfer_dlist(remote_agent, remote_descs)
        except Exception:
            self.release_dlist_handle(ld)
            raise
        n = len(self.get_xfer_descs(local_descs))
        try:
            h = self.make_prepped_xfer(operation, ld, list(range(n)), rd, list(range(n)), notif_msg)
        except Exception:
            self.release_dlist_handle(ld)
            self.release_dlist_handle(rd)
            raise
        with self._lock:
            self._xfer_dlists[h] = (ld, rd)
        return h

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Post the transfer: "PROC" (the state is then polled), or "ERR"
        when the post failed (check_xfer_state says ERR too)."""
        try:
            return STATE_NAMES[self._agent.post(handle, notif_msg or None)]
        except kvxfer.KvxError as e:
            if e.status in (_lib.ERR_BAD_HANDLE, _lib.ERR_BUSY, _lib.ERR_INVALID_ARGUMENT):
                raise _nixl_error(e) from e
            return "ERR"

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """"DONE", "PROC" or "ERR"."""
        with _translate:
            st, _ = self._agent.state(handle)
        return STATE_NAMES[st]

    def xfer_error(self, handle: nixl_xfer_handle) -> str:
        """kvxfer extension: why the transfer is "ERR" ("" otherwise)."""
        with _translate:
            return self._agent.state(handle)[1]

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlBind.nixlXferTelemetry:
        """The last post's telemetry (microseconds)."""
        with _translate:
            t = self._agent.telemetry(handle)
        return nixlBind.nixlXferTelemetry(t.start_us, t.post_us, t.xfer_us, t.total_bytes, t.desc_count)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        return self.plugin_list[0]

    def release_xfer_handle(self, handle: nixl_xfer_handle):
        """Release the transfer (cancelling it first when active: nothing
        moves and no notification is sent after this returns)."""
        with _translate:
            self._agent.release(handle)
        with self._lock:
            lists = self._xfer_dlists.pop(handle, ())
        for dl in lists:
            self.release_dlist_handle(dl)

    # -- notifications --------------------------------------------------------
    def get_new_notifs(self, backends: Optional[list[str]] = None) -> dict[str, list[bytes]]:
        """{remote agent name: [message, ...]} received since the last call."""
        with _translate:
            return self._agent.get_notifs()

    def update_notifs(self, backends: Optional[list[str]] = None) -> dict[str, list[bytes]]:
        """Add the new notifications to self.notifs and return it."""
        new = self.get_new_notifs()
        with self._lock:
            for k, v in new.items():
                self.notifs.setdefault(k, []).extend(v)
            return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes, backends: Optional[list[str]] = None,
                               tag_is_prefix: bool = True) -> bool:
        """Whether a notification from remote_agent_name matches lookup_tag
        (and remove that one)."""
        self.update_notifs()
        tag = lookup_tag.encode() if isinstance(lookup_tag, str) else bytes(lookup_tag)
        with self._lock:
            msgs = self.notifs.get(remote_agent_name, [])
            for i, m in enumerate(msgs):
                if (tag_is_prefix and m.startswith(tag)) or (not tag_is_prefix and tag in m):
                    del msgs[i]
                    return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: Optional[str] = None):
        """A notification on its own to an added remote agent."""
        with _translate:
            self._agent.send_notif(remote_agent_name, notif_msg)

    # -- descriptor list serialisation (never pickle) -------------------------
    _SER_MAGIC = b"KVXDL\x01"

    def get_serialized_descs(self, descs) -> bytes:
        """A versioned binary encoding of a descriptor list (not pickle)."""
        reg = isinstance(descs, nixlBind.nixlRegDList)
        if not isinstance(descs, nixlBind._DList):
            raise nixlBind.nixlInvalidParamError(f"nixl_agent {self.name!r}: get_serialized_descs takes a descriptor list")
        b = bytearray(self._SER_MAGIC + struct.pack("<BBI", int(reg), descs.getType(), len(descs)))
        for d in descs:
            b += struct.pack("<QQi", int(d[0]), int(d[1]), int(d[2]))
            if reg:
                meta = (d[3] or "").encode() if isinstance(d[3], str) else bytes(d[3] or b"")
                b += struct.pack("<I", len(meta)) + meta
        return bytes(b)

    def deserialize_descs(self, serialized_descs: bytes):
        """The list get_serialized_descs encoded; nixlInvalidParamError for
        anything else."""
        b = bytes(serialized_descs)
        bad = nixlBind.nixlInvalidParamError
        if not b.startswith(self._SER_MAGIC) or len(b) < len(self._SER_MAGIC) + 6:
            raise bad("nixl: deserialize_descs: not a kvxfer descriptor list (pickled NIXL lists are not accepted)")
        off = len(self._SER_MAGIC)
        reg, seg, n = struct.unpack_from("<BBI", b, off)
        off += 6
        out = []
        try:
            for _ in range(n):
                a, ln, dev = struct.unpack_from("<QQi", b, off)
                off += 20
                if reg:
                    (m,) = struct.unpack_from("<I", b, off)
                    meta = b[off + 4: off + 4 + m]
                    if len(meta) != m:
                        raise struct.error("truncated")
                    off += 4 + m
                    out.append((a, ln, dev, meta.decode(errors="replace")))
                else:
                    out.append((a, ln, dev))
        except struct.error:
            raise bad(f"nixl: deserialize_descs: truncated after {len(out)} of {n} descriptors") from None
        if off != len(b):
            raise bad(f"nixl: deserialize_descs: {len(b) - off} bytes after the last descriptor")
        return (nixlBind.nixlRegDList if reg else nixlBind.nixlXferDList)(seg, out)

    # -- lifetime -------------------------------------------------------------
    def close(self):
        """kvxfer extension: close the agent now (else at garbage collection)."""
        self._agent.close()

    def __del__(self):
        try:
            self._agent.close()
        except Exception:
            pass
