"""kvxfer.sglang.conn: a KV transfer backend with SGLang's disaggregation
interface (``python/sglang/srt/disaggregation/base/conn.py``) and the
attributes SGLang's prefill and decode schedulers use beyond it
(``prefill.py``, ``decode.py``, ``common/conn.py``): KVArgs, KVPoll,
KVManager, KVSender, KVReceiver, KVBootstrapServer, plus KVTransferMetric,
KVTransferError and PrefillServerInfo as SGLang defines them.

The buffers are the caller's (SGLang's per-layer K/V tensors, aux rows, state
buffers); kvxfer registers them and moves pages between them (kvx_kv_* C ABI).
KVArgs may be kvxfer's class or SGLang's own (a plain class without defaults):
every optional field is read with a default, so a KVArgs filled exactly as
SGLang's prefill or decode fills it is accepted.

Per-request failures never raise from constructors, send(), send_metadata()
or poll(): they surface as poll() == KVPoll.Failed on both sides, and
failure_exception() raises a KVTransferError whose message is kvxfer's error
(room, peer, step). Only programming and configuration errors (wrong types,
a layout kvxfer cannot move) raise directly, from KVManager().

Configuration, beyond what SGLang passes (server_args attributes win over the
environment): transport ``server_args.kvxfer_transport`` / KVXFER_TRANSPORT
("auto" default: rdma > shm > cma > tcp; shm shares only kvxfer.HostBuffer
memory, cma any host buffer on the same host, tcp where the kernel refuses
cross-memory attach; ``KVManager.transports`` lists what the buffers were
registered with, ``transport`` the first), host ``server_args.kvxfer_host`` /
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
import json
import logging
import os
import threading
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional

from .. import _lib
from .._lib import Closable, KvxError
from .._memory import pointer_location

log = logging.getLogger("kvxfer")

#: Seconds a directory request made from Python (try_ensure_parallel_info,
#: query_prefill_dp_ranks) may take, as SGLang's requests.get(timeout=5).
DIRECTORY_TIMEOUT_S = 5.0

# Directory and prefill HTTP requests go straight to the address: an
# http_proxy in the environment is for the outside world, not for the
# deployment's own bootstrap ports.
_http = urllib.request.build_opener(urllib.request.ProxyHandler({}))


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
    """SGLang's KVTransferError(bootstrap_room, failure_reason,
    is_from_another_rank=False). is_from_another_rank is True when this
    rank's room had not failed and the failure came from another rank of the
    TP group (the all-reduced poll was Failed): SGLang then logs it at debug
    level. ``status`` (keyword) is the kvx_status code of the failure (0 when
    it came from Python or from another rank)."""

    def __init__(self, bootstrap_room: int, failure_reason: str, is_from_another_rank: bool = False, status: int = 0):
        super().__init__(failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.is_from_another_rank = bool(is_from_another_rank)
        self.status = status

    def __str__(self):
        return f"KVTransferError(bootstrap_room={self.bootstrap_room}): {self.failure_reason}"


class KVArgs:
    """SGLang's KVArgs with defaults: set the attributes (or pass them as
    keywords). SGLang's own KVArgs class (no defaults) is accepted as well.

    One entry per buffer in kv_data_ptrs / kv_data_lens (bytes) / kv_item_lens
    (bytes per page): MHA/GQA the K buffer of every layer then the V buffers,
    MLA one per layer. aux_* are host buffers whose row aux_index belongs to
    one request; state_* are lists of lists, one list per state component
    (kvxfer moves one component). kv_head_num / total_kv_head_num 0 mean
    unknown (SGLang's decode does not set them). kvxfer extension:
    kv_location "host" / "cuda:N" (default: asked from the CUDA driver for
    kv_data_ptrs[0], "host" without one)."""

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
        self.state_dim_per_tensor: list = []
        self.state_conv_shard_groups: list = []
        self.is_hybrid_mla_backend = False
        self.ib_device = ""
        self.ib_traffic_class = ""
        self.gpu_id = 0
        self.kv_head_num = 0
        self.total_kv_head_num = 0
        self.page_size = 1
        self.swa_page_size = None
        self.system_dp_rank = 0
        self.pp_rank = 0
        self.prefill_start_layer = 0
        self.prefill_end_layer = None
        self.mla_compression_ratios = None
        self.kv_layer_ids: list = []
        self.dcp_size = 1
        self.dcp_rank = 0
        self.kv_location = None
        for k, v in kw.items():
            setattr(self, k, v)


def _arg(args, name, default=None):
    """KVArgs field `name`, or default when the attribute is absent or None
    (SGLang's KVArgs declares most fields without a value)."""
    v = getattr(args, name, None)
    return default if v is None else v


def _u64_array(values, what):
    vals = [int(v) for v in (values or [])]
    for i, v in enumerate(vals):
        if v < 0:
            raise ValueError(f"KVArgs.{what}[{i}] = {v} is negative")
    return (ctypes.c_uint64 * max(1, len(vals)))(*vals), len(vals)


def _flatten(items):
    """Flatten nested lists, tuples and numpy arrays into a list of scalars;
    None entries (SGLang's placeholder for a state type without indices) are
    skipped."""
    out = []
    for x in items if items is not None else ():
        if x is None:
            continue
        if hasattr(x, "__array_interface__") and hasattr(x, "reshape"):
            out.extend(x.reshape(-1).tolist())
        elif isinstance(x, (list, tuple)):
            out.extend(_flatten(x))
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


def _directory_url(bootstrap_addr: str, path: str) -> str:
    """http://host:port/path for a bootstrap address "host:port" or
    "[v6]:port" (a bare v6 literal "a:b::c:port" is bracketed)."""
    addr = str(bootstrap_addr)
    if addr.startswith("http://") or addr.startswith("https://"):
        return addr.rstrip("/") + path
    host, sep, port = addr.rpartition(":")
    if sep and ":" in host and not host.startswith("["):
        addr = f"[{host}]:{port}"
    return f"http://{addr}{path}"


@dataclasses.dataclass
class PrefillServerInfo:
    """SGLang's PrefillServerInfo: a prefill instance's topology as its
    bootstrap directory answers GET /route with all four ranks -1. The decode
    scheduler reads dp_size and follow_bootstrap_room (prefill DP rank =
    room % dp_size). Keys a newer directory adds are kept in ``extra``; the
    target_* / required_* fields SGLang fills for its own transfer are left
    None (kvxfer's engine maps the ranks itself)."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: Optional[int]
    kv_cache_dtype: Optional[str]
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool = False
    # Newest SGLang (common/conn.py b7e89b39): the prefill ranks' DSpark
    # layout and decode allocation policy ("early" when the directory is
    # older or answers SGLang 0094505's key set).
    dsv41_spec_layout: Optional[dict] = None
    decode_allocation_policy: str = "early"
    prefill_http_port: Optional[int] = None
    target_tp_rank: Optional[int] = None
    target_tp_ranks: Optional[List[int]] = None
    target_cp_ranks: Optional[List[int]] = None
    target_pp_ranks: Optional[List[int]] = None
    required_dst_info_num: Optional[int] = None
    required_prefill_response_num: Optional[int] = None
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> "PrefillServerInfo":
        """Build from the directory's JSON object; raises ValueError naming a
        missing or malformed key."""
        if not isinstance(data, dict):
            raise ValueError(f"topology answer is {type(data).__name__}, want a JSON object")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        required = ("attn_tp_size", "dp_size", "pp_size")
        for k in required:
            if k not in data:
                raise ValueError(f"topology answer has no {k!r} (keys: {sorted(data)})")
        kw = {k: v for k, v in data.items() if k in names}
        kw.setdefault("attn_cp_size", 1)
        kw.setdefault("page_size", None)
        kw.setdefault("kv_cache_dtype", None)
        kw.setdefault("follow_bootstrap_room", True)
        try:
            info = cls(**kw, extra={k: v for k, v in data.items() if k not in names})
            for k in ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size"):
                v = int(getattr(info, k))
                if v < 1:
                    raise ValueError(f"{k} = {v}, want >= 1")
                setattr(info, k, v)
            info.page_size = int(info.page_size) if info.page_size is not None else None
            info.kv_cache_dtype = str(info.kv_cache_dtype) if info.kv_cache_dtype is not None else None
            info.follow_bootstrap_room = bool(info.follow_bootstrap_room)
            info.enable_dsa_cache_layer_split = bool(info.enable_dsa_cache_layer_split)
            info.prefill_http_port = int(info.prefill_http_port) if info.prefill_http_port is not None else None
            info.decode_allocation_policy = str(info.decode_allocation_policy or "early")
            if info.dsv41_spec_layout is not None and not isinstance(info.dsv41_spec_layout, dict):
                raise ValueError(f"dsv41_spec_layout is {type(info.dsv41_spec_layout).__name__}, want a JSON object or null")
        except (TypeError, ValueError) as e:
            raise ValueError(f"topology answer {data!r}: {e}") from None
        return info


def query_prefill_dp_ranks(bootstrap_addr: str, bootstrap_rooms) -> Dict[str, int]:
    """SGLang's CommonKVReceiver.query_prefill_dp_ranks: POST
    /query_dp_ranks for many rooms at once; returns {str(room): dp_rank} for
    the rooms the directory knows, {} on any error (the caller retries on its
    next cycle, as SGLang does)."""
    body = json.dumps({"bootstrap_rooms": [int(r) for r in bootstrap_rooms]}).encode()
    req = urllib.request.Request(_directory_url(bootstrap_addr, "/query_dp_ranks"), data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with _http.open(req, timeout=DIRECTORY_TIMEOUT_S) as resp:
            data = json.loads(resp.read() or b"{}")
    except (OSError, ValueError) as e:
        log.debug("kvxfer: POST %s/query_dp_ranks: %s", bootstrap_addr, e)
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): int(v) for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool)}


class KVManager(Closable):
    """One rank's KV transfer manager: registers the rank's buffers (KVArgs)
    and its control socket; a prefill manager also registers the rank with its
    bootstrap server (server_args.host or the host of dist_init_addr, port
    server_args.disaggregation_bootstrap_port) when it is created.

    server_args may be SGLang's ServerArgs or any object with (some of) its
    attributes: host, disaggregation_bootstrap_port (8998), dist_init_addr,
    tp_size, dp_size, pp_size, enable_dp_attention, kv_cache_dtype ("auto"),
    attn_cp_size (1), port (a prefill's HTTP API port, registered as
    prefill_http_port for SGLang's PD rebootstrap). control_auth (bool) turns control-frame authentication
    on or off and max_peers (int >= 1) bounds the control peers (kvxfer
    extensions; None: server_args.kvxfer_control_auth / kvxfer_max_peers,
    else the environment, KVXFER_CONTROL_AUTH and KVXFER_MAX_PEERS).
    control_auth needs the deployment's token (server_args.bootstrap_auth_token
    or the environment). defer_prefill_bootstrap_registration (SGLang's
    CommonKVManager keyword) is accepted; kvxfer registers the rank when the
    manager is created either way, and register_to_bootstrap() does nothing.

    Raises KvxError when the manager cannot start (the message says which
    buffer or setting and why), ValueError for what kvxfer cannot move
    (several state components, decode context parallel, attention context
    parallel, DeepSeek-V4's compression-ratio buffer layout) or a max_peers
    below 1. close() frees it (idempotent).

    Decode managers also have SGLang's prefill_info_table ({bootstrap_addr:
    PrefillServerInfo}), try_ensure_parallel_info(addr) and
    submit_prefill_recompute(receiver, payload)."""

    def __init__(self, args: KVArgs, disaggregation_mode, server_args, is_mla_backend: Optional[bool] = False,
                 defer_prefill_bootstrap_registration: bool = False, control_auth: Optional[bool] = None,
                 max_peers: Optional[int] = None):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.mode = _mode(disaggregation_mode)
        self._engine = 0
        self._kv = 0
        self._lock = threading.Lock()
        self._info_lock = threading.Lock()
        self.prefill_info_table: Dict[str, PrefillServerInfo] = {}
        self.is_dummy_cp_rank = False
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
        cp_size = int(getattr(sa, "attn_cp_size", 1) or 1)
        self._refuse_unsupported(args, cp_size)
        self.attn_tp_size = max(1, tp_size // dp_size) if dp_attention else tp_size
        engine_rank = int(_arg(args, "engine_rank", 0))
        self.tp_rank = engine_rank % self.attn_tp_size
        self.attn_tp_rank = self.tp_rank
        self.attn_cp_size, self.attn_cp_rank = 1, 0
        self.dp_size = dp_size
        self.dp_rank = engine_rank // self.attn_tp_size if dp_attention else int(_arg(args, "system_dp_rank", 0))
        self.attn_dp_size = dp_size if dp_attention else 1
        self.attn_dp_rank = self.dp_rank if dp_attention else 0
        self.system_dp_size = 1 if dp_attention else dp_size
        self.system_dp_rank = int(_arg(args, "system_dp_rank", 0))
        self.pp_size = int(getattr(sa, "pp_size", 1) or 1)
        self.pp_rank = int(_arg(args, "pp_rank", 0))
        host = getattr(sa, "kvxfer_host", None) or os.environ.get("KVXFER_HOST") or _loopback(str(getattr(sa, "host", "127.0.0.1") or "127.0.0.1"))
        self.host = host
        self.bootstrap_host = getattr(sa, "host", None)
        self.bootstrap_port = int(getattr(sa, "disaggregation_bootstrap_port", 8998) or 8998)
        self.bootstrap_addr = None
        if self.mode == "prefill":
            bhost = _loopback(str(getattr(sa, "host", "127.0.0.1") or "127.0.0.1"))
            dist = getattr(sa, "dist_init_addr", None)
            if dist:
                bhost = dist.rsplit(":", 1)[0].strip("[]")
            self.bootstrap_addr = f"[{bhost}]:{self.bootstrap_port}" if ":" in bhost else f"{bhost}:{self.bootstrap_port}"
        transport = getattr(sa, "kvxfer_transport", None) or os.environ.get("KVXFER_TRANSPORT") or "auto"
        try:
            self._start(transport)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _refuse_unsupported(a, cp_size):
        """ValueError naming a KVArgs layout kvxfer cannot move, instead of
        moving the wrong bytes."""
        if int(_arg(a, "dcp_size", 1)) > 1:
            raise ValueError(f"KVArgs.dcp_size {_arg(a, 'dcp_size', 1)}: decode context parallel is not supported by kvxfer; run the decode with --dcp-size 1")
        if cp_size > 1:
            raise ValueError(f"server_args.attn_cp_size {cp_size}: attention context parallel is not supported by kvxfer; run with attn_cp_size 1")
        if _arg(a, "mla_compression_ratios") is not None:
            raise ValueError("KVArgs.mla_compression_ratios is set (DeepSeek-V4's buffers are grouped by compression ratio, not by layer): "
                             "kvxfer pairs KV buffers by layer and cannot move this layout")
        comps = _arg(a, "state_data_ptrs", [])
        if sum(1 for c in comps if isinstance(c, (list, tuple))) > 1:
            types = [getattr(t, "value", t) for t in _arg(a, "state_types", [])]
            raise ValueError(f"KVArgs has {len(comps)} state components ({', '.join(map(str, types)) or 'unnamed'}): "
                             "kvxfer moves one state component per request (each state slot index applies to every state buffer)")

    def _kv_config(self, keep):
        a = self.kv_args
        c = _lib.KVConfig()
        c.struct_size = ctypes.sizeof(c)
        c.page_size = int(_arg(a, "page_size", 1))
        c.tp_size = self.attn_tp_size
        c.tp_rank = self.tp_rank
        c.pp_size = self.pp_size
        c.pp_rank = self.pp_rank
        c.dp_size = self.dp_size
        c.dp_rank = self.dp_rank
        c.checksum = 1 if os.environ.get("KVXFER_CHECKSUM", "") in ("1", "true", "yes", "on") else 0
        c.bootstrap_timeout_ms = _env_ms("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")
        c.waiting_timeout_ms = _env_ms("SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
        c.kv_cache_dtype = _lib.encode(str(getattr(self.server_args, "kv_cache_dtype", "auto") or "auto"))
        c.control_host = _lib.encode(self.host)
        lists = {}
        for name in ("kv_data_ptrs", "kv_data_lens", "kv_item_lens", "aux_data_ptrs", "aux_data_lens", "aux_item_lens"):
            lists[name] = _u64_array(_arg(a, name, []), name)
        for name in ("state_data_ptrs", "state_data_lens", "state_item_lens"):
            lists[name] = _u64_array(_flatten(_arg(a, name, [])), name)
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
        c.kv_head_num, c.total_kv_head_num = self._head_counts()
        c.is_mla = 1 if self.is_mla_backend else 0
        c.prefill_start_layer = int(_arg(a, "prefill_start_layer", 0))
        c.system_dp_rank = self.system_dp_rank
        loc = _arg(a, "kv_location") or pointer_location(int(lists["kv_data_ptrs"][0][0]))
        c.kv_location = _lib.encode(loc)
        c.ib_device = _lib.encode(_arg(a, "ib_device") or None)
        token = os.environ.get("KVXFER_BOOTSTRAP_AUTH_TOKEN") or os.environ.get("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN")
        c.bootstrap_auth_token = _lib.encode(getattr(self.server_args, "bootstrap_auth_token", None) or token or None)
        c.advertise_host = _lib.encode(os.environ.get("KVXFER_ADVERTISE_HOST") or None)
        # None leaves both to the library's environment fallback.
        if self.control_auth is not None:
            c.control_auth = _lib.CONTROL_AUTH_ON if self.control_auth else _lib.CONTROL_AUTH_OFF
        if self.max_peers is not None:
            c.max_peers = int(self.max_peers)
        # SGLang's --disaggregation-decode-allocation-policy, both roles: a
        # prefill declares it in its registration and answers the decodes
        # when mark_prefill_complete() is called; a decode under
        # "prefill_complete" stays Bootstrapping (its scheduler allocates
        # nothing) until the prefill computed the request.
        policy = getattr(self.server_args, "disaggregation_decode_allocation_policy", None)
        c.decode_allocation_policy = _lib.encode(str(policy) if policy else None)
        if self.mode == "prefill":
            # What else the rank declares in its directory registration, as
            # SGLang's register_to_bootstrap: the DeepSeek-V4.1 DSpark layout
            # (KVArgs.dsv41_spec_layout; SGLang computes it from
            # mla_compression_ratios layouts, which kvxfer refuses above, so
            # only an explicit one is sent).
            layout = _arg(a, "dsv41_spec_layout")
            c.dsv41_spec_layout = _lib.encode(json.dumps(layout) if layout is not None else None)
            # SGLang's register_to_bootstrap sends server_args.port as
            # prefill_http_port: the decode's PD rebootstrap POSTs /generate there.
            c.prefill_http_port = self._http_port()
        return c

    def _http_port(self) -> int:
        """server_args.port (the prefill's HTTP API port, as SGLang registers
        it) for kvx_kv_config.prefill_http_port; 0 when it is unset or not
        a port number."""
        port = getattr(self.server_args, "port", None)
        if isinstance(port, bool):
            return 0
        try:
            port = int(port)
        except (TypeError, ValueError):
            return 0
        return port if 0 < port <= 65535 else 0

    def _head_counts(self):
        """(kv_head_num, total_kv_head_num) for kvx_kv_config; 0 = unknown.

        SGLang's decode leaves both unset; the engine then takes the
        prefill's head geometry from its REGISTER_ACK (a decode row that is
        not the prefill's heads per rank is refused, naming both). When the
        model's KV head count is at hand anyway -- server_args.
        kvxfer_total_kv_head_num, the environment (KVXFER_TOTAL_KV_HEAD_NUM),
        or num_key_value_heads (else num_attention_heads) of config.json in
        server_args.model_path when that is a local directory -- it is passed
        as a cross-check: a prefill of another model is then refused
        ("total KV heads differ"), naming both counts. Heads per rank =
        max(1, total / attn TP size)."""
        a = self.kv_args
        heads, total = int(_arg(a, "kv_head_num", 0)), int(_arg(a, "total_kv_head_num", 0))
        if heads or total or self.is_mla_backend:
            return heads, total
        where = "server_args.kvxfer_total_kv_head_num"
        total = getattr(self.server_args, "kvxfer_total_kv_head_num", None)
        if not total:
            where, total = "KVXFER_TOTAL_KV_HEAD_NUM", os.environ.get("KVXFER_TOTAL_KV_HEAD_NUM")
        if not total:
            where, total = self._config_kv_heads()
        if not total:
            return 0, 0
        try:
            total = int(total)
        except ValueError:
            total = 0
        if total < 1:
            raise ValueError(f"{where} = {total!r}: want the model's number of KV heads (>= 1)")
        log.info("kvxfer: %s rank %d: KVArgs give no KV head counts; %d KV heads from %s, %d per rank",
                 self.mode, self.tp_rank, total, where, max(1, total // self.attn_tp_size))
        return max(1, total // self.attn_tp_size), total

    def _config_kv_heads(self):
        path = getattr(self.server_args, "model_path", None)
        cfg = os.path.join(str(path), "config.json") if path else None
        if not cfg or not os.path.isfile(cfg):
            return None, None
        try:
            with open(cfg) as f:
                conf = json.load(f)
        except (OSError, ValueError):
            return None, None
        for c in (conf, conf.get("text_config") or {}) if isinstance(conf, dict) else ():
            for key in ("num_key_value_heads", "num_attention_heads"):
                if isinstance(c.get(key), int) and not isinstance(c.get(key), bool):
                    return f"{key} of {cfg}", c[key]
        return None, None

    def _engine_create(self, transport):
        cfg = _lib.EngineConfig()
        cfg.struct_size = ctypes.sizeof(cfg)
        cfg.role = _lib.ROLE_PREFILL if self.mode == "prefill" else _lib.ROLE_DECODE
        cfg.transport = transport.encode()
        cfg.listen_host = self.host.encode()
        cfg.local_hostname = self.host.encode()
        cfg.bootstrap_addr = _lib.encode(self.bootstrap_addr)
        cfg.devices = _lib.encode(_arg(self.kv_args, "ib_device") or None)
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
        if rc != _lib.OK:
            raise KvxError(rc, "kvx_kv_create", f"{self.mode} KV manager (tp rank {self.tp_rank}, transport {transport}): {msg}")
        # The transports the manager registered its buffers with, preferred
        # first: with "auto", shm for kvxfer.HostBuffer memory, cma for the
        # caller's own buffers (shm cannot share them), tcp where neither runs.
        self.transports = _lib.get_string("kvx_kv_transports", out.value).split(",")
        self.transport = self.transports[0]
        log.info("kvxfer: %s rank %d: KV buffers registered with %s", self.mode, self.tp_rank, ", ".join(self.transports))
        self._kv = out.value
        lay = _lib.KVLayout()
        _lib.call("kvx_kv_layout_get", self._kv, ctypes.byref(lay))
        self.num_pages = lay.num_pages

    def register_to_bootstrap(self):
        """Kept for SGLang's interface: a prefill manager registered its rank
        with the bootstrap server when it was created (retrying until the
        bootstrap timeout), so this does nothing."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's decode-side topology fetch: True when
        prefill_info_table[bootstrap_addr] is known, else one GET /route
        (all ranks -1, DIRECTORY_TIMEOUT_S) to the prefill's directory; False
        when it does not answer 200 yet (503 until every prefill rank has
        registered) or answers something that is not a topology, so the
        scheduler retries. Never raises. A page size or kv_cache_dtype that
        differs from this rank's is logged and the info cached all the same:
        the rooms then fail naming both values, where SGLang would raise in
        the scheduler."""
        with self._info_lock:
            if bootstrap_addr in self.prefill_info_table:
                return True
        url = _directory_url(bootstrap_addr, "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
        try:
            with _http.open(url, timeout=DIRECTORY_TIMEOUT_S) as resp:
                info = PrefillServerInfo.from_json(json.loads(resp.read()))
        except urllib.error.HTTPError as e:
            log.debug("kvxfer: GET %s: %s %s", url, e.code, e.reason)
            return False
        except (OSError, ValueError) as e:
            log.debug("kvxfer: GET %s: %s", url, e)
            return False
        page = int(_arg(self.kv_args, "page_size", 1))
        dtype = str(getattr(self.server_args, "kv_cache_dtype", "auto") or "auto")
        if info.page_size is not None and info.page_size != page:
            log.error("kvxfer: prefill at %s has page_size %d, this decode rank %d: its rooms will fail; run both with the same --page-size",
                      bootstrap_addr, info.page_size, page)
        if info.kv_cache_dtype is not None and info.kv_cache_dtype != dtype:
            log.error("kvxfer: prefill at %s has kv_cache_dtype %r, this decode rank %r: its rooms will fail; run both with the same --kv-cache-dtype",
                      bootstrap_addr, info.kv_cache_dtype, dtype)
        with self._info_lock:
            self.prefill_info_table.setdefault(bootstrap_addr, info)
        return True

    def submit_prefill_recompute(self, kv_receiver: "KVReceiver", payload: dict) -> None:
        """SGLang's PD rebootstrap (a retracted request whose prefix KV the
        prefill recomputes): POST payload to the prefill's /generate at
        http://{bootstrap host}:{prefill_http_port} on a worker thread; the
        prefill then sends the KV over the room as for a new request. Any
        failure (no prefill_http_port in the topology, HTTP error) aborts
        the receiver, so the room fails on both sides through the usual
        KVPoll.Failed path. Never raises."""
        info = self.prefill_info_table.get(kv_receiver.bootstrap_addr)
        port = info.prefill_http_port if info is not None else None
        if port is None:
            kv_receiver._fail_local(_lib.ERR_NOT_SUPPORTED,
                                    f"room {kv_receiver.bootstrap_room}: PD rebootstrap needs the prefill's HTTP port, and the directory at "
                                    f"{kv_receiver.bootstrap_addr} reports no prefill_http_port (its prefill registered none: SGLang's "
                                    "server_args.port, kvx_kv_config.prefill_http_port, kvxfer prefill --prefill-http-port)")
            return
        host = kv_receiver.bootstrap_addr.rpartition(":")[0] or "127.0.0.1"
        url = _directory_url(f"{host}:{port}", "/generate")

        def post():
            req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with _http.open(req, timeout=max(DIRECTORY_TIMEOUT_S, 60.0)) as resp:
                    resp.read()
            except (OSError, ValueError) as e:
                kv_receiver._fail_local(_lib.ERR_UNAVAILABLE, f"room {kv_receiver.bootstrap_room}: PD rebootstrap POST {url}: {e}")

        threading.Thread(target=post, name=f"kvxfer-rebootstrap-{kv_receiver.bootstrap_room}", daemon=True).start()

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

    #: SGLang's staging path (SGLANG_DISAGG_STAGING_BUFFER) asks for it;
    #: kvxfer writes pages in place and never stages.
    require_staging = False

    def __init__(self, mgr: KVManager, bootstrap_room):
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self._h = 0
        self._failure: Optional[tuple] = None  # (status, message)
        self._final: Optional[int] = None  # poll value kept by clear()
        self._metric: Optional[KVTransferMetric] = None  # kept by clear()
        self._lock = threading.Lock()

    def _fail_local(self, status, message):
        with self._lock:
            if self._failure is None:
                self._failure = (status, message)
                log.warning("kvxfer: room %s: %s", self.bootstrap_room, message)
            h = self._h
        if h:
            _lib.try_call("kvx_kv_abort", h)  # the peer learns the room failed

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
        """The room's KVPoll value (non-blocking; never raises: a TP group
        all-reduces it every scheduler cycle)."""
        if self._failure is not None:
            return KVPoll.Failed
        h = self._h
        if not h:
            return self._final if self._final is not None else KVPoll.Bootstrapping
        st = ctypes.c_int32(0)
        rc, msg = _lib.try_call("kvx_kv_poll", h, ctypes.byref(st))
        if rc != _lib.OK:
            if self._final is not None:
                return self._final
            with self._lock:
                if self._failure is None:
                    self._failure = (rc, msg)
            return KVPoll.Failed
        return st.value

    @property
    def conclude_state(self) -> Optional[int]:
        """SGLang's conclude_state: KVPoll.Success or KVPoll.Failed once the
        room has ended, None while it runs."""
        st = self.poll()
        return st if st in (KVPoll.Success, KVPoll.Failed) else None

    def wait(self, want: int = KVPoll.Success, timeout_s: float = 30.0) -> int:
        """kvxfer extension: block until the state is at least `want` (or
        Failed) or timeout_s passes; returns the state reached."""
        h = self._h
        if self._failure is not None or not h:
            return self.poll()
        st = ctypes.c_int32(0)
        rc, msg = _lib.try_call("kvx_kv_wait", h, int(want), int(timeout_s * 1000), ctypes.byref(st))
        if rc not in (_lib.OK, _lib.ERR_TIMEOUT):
            return self.poll()
        return st.value

    def failure_reason(self) -> tuple:
        """(kvx status, message) of the failure, or (0, "") when not failed."""
        if self._failure is not None:
            return self._failure
        h = self._h
        if not h:
            return (0, "")
        rc, msg = _lib.try_call("kvx_kv_failure", h)
        return (rc, msg) if rc != _lib.OK else (0, "")

    def failure_exception(self):
        """Raise KVTransferError for this room, as SGLang's backends do when
        the (all-reduced) poll is Failed. When this rank's room failed, the
        message is kvxfer's error (room, peer, step). When it had not (another
        rank of the TP group failed), the room is aborted here so its peer
        fails too, and the exception has is_from_another_rank=True. Either
        way the room is cleared first (clear(): on a decode its destination
        pages are free to reuse once this returns), so the scheduler may
        release the request's KV at once."""
        status, msg = self.failure_reason()
        from_another = not status
        if from_another:
            state = self.poll()
            msg = (f"room {self.bootstrap_room} failed on another rank of the TP group "
                   f"(state here {_POLL_NAMES.get(state, state)}); aborted here too")
            self._fail_local(_lib.ERR_CANCELED, msg)
        self.clear()
        raise KVTransferError(self.bootstrap_room, msg, is_from_another_rank=from_another, status=status)

    def abort(self):
        """Abort the room: it fails here and the peer is told (its poll
        becomes Failed too)."""
        h = self._h
        if h:
            _lib.try_call("kvx_kv_abort", h)
        elif self._failure is None and self._final is None:
            self._failure = (_lib.ERR_CANCELED, f"room {self.bootstrap_room} aborted before it started")

    def clear(self):
        """Forget the room (aborting it if not finished); poll() keeps
        returning its last state, failure_exception() its failure and
        get_transfer_metric() its figures. Idempotent.

        Decode: when it returns, the room's destination pages may go back to
        the page allocator. After Success that is at once; after a failure it
        blocks until every producer of the room is fenced (it acknowledged
        the abort after its last write, normally within milliseconds, or its
        data path was cut after the fence timeout, 5 s; see kvx_kv_close in
        kvxfer.h). Free the pages only after it returns. Prefill: returns
        once no transfer of the room reads its source pages."""
        with self._lock:
            h = self._h
            if not h:
                return
        final = self.poll()
        if final == KVPoll.Failed and self._failure is None:
            rc, msg = _lib.try_call("kvx_kv_failure", h)
            self._failure = (rc, msg) if rc != _lib.OK else (_lib.ERR_CANCELED, f"room {self.bootstrap_room} ended before it finished")
        metric = self._read_metric(h)
        with self._lock:
            if self._h != h:
                return
            self._final, self._metric, self._h = final, metric, 0
        _lib.try_call("kvx_kv_close", h)

    @staticmethod
    def _read_metric(h) -> KVTransferMetric:
        m = _lib.TransferMetric()
        m.struct_size = ctypes.sizeof(m)
        rc, _ = _lib.try_call("kvx_kv_metric", h, ctypes.byref(m))
        if rc != _lib.OK:
            return KVTransferMetric()
        total = m.bytes + m.aux_bytes
        return KVTransferMetric(
            transfer_latency_s=m.latency_us / 1e6 if m.latency_us else None,
            alloc_latency_s=None,
            transfer_total_bytes=total if total else None,
        )

    def get_transfer_metric(self) -> KVTransferMetric:
        """transfer_latency_s (sender: first send -> Success; receiver:
        send_metadata -> Success), transfer_total_bytes (KV + aux + state
        bytes moved); None when unknown. Also after clear(), which SGLang's
        prefill calls before reading the metric."""
        h = self._h
        if not h:
            return self._metric or KVTransferMetric()
        return self._read_metric(h)

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


