"""kvxfer's NIXL-shaped agent over libkvxfer (kvx_agent_*, package
engine/agent): what NIXL's nixlAgent is to vLLM's NixlConnector.

An Agent registers memory, exports its metadata (a versioned byte string,
never pickle) for peers to load (add_remote), prepares descriptor lists for
its own memory (AGENT_LOCAL) and for a remote agent's, makes READ/WRITE
requests addressed by descriptor index with an optional notification, posts
and polls them. The notification reaches the remote agent only once the data
landed; a cancelled or released request moves no byte and sends no
notification afterwards; remove_remote fences the removed agent (its
transfers into this agent's memory fail, its notifications are refused).

The ``nixl`` compatibility package (python/nixl) wraps this class in NIXL's
Python API (``nixl._api.nixl_agent``).

Descriptors are (addr, len, dev_id) tuples, as NIXL's; an index list is a
list of ints or a numpy integer array. Every method is thread-safe.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections import namedtuple
from ctypes import byref, c_int32, c_size_t, c_uint64

from . import _lib
from ._lib import Closable, KvxError

#: Name of the local side in prep_dlist (NIXL's NIXL_INIT_AGENT).
AGENT_LOCAL = _lib.AGENT_LOCAL
#: Environment: the transport an Agent opens when none is given.
TRANSPORT_ENV = "KVXFER_TRANSPORT"
#: Environment: "host" or "host:rpc_port" an Agent binds when none is given.
HOST_ENV = "KVXFER_HOST"

#: Transfer states (kvx_agent_xfer_state).
NOT_POSTED, PROC, DONE, ERR, CANCELED = (
    _lib.XFER_NOT_POSTED,
    _lib.XFER_PROC,
    _lib.XFER_DONE,
    _lib.XFER_ERR,
    _lib.XFER_CANCELED,
)
#: NIXL's name of each state ("PROC", "DONE", every other one "ERR").
STATE_NAMES = {NOT_POSTED: "ERR", PROC: "PROC", DONE: "DONE", ERR: "ERR", CANCELED: "ERR"}

#: A transfer's last post (microseconds), NIXL's nixlXferTelemetry fields.
Telemetry = namedtuple("Telemetry", "start_us post_us xfer_us total_bytes desc_count")

_MEM_KINDS = {"DRAM": _lib.AGENT_MEM_DRAM, "cpu": _lib.AGENT_MEM_DRAM, "host": _lib.AGENT_MEM_DRAM,
              "VRAM": _lib.AGENT_MEM_VRAM, "cuda": _lib.AGENT_MEM_VRAM}


def mem_kind(mem_type: str) -> int:
    """KVX_AGENT_MEM_* of a NIXL memory type ("DRAM"/"cpu", "VRAM"/"cuda")."""
    try:
        return _MEM_KINDS[mem_type]
    except KeyError:
        raise ValueError(
            f"kvxfer agent: memory type {mem_type!r}: kvxfer moves DRAM (\"DRAM\", \"cpu\") and VRAM "
            "(\"VRAM\", \"cuda\") only"
        ) from None


def _descs(descs) -> tuple[ctypes.Array, int]:
    descs = list(descs)
    arr = (_lib.AgentDesc * len(descs))()
    for i, d in enumerate(descs):
        if len(d) < 3:
            raise ValueError(f"kvxfer agent: descriptor {i} is {d!r}: want (addr, len, dev_id)")
        arr[i].addr, arr[i].len, arr[i].device = int(d[0]), int(d[1]), int(d[2])
    return arr, len(descs)


def _indices(idx, what: str):
    """(pointer, count, keep-alive) of an index list or numpy array."""
    if hasattr(idx, "__array_interface__") and hasattr(idx, "astype"):
        a = idx.astype("int64", copy=False)
        if a.ndim != 1:
            a = a.reshape(-1)
        if not a.flags["C_CONTIGUOUS"]:
            a = a.copy()
        return ctypes.c_void_p(a.ctypes.data), int(a.size), a
    vals = [int(v) for v in idx]
    arr = (ctypes.c_int64 * len(vals))(*vals)
    return ctypes.cast(arr, ctypes.c_void_p), len(vals), arr


def _bytes(msg) -> bytes | None:
    if msg is None:
        return None
    return msg.encode() if isinstance(msg, str) else bytes(msg)


class Agent(Closable):
    """One kvx_agent_t. name must be unique among the agents that talk to
    each other; transport is "tcp" (default: $KVXFER_TRANSPORT, else tcp),
    "auto" (the highest-priority transport here that reaches other hosts),
    "shm" or "rdma"; local_hostname is "host" or "host:rpc_port" the agent
    binds and advertises (default: $KVXFER_HOST, else 127.0.0.1: set it to a
    reachable address across hosts). Timeouts are seconds (0 = the library's
    defaults: 5 s per request, 10 s drain, 120 s per transfer)."""

    def __init__(self, name: str, transport: str | None = None, local_hostname: str | None = None,
                 control_port: int = 0, timeout: float = 0, drain_timeout: float = 0,
                 transfer_timeout: float = 0, max_notifs: int = 0):
        self.name = name
        self._h = 0
        cfg = _lib.AgentConfig()
        cfg.struct_size = ctypes.sizeof(cfg)
        cfg.name = _lib.encode(name)
        cfg.transport = _lib.encode(transport or os.environ.get(TRANSPORT_ENV) or "tcp")
        cfg.local_hostname = _lib.encode(local_hostname or os.environ.get(HOST_ENV) or None)
        cfg.control_port = int(control_port)
        cfg.timeout_ms = int(timeout * 1000)
        cfg.drain_timeout_ms = int(drain_timeout * 1000)
        cfg.transfer_timeout_ms = int(transfer_timeout * 1000)
        cfg.max_notifs = int(max_notifs)
        h = c_uint64(0)
        _lib.call("kvx_agent_create", byref(cfg), byref(h))
        self._h = h.value

    # -- memory -----------------------------------------------------------
    def register(self, descs, mem_type: str = "DRAM") -> int:
        """Register [(addr, len, dev_id), ...] (all or nothing); returns the
        handle deregister takes."""
        arr, n = _descs(descs)
        out = c_uint64(0)
        _lib.call("kvx_agent_register", self._h, mem_kind(mem_type), arr, n, byref(out))
        return out.value

    def deregister(self, reg: int) -> None:
        _lib.call("kvx_agent_deregister", self._h, int(reg))

    # -- metadata and remote agents ---------------------------------------
    def metadata(self) -> bytes:
        """The agent's metadata, for peers' add_remote."""
        need = c_size_t(0)
        buf = ctypes.create_string_buffer(4096)
        _lib.call("kvx_agent_metadata", self._h, buf, len(buf), byref(need))
        return buf.raw[: need.value]

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata (connects to it); returns its name."""
        md = bytes(metadata)
        need = c_size_t(0)
        name = ctypes.create_string_buffer(512)
        _lib.call("kvx_agent_add_remote", self._h, md, len(md), name, len(name), byref(need))
        return name.value.decode()

    def remove_remote(self, name: str) -> None:
        """Forget and fence a remote agent."""
        _lib.call("kvx_agent_remove_remote", self._h, _lib.encode(name))

    # -- descriptor lists and requests ------------------------------------
    def prep_dlist(self, agent: str, descs, mem_type: str = "DRAM") -> int:
        """Prepare [(addr, len, dev_id), ...] of agent (AGENT_LOCAL or "" =
        this agent's memory)."""
        arr, n = _descs(descs)
        out = c_uint64(0)
        _lib.call("kvx_agent_prep_dlist", self._h, _lib.encode(agent or None), mem_kind(mem_type), arr, n, byref(out))
        return out.value

    def release_dlist(self, dlist: int) -> None:
        _lib.call("kvx_agent_release_dlist", self._h, int(dlist))

    def make_xfer(self, op: str, local: int, local_idx, remote: int, remote_idx, notif=None) -> int:
        """A request: op "READ" or "WRITE", local[local_idx[i]] with
        remote[remote_idx[i]]; notif (bytes/str) goes to the remote agent
        once the data landed."""
        ops = {"READ": _lib.XFER_READ, "WRITE": _lib.XFER_WRITE}
        if op not in ops:
            raise ValueError(f"kvxfer agent: operation {op!r}: want \"READ\" or \"WRITE\"")
        lp, ln, lk = _indices(local_idx, "local indices")
        rp, rn, rk = _indices(remote_idx, "remote indices")
        if ln != rn:
            raise ValueError(f"kvxfer agent: {ln} local and {rn} remote indices: want the same number")
        msg = _bytes(notif) or None
        out = c_uint64(0)
        _lib.call("kvx_agent_make_xfer", self._h, ops[op], int(local), lp, int(remote), rp, ln,
                  msg, len(msg) if msg else 0, byref(out))
        del lk, rk
        return out.value

    def post(self, xfer: int, notif=None) -> int:
        """Start (or restart) a request; notif replaces its notification.
        Returns PROC; raises KvxError when the post failed (the state is ERR)."""
        msg = _bytes(notif)
        st = c_int32(0)
        _lib.call("kvx_agent_post", self._h, int(xfer), msg, len(msg) if msg else 0, byref(st))
        return st.value

    def state(self, xfer: int) -> tuple[int, str]:
        """(state, reason): reason is "" for PROC and DONE. Raises KvxError
        for a handle that is not this agent's."""
        st = c_int32(0)
        rc, msg = _lib.try_call("kvx_agent_xfer_state", self._h, int(xfer), byref(st))
        if rc == _lib.ERR_BAD_HANDLE:
            raise KvxError(rc, "kvx_agent_xfer_state", msg)
        return st.value, msg

    def wait(self, xfer: int, timeout: float = 0) -> tuple[int, str]:
        """Wait for the current post to end (timeout seconds, 0 = the
        transfer timeout); returns state() then (PROC and the reason when
        the wait timed out)."""
        st = c_int32(0)
        rc, msg = _lib.try_call("kvx_agent_xfer_wait", self._h, int(xfer), int(timeout * 1000), byref(st))
        if rc == _lib.ERR_BAD_HANDLE:
            raise KvxError(rc, "kvx_agent_xfer_wait", msg)
        return st.value, msg

    def cancel(self, xfer: int) -> int:
        """Stop an in-flight request; returns its final state."""
        st = c_int32(0)
        _lib.call("kvx_agent_xfer_cancel", self._h, int(xfer), byref(st))
        return st.value

    def release(self, xfer: int) -> None:
        """Forget a request (cancelling it first when in flight)."""
        _lib.call("kvx_agent_xfer_release", self._h, int(xfer))

    def telemetry(self, xfer: int) -> Telemetry:
        t = _lib.XferTelemetry()
        _lib.call("kvx_agent_xfer_telemetry", self._h, int(xfer), byref(t))
        return Telemetry(t.start_us, t.post_us, t.xfer_us, t.total_bytes, t.desc_count)

    # -- notifications ----------------------------------------------------
    def send_notif(self, agent: str, msg) -> None:
        """Send a notification on its own to an added remote agent."""
        b = _bytes(msg) or b""
        _lib.call("kvx_agent_send_notif", self._h, _lib.encode(agent), b, len(b))

    def get_notifs(self) -> dict[str, list[bytes]]:
        """The notifications received since the last call, by sender."""
        need = c_size_t(0)
        buf = ctypes.create_string_buffer(64 << 10)
        rc, msg = _lib.try_call("kvx_agent_get_notifs", self._h, buf, len(buf), byref(need))
        if rc == _lib.ERR_BUFFER_TOO_SMALL:
            buf = ctypes.create_string_buffer(need.value)
            rc, msg = _lib.try_call("kvx_agent_get_notifs", self._h, buf, len(buf), byref(need))
        if rc != _lib.OK:
            raise KvxError(rc, "kvx_agent_get_notifs", msg)
        raw, out, off = buf.raw[: need.value], {}, 0
        while off < len(raw):
            (n,) = struct.unpack_from("<I", raw, off)
            name = raw[off + 4: off + 4 + n].decode()
            off += 4 + n
            (m,) = struct.unpack_from("<I", raw, off)
            out.setdefault(name, []).append(raw[off + 4: off + 4 + m])
            off += 4 + m
        return out

    def close(self) -> None:
        """Cancel the requests and close the agent. Idempotent."""
        h, self._h = self._h, 0
        if h:
            _lib.call("kvx_agent_destroy", h)
