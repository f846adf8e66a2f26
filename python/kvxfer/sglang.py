"""kvxfer.sglang: a KV transfer backend with SGLang's disaggregation interface
shapes (``python/sglang/srt/disaggregation/base/conn.py``): KVArgs, KVPoll,
KVManager, KVSender, KVReceiver, KVBootstrapServer, plus KVTransferMetric and
KVTransferError as SGLang defines them.

The buffers are the caller's (SGLang's per-layer K/V tensors, aux rows, state
buffers); kvxfer registers them and moves pages between them (kvx_kv_* C ABI).
Per-request failures never raise from constructors or send()/send_metadata():
they surface as poll() == KVPoll.Failed, and failure_exception() raises a
KVTransferError whose message is kvxfer's error (room, peer, step). Only
programming errors (wrong types) raise directly.

Configuration, beyond what SGLang passes (server_args attributes win over the
environment): transport ``server_args.kvxfer_transport`` / KVXFER_TRANSPORT
("auto" default: rdma > shm > tcp, with shm falling back to tcp when the
buffers are not kvxfer.HostBuffer memory), host ``server_args.kvxfer_host`` /
KVXFER_HOST (control and data-plane address; default server_args.host, a
wildcard meaning loopback), checksum KVXFER_CHECKSUM=1 (decode verifies a
CRC32C), segment metadata KVXFER_METADATA (etcd://...; default P2P), the
directory's bearer token ``server_args.bootstrap_auth_token`` /
KVXFER_BOOTSTRAP_AUTH_TOKEN / SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN, the
advertised host KVXFER_ADVERTISE_HOST, control-frame authentication
KVManager(..., control_auth=True) / ``server_args.kvxfer_control_auth`` /
KVXFER_CONTROL_AUTH=1 (an HMAC keyed by that token on every control frame;
untagged or replayed frames are dropped; every rank needs it and the same
token), the control peer bound KVManager(..., max_peers=N) /
``server_args.kvxfer_max_peers`` / KVXFER_MAX_PEERS (default 1024).
Timeouts: SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT and
SGLANG_DISAGGREGATION_WAITING_TIMEOUT (seconds, 300 by default), read when a
KVManager is created. (The library itself sees the environment only as it
was when it was loaded, e.g. KVXFER_LOG_LEVEL and the heartbeat settings:
set those before the first kvxfer call.)
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import logging
import os
import threading
from typing import List, Optional

from . import _lib
from ._lib import Closable, KvxError
from ._memory import pointer_location

log = logging.getLogger("kvxfer")


class KVPoll:
    """SGLang's KVPoll values (all-reduce them with MIN across a TP group)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


_POLL_NAMES = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}


class DisaggregationMode(enum.Enum):
    """SGLang's DisaggregationMode (KVManager also accepts its own enum, or
    the strings "prefill" / "decode")."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclasses.dataclass
class KVTransferMetric:
    """SGLang's KVTransferMetric: seconds and bytes; None when unknown."""

    transfer_latency_s: Optional[float] = None
    alloc_latency_s: Optional[float] = None
    transfer_total_bytes: Optional[int] = None