def _valid_room(room) -> bool:
    if isinstance(room, bool):
        return False
    try:
        return 0 <= int(room) < 1 << 63 and int(room) == room
    except (TypeError, ValueError):
        return False


class KVSender(_Room):
    """The prefill side of one request (bootstrap_room). Constructed as
    SGLang's prefill does, positionally or by keyword (mgr, bootstrap_addr,
    bootstrap_room, dest_tp_ranks, pp_rank, req_has_disagg_prefill_dp_rank).
    dest_tp_ranks and pp_rank are kept for SGLang; kvxfer computes the decode
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
        self._layer_pages = None  # begin_layers: the chunk save_kv_layer sends
        if mgr.mode != "prefill":
            raise ValueError("KVSender needs a prefill KVManager (this one is decode)")
        if not _valid_room(bootstrap_room):
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
        and the state slots (state_indices: SGLang's per-component lists,
        flattened) follow it, then the metadata record and Success."""
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

    def mark_prefill_complete(self):
        """SGLang's mark_prefill_complete: this rank computed the request's
        KV. Under the "prefill_complete" decode allocation policy
        (server_args.disaggregation_decode_allocation_policy, both roles)
        the decode reserves its pages only after it, and this room's
        bootstrap timeout counts from it; under "early" it changes nothing.
        Call it once the KV is in the source pages, before send(). A failed
        room stays failed (poll() says so); never raises."""
        if not self._h:
            return
        rc, msg = _lib.try_call("kvx_kv_sender_mark_prefill_complete", self._h)
        if rc != _lib.OK:
            self._fail_local(rc, msg)

    def send_layers(self, kv_indices, first_layer: int, last_layer: Optional[int] = None, cuda_event=None):
        """kvxfer extension, layer-wise sending: queue the KV of model layers
        first_layer..last_layer (inclusive; default: just first_layer; within
        this rank's layers, KVArgs.prefill_start_layer onwards) for the
        source pages kv_indices (int32 page indices after the decode's
        prefix; numpy or a list). Each layer has its own cursor, so a chunked
        prefill may go chunk by chunk and layer by layer in either order; a
        position's source page must be the same for every layer. The call
        that completes every page of every layer is the last (call init
        first): the aux row, the state slots (state_indices of set_state)
        and the metadata record follow it. cuda_event: None to send at once,
        or the CUDA event recorded on the compute stream after these layers'
        KV write (a torch.cuda.Event, anything with .cuda_event, or the raw
        cudaEvent_t as an int): the writes start once it completed, and it
        must stay alive until wait_for_save() returned or the room was
        cleared. Failures surface as poll() == Failed on both sides."""
        if not self._h:
            return
        if self.num_kv_indices is None:
            self._fail_local(_lib.ERR_INVALID_ARGUMENT, f"send_layers before init(num_kv_indices, aux_index) on room {self.bootstrap_room}")
            return
        last_layer = first_layer if last_layer is None else last_layer
        try:
            ptr, n, keep = _int32_list(kv_indices, "kv_indices")
            ev = _event_handle(cuda_event)
            first, last = int(first_layer), int(last_layer)
            if first < 0 or last < 0:
                raise ValueError(f"layers {first}..{last}: want model layer indices >= 0")
        except (TypeError, ValueError) as e:
            self._fail_local(_lib.ERR_INVALID_ARGUMENT, str(e))
            return
        rc, msg = _lib.try_call("kvx_kv_sender_send_layers", self._h, ptr, n, first, last, ev)
        del keep
        if rc != _lib.OK:
            self._fail_local(rc, msg)

    def set_state(self, state_indices):
        """kvxfer extension: this rank's state slots of the request (SGLang's
        send(..., state_indices), flattened), for a room sent with
        send_layers; give them before its last call."""
        lists = self._index_lists(None, state_indices)
        if lists is None or not self._h:
            return
        _, _, _, sptr, sn, skeep = lists
        if sn:
            rc, msg = _lib.try_call("kvx_kv_sender_state", self._h, sptr, sn)
            del skeep
            if rc != _lib.OK:
                self._fail_local(rc, msg)

    def begin_layers(self, kv_indices):
        """vLLM-shaped layer hooks: the source pages of this forward pass's
        chunk of the request (after the decode's prefix), which the following
        save_kv_layer calls send layer by layer."""
        self._layer_pages = kv_indices

    def save_kv_layer(self, layer, cuda_event=None):
        """vLLM KVConnectorBase_V1.save_kv_layer for this request: send the
        chunk given to begin_layers for one layer, an index or a vLLM layer
        name ("model.layers.12.self_attn.attn"), after cuda_event (see
        send_layers)."""
        idx = layer_index(layer)
        self.send_layers(getattr(self, "_layer_pages", None), idx, idx, cuda_event)

    def wait_for_save(self, timeout_s: float = 30.0) -> bool:
        """vLLM KVConnectorBase_V1.wait_for_save for this request: block
        until every layer queued so far is written to the decode (their
        events completed), so the pages they read may be overwritten. True
        when they are; False when the room failed or timeout_s passed
        (poll() says which)."""
        if not self._h or self._failure is not None:
            return False
        rc, _ = _lib.try_call("kvx_kv_sender_flush", self._h, int(timeout_s * 1000))
        return rc == _lib.OK

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


def _event_handle(ev) -> Optional[int]:
    """The cudaEvent_t of ev as an int (None for none): a torch.cuda.Event
    (its .cuda_event), a ctypes-style object (._as_parameter_) or an int."""
    if ev is None:
        return None
    h = getattr(ev, "cuda_event", None)
    if h is None and hasattr(ev, "_as_parameter_"):
        h = ev._as_parameter_
        h = getattr(h, "value", h)
    if h is None:
        h = ev
    if isinstance(h, bool) or not isinstance(h, int):
        raise TypeError(f"cuda_event {ev!r}: want a torch.cuda.Event, an object with .cuda_event, or a cudaEvent_t as an int")
    if h == 0:
        raise ValueError("cuda_event is a null handle (a torch.cuda.Event that was never recorded has none yet: record it first)")
    return h


def layer_index(layer) -> int:
    """A model layer index from an int or a vLLM layer name: the one integer
    component of a dotted name ("model.layers.12.self_attn.attn" -> 12), as
    vLLM's extract_layer_index reads it."""
    if isinstance(layer, bool):
        raise TypeError(f"layer {layer!r}: want an int or a layer name")
    if isinstance(layer, int):
        return layer
    nums = [p for p in str(layer).split(".") if p.isdigit()]
    if len(nums) != 1:
        raise ValueError(f"layer name {layer!r}: want exactly one integer component (e.g. model.layers.12.self_attn.attn)")
    return int(nums[0])