class KVTransferError(Exception):
    """SGLang's KVTransferError(bootstrap_room, failure_reason); ``status`` is
    the kvx_status code of the failure (0 when it came from Python)."""

    def __init__(self, bootstrap_room: int, failure_reason: str, status: int = 0):
        super().__init__(failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.status = status

    def __str__(self):
        return f"KVTransferError(bootstrap_room={self.bootstrap_room}): {self.failure_reason}"


class KVArgs:
    """SGLang's KVArgs: set the attributes (or pass them as keywords).

    One entry per buffer in kv_data_ptrs / kv_data_lens (bytes) / kv_item_lens
    (bytes per page): MHA/GQA the K buffer of every layer then the V buffers,
    MLA one per layer. aux_* are host buffers whose row aux_index belongs to
    one request; state_* are lists of lists (one per state component; they are
    flattened). kvxfer extension: kv_location "host" / "cuda:N" (default: asked
    from the CUDA driver for kv_data_ptrs[0], "host" without one)."""

    def __init__(self, **kw):
        self.engine_rank = 0
        self.kv_data_ptrs: List[int] = []
        self.kv_data_lens: List[int] = []
        self.kv_item_lens: List[int] = []
        self.aux_data_ptrs: List[int] = []
        self.aux_data_lens: List[int] = []
        self.aux_item_lens: List[int] = []
        self.state_types: list = []
        self.state_data_ptrs: list = []
        self.state_data_lens: list = []
        self.state_item_lens: list = []
        self.ib_device = ""
        self.ib_traffic_class = ""
        self.gpu_id = 0
        self.kv_head_num = 0
        self.total_kv_head_num = 0
        self.page_size = 1
        self.system_dp_rank = 0
        self.pp_rank = 0
        self.prefill_start_layer = 0
        self.prefill_end_layer = None
        self.dcp_size = 1
        self.dcp_rank = 0
        self.kv_location = None
        for k, v in kw.items():
            setattr(self, k, v)


def _u64_array(values, what):
    vals = [int(v) for v in (values or [])]
    for i, v in enumerate(vals):
        if v < 0:
            raise ValueError(f"KVArgs.{what}[{i}] = {v} is negative")
    return (ctypes.c_uint64 * max(1, len(vals)))(*vals), len(vals)


def _flatten(lists):
    out = []
    for x in lists or []:
        if isinstance(x, (list, tuple)):
            out.extend(x)
        else:
            out.append(x)
    return out


def _int32_list(indices, what):
    """(pointer, count, keep-alive) for an int32 index list: a numpy array
    (int32 and contiguous ones are passed without copying), a list, a range,
    or None / empty."""
    if indices is None:
        return None, 0, None
    if hasattr(indices, "__array_interface__") and hasattr(indices, "ctypes"):
        a = indices
        if str(a.dtype) != "int32" or not a.flags["C_CONTIGUOUS"] or a.ndim != 1:
            a = a.reshape(-1).astype("int32")
        n = int(a.shape[0])
        if n == 0:
            return None, 0, None
        return a.ctypes.data_as(_lib.i32p), n, a
    vals = [int(v) for v in indices]
    if not vals:
        return None, 0, None
    for i, v in enumerate(vals):
        if not -(1 << 31) <= v < (1 << 31):
            raise ValueError(f"{what}[{i}] = {v} does not fit an int32")
    arr = (ctypes.c_int32 * len(vals))(*vals)
    return ctypes.cast(arr, _lib.i32p), len(vals), arr


def _env_ms(name) -> int:
    """An environment variable holding seconds -> ms (0 when unset: the
    library's default, 300 s). Read here, at manager creation, because the
    library only sees the environment as it was when it was loaded."""
    raw = os.environ.get(name, "")
    if raw == "":
        return 0
    try:
        sec = float(raw)
    except ValueError:
        sec = -1
    if not 0 < sec < 4e6:
        raise ValueError(f"{name}={raw!r}: want a positive number of seconds")
    return max(1, int(sec * 1000))


def _mode(m) -> str:
    v = getattr(m, "value", m)
    v = str(v).lower()
    if v not in ("prefill", "decode"):
        raise ValueError(f"disaggregation_mode {m!r}: want prefill or decode")
    return v


def _loopback(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1", "": "127.0.0.1"}.get(host, host)


class KVManager(Closable):
    """One rank's KV transfer manager: registers the rank's buffers (KVArgs)
    and its control socket; a prefill manager also registers the rank with its
    bootstrap server (server_args.host or the host of dist_init_addr, port
    server_args.disaggregation_bootstrap_port).

    server_args may be SGLang's ServerArgs or any object with (some of) its
    attributes: host, disaggregation_bootstrap_port (8998), dist_init_addr,
    tp_size, dp_size, pp_size, enable_dp_attention, kv_cache_dtype ("auto").
    control_auth (bool) turns control-frame authentication on or off and
    max_peers (int >= 1) bounds the control peers (kvxfer extensions; None:
    server_args.kvxfer_control_auth / kvxfer_max_peers, else the environment,
    KVXFER_CONTROL_AUTH and KVXFER_MAX_PEERS). control_auth needs the
    deployment's token (server_args.bootstrap_auth_token or the environment).
    Raises KvxError when the manager cannot start (the message says which
    buffer or setting and why), ValueError for a max_peers below 1. close()
    frees it (idempotent)."""

    def __init__(self, args: KVArgs, disaggregation_mode, server_args, is_mla_backend: Optional[bool] = False,
                 control_auth: Optional[bool] = None, max_peers: Optional[int] = None):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.mode = _mode(disaggregation_mode)
        self._engine = 0
        self._kv = 0
        self._lock = threading.Lock()
        self._rooms: set = set()
        if control_auth is None:
            control_auth = getattr(server_args, "kvxfer_control_auth", None)
        if max_peers is None:
            max_peers = getattr(server_args, "kvxfer_max_peers", None)
        if max_peers is not None and (int(max_peers) < 1 or int(max_peers) > 1 << 20):
            raise ValueError(f"max_peers {max_peers}: want 1 … 1048576 control peers (default 1024)")
        self.control_auth = control_auth
        self.max_peers = max_peers

        sa = server_args
        tp_size = int(getattr(sa, "tp_size", 1) or 1)
        dp_size = int(getattr(sa, "dp_size", 1) or 1)
        dp_attention = bool(getattr(sa, "enable_dp_attention", False))
        self.attn_tp_size = max(1, tp_size // dp_size) if dp_attention else tp_size
        self.tp_rank = int(args.engine_rank) % self.attn_tp_size
        self.dp_size = dp_size
        self.dp_rank = int(args.engine_rank) // self.attn_tp_size if dp_attention else int(getattr(args, "system_dp_rank", 0) or 0)
        self.pp_size = int(getattr(sa, "pp_size", 1) or 1)
        host = getattr(sa, "kvxfer_host", None) or os.environ.get("KVXFER_HOST") or _loopback(str(getattr(sa, "host", "127.0.0.1") or "127.0.0.1"))
        self.host = host
        self.bootstrap_addr = None
        if self.mode == "prefill":
            bhost = _loopback(str(getattr(sa, "host", "127.0.0.1") or "127.0.0.1"))
            dist = getattr(sa, "dist_init_addr", None)
            if dist:
                bhost = dist.rsplit(":", 1)[0].strip("[]")
            port = int(getattr(sa, "disaggregation_bootstrap_port", 8998) or 8998)
            self.bootstrap_addr = f"[{bhost}]:{port}" if ":" in bhost else f"{bhost}:{port}"
        transport = getattr(sa, "kvxfer_transport", None) or os.environ.get("KVXFER_TRANSPORT") or "auto"
        try:
            self._start(transport)
        except BaseException:
            self.close()
            raise

    def _kv_config(self, keep):
        a = self.kv_args
        c = _lib.KVConfig()
        c.struct_size = ctypes.sizeof(c)
        c.page_size = int(a.page_size or 1)
        c.tp_size = self.attn_tp_size
        c.tp_rank = self.tp_rank
        c.pp_size = self.pp_size
        c.pp_rank = int(a.pp_rank or 0)
        c.dp_size = self.dp_size
        c.dp_rank = self.dp_rank
        c.checksum = 1 if os.environ.get("KVXFER_CHECKSUM", "") in ("1", "true", "yes", "on") else 0
        c.bootstrap_timeout_ms = _env_ms("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")
        c.waiting_timeout_ms = _env_ms("SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
        c.kv_cache_dtype = _lib.encode(str(getattr(self.server_args, "kv_cache_dtype", "auto") or "auto"))
        c.control_host = _lib.encode(self.host)
        lists = {}
        for name in ("kv_data_ptrs", "kv_data_lens", "kv_item_lens", "aux_data_ptrs", "aux_data_lens", "aux_item_lens"):
            lists[name] = _u64_array(getattr(a, name, None), name)
        for name in ("state_data_ptrs", "state_data_lens", "state_item_lens"):
            lists[name] = _u64_array(_flatten(getattr(a, name, None)), name)
        nkv = lists["kv_data_ptrs"][1]
        if nkv == 0:
            raise ValueError("KVArgs.kv_data_ptrs is empty: give the rank's KV buffers (K of every layer then V; MLA one per layer)")
        for group in (("kv_data_ptrs", "kv_data_lens", "kv_item_lens"), ("aux_data_ptrs", "aux_data_lens", "aux_item_lens"),
                      ("state_data_ptrs", "state_data_lens", "state_item_lens")):
            counts = {lists[g][1] for g in group}
            if len(counts) != 1:
                raise ValueError(f"KVArgs: {', '.join(f'{g} has {lists[g][1]}' for g in group)} entries; they must be parallel lists")
        c.num_kv_buffers = nkv
        c.num_aux_buffers = lists["aux_data_ptrs"][1]
        c.num_state_buffers = lists["state_data_ptrs"][1]
        for name, (arr, _) in lists.items():
            setattr(c, name, ctypes.cast(arr, _lib.u64p))
        keep.append(lists)
        c.kv_head_num = int(a.kv_head_num or 0)
        c.total_kv_head_num = int(a.total_kv_head_num or 0)
        c.is_mla = 1 if self.is_mla_backend else 0
        c.prefill_start_layer = int(a.prefill_start_layer or 0)
        c.system_dp_rank = int(a.system_dp_rank or 0)
        loc = getattr(a, "kv_location", None) or pointer_location(int(a.kv_data_ptrs[0]))
        c.kv_location = _lib.encode(loc)
        c.ib_device = _lib.encode(a.ib_device or None)
        token = os.environ.get("KVXFER_BOOTSTRAP_AUTH_TOKEN") or os.environ.get("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN")
        c.bootstrap_auth_token = _lib.encode(getattr(self.server_args, "bootstrap_auth_token", None) or token or None)
        c.advertise_host = _lib.encode(os.environ.get("KVXFER_ADVERTISE_HOST") or None)
        # None leaves both to the library's environment fallback.
        if self.control_auth is not None:
            c.control_auth = _lib.CONTROL_AUTH_ON if self.control_auth else _lib.CONTROL_AUTH_OFF
        if self.max_peers is not None:
            c.max_peers = int(self.max_peers)
        return c

    def _engine_create(self, transport):
        cfg = _lib.EngineConfig()
        cfg.struct_size = ctypes.sizeof(cfg)
        cfg.role = _lib.ROLE_PREFILL if self.mode == "prefill" else _lib.ROLE_DECODE
        cfg.transport = transport.encode()
        cfg.listen_host = self.host.encode()
        cfg.local_hostname = self.host.encode()
        cfg.bootstrap_addr = _lib.encode(self.bootstrap_addr)
        cfg.devices = _lib.encode(self.kv_args.ib_device or None)
        cfg.metadata_server = _lib.encode(os.environ.get("KVXFER_METADATA") or "P2PHANDSHAKE")
        out = ctypes.c_uint64(0)
        _lib.call("kvx_engine_create", ctypes.byref(cfg), ctypes.byref(out))
        return out.value

    def _start(self, transport):
        keep = []
        cfg = self._kv_config(keep)
        self._engine = self._engine_create(transport)
        self.transport = _lib.get_string("kvx_engine_transport", self._engine)
        out = ctypes.c_uint64(0)
        rc, msg = _lib.try_call("kvx_kv_create", self._engine, ctypes.byref(cfg), ctypes.byref(out))
        if rc == _lib.ERR_UNSUPPORTED_MEMORY and transport == "auto" and self.transport == "shm":
            # shm shares memory by file descriptor (kvxfer.HostBuffer); plain
            # buffers go over tcp instead.
            log.info("kvxfer: %s rank %d: buffers are not kvxfer.HostBuffer memory, so shm cannot share them; using tcp",
                     self.mode, self.tp_rank)
            _lib.try_call("kvx_engine_destroy", self._engine)
            self._engine = self._engine_create("tcp")
            self.transport = "tcp"
            rc, msg = _lib.try_call("kvx_kv_create", self._engine, ctypes.byref(cfg), ctypes.byref(out))
        if rc != _lib.OK:
            raise KvxError(rc, "kvx_kv_create", f"{self.mode} KV manager (tp rank {self.tp_rank}, transport {self.transport}): {msg}")
        self._kv = out.value
        lay = _lib.KVLayout()
        _lib.call("kvx_kv_layout_get", self._kv, ctypes.byref(lay))
        self.num_pages = lay.num_pages

    def register_to_bootstrap(self):
        """Kept for SGLang's interface: a prefill manager registered its rank
        with the bootstrap server when it was created (retrying until the
        bootstrap timeout), so this does nothing."""

    def close(self):
        """Close the rank's rooms, its control socket and its engine. The
        buffers stay the caller's. Idempotent."""
        with self._lock:
            kv, self._kv = self._kv, 0
            eng, self._engine = self._engine, 0
        if kv:
            _lib.try_call("kvx_kv_destroy", kv)
        if eng:
            _lib.try_call("kvx_engine_destroy", eng)


class _Room:
    """What KVSender and KVReceiver share: the kvx room handle, a local
    failure (set when a call was refused), poll, failure, abort, clear."""

    def __init__(self, mgr: KVManager, bootstrap_room):
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self._h = 0
        self._failure: Optional[tuple] = None  # (status, message)
        self._final: Optional[int] = None  # poll value kept by clear()

    def _fail_local(self, status, message):
        if self._failure is None:
            self._failure = (status, message)
            log.warning("kvxfer: room %s: %s", self.bootstrap_room, message)
        if self._h:
            _lib.try_call("kvx_kv_abort", self._h)  # the peer learns the room failed

    def _index_lists(self, kv_indices, state_indices):
        """(pages ptr, n, keep, state ptr, n, keep) as int32 arrays, or None
        after failing the room when an index is not an int32."""
        try:
            ptr, n, keep = _int32_list(kv_indices, "kv_indices")
            flat = _flatten(state_indices) if isinstance(state_indices, (list, tuple)) else state_indices
            sptr, sn, skeep = _int32_list(flat, "state_indices")
        except (TypeError, ValueError) as e:
            self._fail_local(_lib.ERR_INVALID_ARGUMENT, str(e))
            return None
        return ptr, n, keep, sptr, sn, skeep

    def poll(self) -> int:
        """The room's KVPoll value (non-blocking)."""
        if self._failure is not None:
            return KVPoll.Failed
        if not self._h:
            return self._final if self._final is not None else KVPoll.Bootstrapping
        st = ctypes.c_int32(0)
        rc, msg = _lib.try_call("kvx_kv_poll", self._h, ctypes.byref(st))
        if rc != _lib.OK:
            if self._final is not None:
                return self._final
            self._failure = (rc, msg)
            return KVPoll.Failed
        return st.value

    def wait(self, want: int = KVPoll.Success, timeout_s: float = 30.0) -> int:
        """kvxfer extension: block until the state is at least `want` (or
        Failed) or timeout_s passes; returns the state reached."""
        if self._failure is not None or not self._h:
            return self.poll()
        st = ctypes.c_int32(0)
        rc, msg = _lib.try_call("kvx_kv_wait", self._h, int(want), int(timeout_s * 1000), ctypes.byref(st))
        if rc not in (_lib.OK, _lib.ERR_TIMEOUT):
            return self.poll()
        return st.value

    def failure_reason(self) -> tuple:
        """(kvx status, message) of the failure, or (0, "") when not failed."""
        if self._failure is not None:
            return self._failure
        if not self._h:
            return (0, "")
        rc, msg = _lib.try_call("kvx_kv_failure", self._h)
        return (rc, msg) if rc != _lib.OK else (0, "")

    def failure_exception(self):
        """Raise KVTransferError with kvxfer's error for this room (room, peer,
        step). Called when poll() is Failed; otherwise the message says the
        room has not failed and names its state."""
        status, msg = self.failure_reason()
        if not status:
            state = self.poll()
            msg = f"room {self.bootstrap_room} has not failed (state {_POLL_NAMES.get(state, state)})"
        raise KVTransferError(self.bootstrap_room, msg, status)

    def abort(self):
        """Abort the room: it fails here and the peer is told (its poll
        becomes Failed too)."""
        if self._h:
            _lib.try_call("kvx_kv_abort", self._h)
        elif self._failure is None:
            self._failure = (_lib.ERR_CANCELED, f"room {self.bootstrap_room} aborted before it started")

    def clear(self):
        """Forget the room (aborting it if not finished); poll() keeps
        returning its last state.

        Decode: when it returns, the room's destination pages may go back to
        the page allocator. After Success that is at once; after a failure it
        blocks until every producer of the room is fenced (it acknowledged
        the abort after its last write, normally within milliseconds, or its
        data path was cut after the fence timeout, 5 s; see kvx_kv_close in
        kvxfer.h). Free the pages only after it returns. Prefill: returns
        once no transfer of the room reads its source pages."""
        if self._h:
            self._final = self.poll()
            h, self._h = self._h, 0
            _lib.try_call("kvx_kv_close", h)

    def get_transfer_metric(self) -> KVTransferMetric:
        """transfer_latency_s (first send / send_metadata -> Success),
        transfer_total_bytes (KV + aux + state bytes moved); None when
        unknown."""
        if not self._h:
            return KVTransferMetric()
        m = _lib.TransferMetric()
        m.struct_size = ctypes.sizeof(m)
        rc, _ = _lib.try_call("kvx_kv_metric", self._h, ctypes.byref(m))
        if rc != _lib.OK:
            return KVTransferMetric()
        total = m.bytes + m.aux_bytes
        return KVTransferMetric(
            transfer_latency_s=m.latency_us / 1e6 if m.latency_us else None,
            alloc_latency_s=None,
            transfer_total_bytes=total if total else None,
        )

    def set_num_tokens(self, tokens: int):
        """kvxfer extension: declare the prompt's token count; when both sides
        declare one and they differ the room fails on both, naming both."""
        if self._h:
            rc, msg = _lib.try_call("kvx_kv_set_tokens", self._h, int(tokens))
            if rc != _lib.OK:
                self._fail_local(rc, msg)

    def __del__(self):
        try:
            self.clear()
        except Exception:
            pass


class KVSender(_Room):
    """The prefill side of one request (bootstrap_room). dest_tp_ranks and
    pp_rank are accepted for SGLang's signature; kvxfer computes the decode
    destinations from the TRANSFER requests it receives."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int, dest_tp_ranks: List[int] = None,
                 pp_rank: int = 0, req_has_disagg_prefill_dp_rank: bool = False):
        super().__init__(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.dest_tp_ranks = dest_tp_ranks
        self.pp_rank = pp_rank
        self.num_kv_indices = None
        self.aux_index = None
        self.curr_idx = 0
        if mgr.mode != "prefill":
            raise ValueError("KVSender needs a prefill KVManager (this one is decode)")
        if bootstrap_room is None or not 0 <= int(bootstrap_room) < 1 << 63:
            self._fail_local(_lib.ERR_INVALID_ARGUMENT, f"bootstrap_room {bootstrap_room!r} is not an integer in [0, 2^63)")
            return
        out = ctypes.c_uint64(0)
        rc, msg = _lib.try_call("kvx_kv_sender_create", mgr._kv, int(bootstrap_room), ctypes.byref(out))
        if rc != _lib.OK:
            self._fail_local(rc, msg)
            return
        self._h = out.value

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        """The request's page count (pages after the decode's prefix) and this
        rank's aux row; call once poll() is WaitingForInput (before send)."""
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = aux_index
        if not self._h:
            return
        rc, msg = _lib.try_call("kvx_kv_sender_init_aux", self._h, self.num_kv_indices, -1 if aux_index is None else int(aux_index))
        if rc != _lib.OK:
            self._fail_local(rc, msg)

    def send(self, kv_indices, state_indices: Optional[list] = None, token_position_offset: int = 0):
        """Queue the next chunk of source pages (int32 page indices; numpy or
        a list). The chunk that reaches num_kv_indices is the last: the aux row
        and the state slots (state_indices, one per state slot) follow it,
        then the metadata record and Success."""
        if not self._h:
            return
        if self.num_kv_indices is None:
            self._fail_local(_lib.ERR_INVALID_ARGUMENT, f"send before init(num_kv_indices, aux_index) on room {self.bootstrap_room}")
            return
        lists = self._index_lists(kv_indices, state_indices)
        if lists is None:
            return
        ptr, n, keep, sptr, sn, skeep = lists
        last = self.curr_idx + n >= self.num_kv_indices
        if last and sn:
            rc, msg = _lib.try_call("kvx_kv_sender_state", self._h, sptr, sn)
            if rc != _lib.OK:
                self._fail_local(rc, msg)
                return
        rc, msg = _lib.try_call("kvx_kv_sender_send", self._h, ptr, n, 1 if last else 0)
        del keep, skeep
        if rc != _lib.OK:
            self._fail_local(rc, msg)
            return
        self.curr_idx += n

    def pop_decode_prefix_len(self) -> int:
        """Prompt tokens the decode already holds (0 when none); valid once
        poll() is WaitingForInput."""
        if not self._h:
            return 0
        n = ctypes.c_uint32(0)
        rc, _ = _lib.try_call("kvx_kv_sender_prefix_len", self._h, ctypes.byref(n))
        return n.value if rc == _lib.OK else 0

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """Send a chunk with pages, and always the last one (it completes the
        request even with 0 pages when the decode holds the whole prompt)."""
        return num_pages > 0 or bool(last_chunk)


class KVReceiver(_Room):
    """The decode side of one request. init(prefill_dp_rank) resolves the
    prefill ranks through the bootstrap server at bootstrap_addr
    ("host:port"); before it poll() is Bootstrapping. prefill_dp_rank (or the
    older data_parallel_rank) given here calls init at once."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None,
                 prefill_dp_rank: Optional[int] = None, data_parallel_rank: Optional[int] = None):
        super().__init__(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        if mgr.mode != "decode":
            raise ValueError("KVReceiver needs a decode KVManager (this one is prefill)")
        if bootstrap_room is None or not 0 <= int(bootstrap_room) < 1 << 63:
            self._fail_local(_lib.ERR_INVALID_ARGUMENT, f"bootstrap_room {bootstrap_room!r} is not an integer in [0, 2^63)")
            return
        dp = prefill_dp_rank if prefill_dp_rank is not None else data_parallel_rank
        if dp is not None:
            self.init(dp)

    def init(self, prefill_dp_rank: Optional[int] = None):
        """Start resolving the producers of this room (prefill_dp_rank None
        or < 0: ask the bootstrap server); poll() becomes WaitingForInput when
        the prefill ranks are known and connected."""
        if self._h or self._failure is not None:
            return
        out = ctypes.c_uint64(0)
        dp = -1 if prefill_dp_rank is None else int(prefill_dp_rank)
        rc, msg = _lib.try_call("kvx_kv_receiver_create_dp", self.kv_mgr._kv, _lib.encode(self.bootstrap_addr),
                                int(self.bootstrap_room), dp, ctypes.byref(out))
        if rc != _lib.OK:
            self._fail_local(rc, msg)
            return
        self._h = out.value

    def send_metadata(self, kv_indices, aux_index: Optional[int] = None, state_indices: Optional[list] = None,
                      decode_prefix_len: Optional[int] = None):
        """Destination pages (int32, for the prompt tokens after
        decode_prefix_len), the aux row, the state slots and how many prompt
        tokens this rank already holds (whole pages); the prefill then sends."""
        if not self._h:
            if self._failure is None:
                self._fail_local(_lib.ERR_INVALID_ARGUMENT, f"send_metadata before init(prefill_dp_rank) on room {self.bootstrap_room}")
            return
        lists = self._index_lists(kv_indices, state_indices)
        if lists is None:
            return
        ptr, n, keep, sptr, sn, skeep = lists
        rc, msg = _lib.try_call("kvx_kv_receiver_send_metadata", self._h, ptr, n, -1 if aux_index is None else int(aux_index),
                                sptr, sn, int(decode_prefix_len or 0))
        del keep, skeep
        if rc != _lib.OK:
            self._fail_local(rc, msg)

    def aux_row(self, buffer: int) -> bytes:
        """kvxfer extension: a copy of this request's row of aux buffer
        `buffer` (also in the caller's aux buffer) once poll() is Success."""
        if not self._h:
            raise KVTransferError(self.bootstrap_room, "aux_row: the receiver is not initialized", _lib.ERR_INVALID_ARGUMENT)
        needed = ctypes.c_size_t(0)
        _lib.try_call("kvx_kv_receiver_aux_row", self._h, int(buffer), None, 0, ctypes.byref(needed))
        buf = ctypes.create_string_buffer(max(1, needed.value))
        rc, msg = _lib.try_call("kvx_kv_receiver_aux_row", self._h, int(buffer), buf, len(buf), ctypes.byref(needed))
        if rc != _lib.OK:
            raise KVTransferError(self.bootstrap_room, msg, rc)
        return buf.raw[: needed.value]


class KVBootstrapServer(Closable):
    """kvxfer's SGLang-compatible bootstrap directory, running in this
    process (kvx_bootstrap_start) on host:port (port 0 = a free port; SGLang's
    default is 8998). Extra keyword arguments SGLang passes (dp_size, ...) are
    accepted and ignored: the directory learns the topology from the ranks.
    ``addr`` is "host:port"; close() stops it (idempotent)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8998, **_ignored):
        out = ctypes.c_uint64(0)
        _lib.call("kvx_bootstrap_start", _lib.encode(host), int(port), ctypes.byref(out))
        self._h = out.value
        self.addr = _lib.get_string("kvx_bootstrap_addr", self._h)
        h, _, p = self.addr.rpartition(":")
        self.host = h.strip("[]")
        self.port = int(p)

    def close(self):
        if self._h:
            h, self._h = self._h, 0
            _lib.try_call("kvx_bootstrap_stop", h)


__all__ = [
    "KVArgs",
    "KVPoll",
    "KVManager",
    "KVSender",
    "KVReceiver",
    "KVBootstrapServer",
    "KVTransferMetric",
    "KVTransferError",
    "DisaggregationMode",
]