class LayerwiseSaver:
    """vLLM's KVConnectorBase_V1 worker hooks over kvxfer senders: one
    forward pass (a batch of requests, each a chunk of pages) saved layer by
    layer. add(sender, kv_indices) once per request of the pass;
    save_kv_layer(layer_name_or_index, cuda_event) as each attention layer
    finishes (one call covers every request; the event is the one recorded
    after that layer's KV write); wait_for_save() as the forward context
    exits. A request whose last chunk this is completes with its last layer
    (its sender's init gave the total page count)."""

    def __init__(self):
        self._reqs: list = []

    def add(self, sender: "KVSender", kv_indices):
        self._reqs.append((sender, kv_indices))

    def save_kv_layer(self, layer, cuda_event=None, *_args, **_kwargs):
        idx = layer_index(layer)
        for sender, pages in self._reqs:
            sender.send_layers(pages, idx, idx, cuda_event)

    def wait_for_save(self, timeout_s: float = 30.0) -> bool:
        """True when every request's queued layers are written; False when
        one failed or timed out (its poll() says which)."""
        ok = all([sender.wait_for_save(timeout_s) for sender, _ in self._reqs])
        self._reqs = []
        return ok


class KVReceiver(_Room):
    """The decode side of one request, constructed as SGLang's decode does
    (mgr=, bootstrap_addr=, bootstrap_room=; older SGLang passed
    prefill_dp_rank / data_parallel_rank too, which calls init at once).
    init(prefill_dp_rank) resolves the prefill ranks through the bootstrap
    server at bootstrap_addr ("host:port"); before it poll() is
    Bootstrapping."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None,
                 prefill_dp_rank: Optional[int] = None, data_parallel_rank: Optional[int] = None):
        super().__init__(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        if mgr.mode != "decode":
            raise ValueError("KVReceiver needs a decode KVManager (this one is prefill)")
        if not _valid_room(bootstrap_room):
            self._fail_local(_lib.ERR_INVALID_ARGUMENT, f"bootstrap_room {bootstrap_room!r} is not an integer in [0, 2^63)")
            return
        dp = prefill_dp_rank if prefill_dp_rank is not None else data_parallel_rank
        if dp is not None:
            self.init(dp)

    #: SGLang calls it on CommonKVReceiver; kept here for callers of ours.
    query_prefill_dp_ranks = staticmethod(query_prefill_dp_ranks)

    def init(self, prefill_dp_rank: Optional[int] = None):
        """Start resolving the producers of this room (prefill_dp_rank None
        or < 0: ask the bootstrap server); poll() becomes WaitingForInput when
        the prefill ranks are known and connected."""
        if self._h or self._failure is not None or self._final is not None:
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
            raise KVTransferError(self.bootstrap_room, "aux_row: the receiver is not initialized (or was cleared)",
                                  status=_lib.ERR_INVALID_ARGUMENT)
        needed = ctypes.c_size_t(0)
        _lib.try_call("kvx_kv_receiver_aux_row", self._h, int(buffer), None, 0, ctypes.byref(needed))
        buf = ctypes.create_string_buffer(max(1, needed.value))
        rc, msg = _lib.try_call("kvx_kv_receiver_aux_row", self._h, int(buffer), buf, len(buf), ctypes.byref(needed))
        if rc != _lib.OK:
            raise KVTransferError(self.bootstrap_room, msg, status=rc)
        return buf.raw[: needed.value]


def _port_value(v, what) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)) or (isinstance(v, str) and not v.isdigit()):
        raise ValueError(f"KVBootstrapServer: {what} {v!r} is not a port number")
    p = int(v)
    if not 0 <= p <= 65535:
        raise ValueError(f"KVBootstrapServer: port {p} not in 0 … 65535")
    return p


class KVBootstrapServer(Closable):
    """kvxfer's SGLang-compatible bootstrap directory, running in this
    process (kvx_bootstrap_start): KVBootstrapServer(host, port) as SGLang
    calls it (host=, port= keywords), or KVBootstrapServer(port) as older
    SGLang does (host 127.0.0.1). port 0 = a free port; 8998 (SGLang's
    default) only when no port is given. Extra keyword arguments SGLang
    passes (dp_size, ...) are accepted and ignored: the directory learns the
    topology from the ranks.

    ``addr`` is "host:port", ``host`` and ``port`` its parts; ``thread`` is
    alive while the directory serves (SGLang's bootstrap-server process
    joins it); close() stops it (idempotent). Raises KvxError when it cannot
    listen (the message names host and port), ValueError for a port that is
    not 0 … 65535."""

    def __init__(self, host=None, port=None, **_ignored):
        if port is None and host is not None and not (isinstance(host, str) and not host.isdigit()):
            host, port = None, host  # KVBootstrapServer(port), older SGLang
        port = 8998 if port is None else _port_value(port, "port")
        host = "127.0.0.1" if host in (None, "") else str(host)
        self._h = 0
        self._stopped = threading.Event()
        out = ctypes.c_uint64(0)
        _lib.call("kvx_bootstrap_start", _lib.encode(host), port, ctypes.byref(out))
        self._h = out.value
        self.addr = _lib.get_string("kvx_bootstrap_addr", self._h)
        h, _, p = self.addr.rpartition(":")
        self.host = h.strip("[]")
        self.port = int(p)
        self.thread = threading.Thread(target=self._stopped.wait, name=f"kvxfer-bootstrap-{self.port}", daemon=True)
        self.thread.start()

    def close(self):
        h, self._h = self._h, 0
        if h:
            _lib.try_call("kvx_bootstrap_stop", h)
        if hasattr(self, "_stopped"):
            self._stopped.set()


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
    "PrefillServerInfo",
    "query_prefill_dp_ranks",
    "LayerwiseSaver",
    "layer_index",
]
