"""SGLang's PD scheduler call sequence, replayed against kvxfer.sglang.

Read from SGLang's ``disaggregation/prefill.py`` (PrefillBootstrapQueue,
SchedulerDisaggregationPrefillMixin) and ``disaggregation/decode.py``
(DecodePreallocQueue, DecodeTransferQueue) and re-stated here without torch:
the KVArgs fields each side fills (and the ones it leaves unset), the
constructors with SGLang's keywords, the poll / all-reduce loop every cycle,
pop_decode_prefix_len -> init(num_pages, metadata index), chunked sends with
should_send_kv_chunk and the last chunk's metadata row, the decode's
prefill_info_table fast path, try_ensure_parallel_info retries,
query_prefill_dp_ranks, conclude_state, send_metadata with decode_prefix_len,
the metadata gate on the aux row's bootstrap_room, failure_exception with
is_from_another_rank, clear, get_transfer_metric and abort.

A TP group of one rank: the all-reduce (MIN) is the rank's own poll, except
for rooms put in ``other_rank_failed``, for which another rank reports
Failed. Used by tests/test_sglang_scheduler.py in the test process and by
tests/peer.py (roles sched-prefill, sched-decode) in the peer processes.
"""

from __future__ import annotations

import time
from collections import deque
from typing import List, Optional

import numpy as np

import kvxfer.sglang as backend
from kvpattern import RankKV, expected_aux, expected_page


class SGLangKVArgs:
    """The shape of SGLang's KVArgs (base/conn.py): a plain class whose
    fields are declared, not set; only swa_page_size, dcp_size and dcp_rank
    have class defaults. Reading an unset field raises AttributeError."""

    engine_rank: int
    kv_data_ptrs: List[int]
    kv_data_lens: List[int]
    kv_item_lens: List[int]
    aux_data_ptrs: List[int]
    aux_data_lens: List[int]
    aux_item_lens: List[int]
    state_types: list
    state_data_ptrs: List[List[int]]
    state_data_lens: List[List[int]]
    state_item_lens: List[List[int]]
    state_dim_per_tensor: List[List[int]]
    is_hybrid_mla_backend: bool
    ib_device: str
    ib_traffic_class: str
    gpu_id: int
    kv_head_num: int
    total_kv_head_num: int
    page_size: int
    swa_page_size: Optional[int] = None
    system_dp_rank: int
    pp_rank: int
    prefill_start_layer: int
    prefill_end_layer: Optional[int]
    mla_compression_ratios: Optional[List[int]]
    dcp_size: int = 1
    dcp_rank: int = 0


def _setup_state_kv_args(args):
    """utils.setup_state_kv_args for a pool without state buffers."""
    args.state_types = []
    args.state_data_ptrs = []
    args.state_data_lens = []
    args.state_item_lens = []
    args.state_dim_per_tensor = []
    args.is_hybrid_mla_backend = False


def _buffers(args, kv: RankKV):
    args.kv_data_ptrs = [int(b.ctypes.data) for b in kv.kv]
    args.kv_data_lens = [int(b.nbytes) for b in kv.kv]
    args.kv_item_lens = [kv.g.item_len(kv.tp)] * len(kv.kv)
    args.aux_data_ptrs = [int(a.ctypes.data) for a in kv.aux]
    args.aux_data_lens = [int(a.nbytes) for a in kv.aux]
    args.aux_item_lens = list(kv.g.aux_item_lens)


def prefill_kv_args(kv: RankKV, tp_rank: int, mla: bool, cls=SGLangKVArgs):
    """KVArgs as PrefillBootstrapQueue._init_kv_manager fills them."""
    args = cls()
    args.engine_rank = tp_rank
    args.pp_rank = 0
    args.system_dp_rank = 0
    args.prefill_start_layer = 0
    args.prefill_end_layer = None
    args.mla_compression_ratios = None
    _buffers(args, kv)
    if not mla:
        args.kv_head_num = kv.hpr
        args.total_kv_head_num = kv.g.heads
    args.page_size = kv.g.page_size
    args.ib_device = None  # server_args.disaggregation_ib_device
    args.gpu_id = 0
    _setup_state_kv_args(args)
    return args


def decode_kv_args(kv: RankKV, tp_rank: int, attn_tp_size: int, with_heads: bool = False, cls=SGLangKVArgs):
    """KVArgs as DecodePreallocQueue._init_kv_manager fills them: no
    kv_head_num, total_kv_head_num or prefill_start_layer (with_heads sets
    the head counts as its staging-buffer branch does)."""
    args = cls()
    args.engine_rank = tp_rank % attn_tp_size
    args.pp_rank = 0
    args.system_dp_rank = 0
    _buffers(args, kv)
    args.kv_layer_ids = []
    args.page_size = kv.g.page_size
    _setup_state_kv_args(args)
    args.ib_device = None
    args.gpu_id = 0
    if with_heads:
        args.kv_head_num = kv.hpr
        args.total_kv_head_num = kv.hpr * attn_tp_size
    return args


def room_in_row(kv: RankKV, row: int) -> int:
    """The metadata row's bootstrap_room (MetadataBuffers.bootstrap_room[idx,
    0]): the first 8 bytes of aux buffer 0, little-endian."""
    return int.from_bytes(kv.aux[0][row][:8].tobytes(), "little")


class Req:
    """One request as both schedulers see it. tokens is the prompt length;
    pages (prefill: source, decode: destination after the prefix) hold it;
    prefix_tokens (decode) are held already (whole pages, prefix_pages)."""

    def __init__(self, rid, room, bootstrap_host, bootstrap_port, tokens, pages, prefix_tokens=0, prefix_pages=(),
                 src_pages=None, chunks=1, **hooks):
        self.rid, self.bootstrap_room = rid, room
        self.bootstrap_host, self.bootstrap_port = bootstrap_host, bootstrap_port
        self.tokens, self.pages = int(tokens), list(pages)
        self.prefix_tokens, self.prefix_pages = int(prefix_tokens), list(prefix_pages)
        self.src_pages = list(src_pages) if src_pages is not None else None
        self.chunks = max(1, int(chunks))
        self.hooks = hooks
        self.disagg_prefill_dp_rank = None
        self.aborted: Optional[str] = None
        self.metadata_buffer_index = -1


def _result(room_obj, state, error=None, from_another=False, **extra):
    m = room_obj.get_transfer_metric()
    return dict(state=state, error=error, is_from_another_rank=from_another, bytes=m.transfer_total_bytes,
                latency_s=m.transfer_latency_s, **extra)


def _failure(room_obj):
    """(message, is_from_another_rank) from failure_exception(), as the
    schedulers catch it."""
    try:
        room_obj.failure_exception()
    except Exception as e:  # KVTransferError
        return str(e), getattr(e, "is_from_another_rank", False)
    return "failure_exception() did not raise", False


class PrefillScheduler:
    """PrefillBootstrapQueue + the prefill event loop for one rank."""

    def __init__(self, kv: RankKV, server_args, tp_rank=0, mla=False, kvargs_cls=SGLangKVArgs, hook=None):
        self.kv, self.g, self.tp_rank = kv, kv.g, tp_rank
        self.kv_manager = backend.KVManager(prefill_kv_args(kv, tp_rank, mla, kvargs_cls), backend.DisaggregationMode.PREFILL,
                                            server_args, mla)
        self.bootstrap_port = server_args.disaggregation_bootstrap_port
        # --disaggregation-decode-allocation-policy: under "prefill_complete"
        # the prefill computes a request before its decode reserved anything
        # and then calls sender.mark_prefill_complete(); the decode's
        # destination arrives after that.
        self.prefill_complete = getattr(server_args, "disaggregation_decode_allocation_policy", "early") == "prefill_complete"
        self.queue: List[Req] = []
        self.waiting: List[Req] = []
        self.inflight: List[Req] = []
        self.free_meta = deque(range(self.g.aux_rows))
        self.done = {}
        self.hook = hook or (lambda event, req, **kw: None)

    def add(self, req: Req):
        self.kv.fill_pages(req.bootstrap_room, req.pages)
        req.sender = backend.KVSender(mgr=self.kv_manager, bootstrap_addr=f"{req.bootstrap_host}:{self.bootstrap_port}",
                                      bootstrap_room=req.bootstrap_room, dest_tp_ranks=[self.tp_rank], pp_rank=0)
        req.chunks_sent = 0
        req.filled = 0
        self.queue.append(req)

    def abort(self, rid):
        """The scheduler's AbortReq path: a request in the bootstrap or the
        inflight queue has its sender aborted (its next poll is Failed); one
        in the middle of its (chunked) forward is marked to_finish, and the
        batch result aborts and clears its sender."""
        for req in self.queue + self.inflight:
            if req.rid == rid and hasattr(req.sender, "abort"):
                req.sender.abort()
        for req in self.waiting:
            if req.rid == rid:
                req.to_finish = "Aborted by AbortReq."

    def _finish(self, req, result):
        if req.metadata_buffer_index >= 0:
            self.free_meta.append(req.metadata_buffer_index)
            req.metadata_buffer_index = -1
        self.done[req.rid] = result

    def mark_computed(self):
        """prefill_complete: a request in the bootstrap queue is computed
        (its pages were filled when it was added) and the sender is told,
        unless a test holds it (hold_complete, until released)."""
        if not self.prefill_complete:
            return
        for req in self.queue:
            if getattr(req, "marked", False) or (req.hooks.get("hold_complete") and not req.hooks.get("released")):
                continue
            req.sender.mark_prefill_complete()
            req.marked = True
            self.hook("marked", req)

    def pop_bootstrapped(self):
        self.mark_computed()
        polls = [int(r.sender.poll()) for r in self.queue]
        keep = []
        for i, (req, poll) in enumerate(zip(self.queue, polls)):
            if poll == backend.KVPoll.Bootstrapping:
                keep.append(req)
                continue
            if poll == backend.KVPoll.Failed:
                err, other = _failure(req.sender)
                self._finish(req, _result(req.sender, "Failed", err, other, stage="bootstrap"))
                continue
            if not self.free_meta:
                keep.extend(self.queue[i:])
                break
            req.metadata_buffer_index = self.free_meta.popleft()
            prefix = req.sender.pop_decode_prefix_len()
            req.prefix = prefix
            req.start_send_idx = prefix
            ps = self.g.page_size
            req.sender.init(-(-(req.tokens - prefix) // ps), req.metadata_buffer_index)
            self.waiting.append(req)
        self.queue = keep

    def forward(self):
        """One prefill forward per waiting request: its next chunk of
        tokens; a non-last chunk sends its whole pages, the last chunk
        writes the metadata row and sends the rest (send_kv_chunk)."""
        still = []
        for req in self.waiting:
            if getattr(req, "to_finish", None):
                if hasattr(req.sender, "abort"):
                    req.sender.abort()
                if hasattr(req.sender, "clear"):
                    req.sender.clear()
                self._finish(req, _result(req.sender, "Failed", req.to_finish, stage="forward"))
                continue
            if req.hooks.get("hold") and not req.hooks.get("released"):
                still.append(req)
                continue
            k = req.chunks_sent
            if self.hook("chunk", req, k=k) == "stop":
                still.append(req)
                continue
            left = req.tokens - req.prefix
            req.filled = min(req.tokens, req.prefix + -(-left * (k + 1) // req.chunks))
            last = req.filled >= req.tokens
            self.send_kv_chunk(req, last_chunk=last)
            req.chunks_sent += 1
            if req.hooks.get("abort_after_chunks") == req.chunks_sent:
                self.abort(req.rid)
            if last:
                self.inflight.append(req)
            else:
                still.append(req)
        self.waiting = still

    def send_kv_chunk(self, req: Req, last_chunk=False):
        ps = self.g.page_size
        start, end = req.start_send_idx, min(req.filled, req.tokens)
        if not last_chunk:
            end -= end % ps
        if end < start:
            return
        slots = np.array([p * ps + t for p in req.pages for t in range(ps)][: req.tokens], dtype=np.int64)
        kv_indices = slots[start:end]
        state_indices = None
        if last_chunk:
            self.kv.fill_aux(req.metadata_buffer_index, req.bootstrap_room)  # MetadataBuffers.set_buf
            state_indices = []  # one list per state type: none here
        page_indices = (kv_indices[::ps] // ps).astype(np.int32)
        if not req.sender.should_send_kv_chunk(len(page_indices), last_chunk):
            return
        req.sender.send(page_indices, state_indices)
        req.start_send_idx = end

    def process_inflight_queue(self):
        polls = [int(r.sender.poll()) for r in self.inflight]
        undone = []
        for req, poll in zip(self.inflight, polls):
            if poll in (backend.KVPoll.WaitingForInput, backend.KVPoll.Transferring):
                undone.append(req)
            elif poll == backend.KVPoll.Success:
                if hasattr(req.sender, "clear"):
                    req.sender.clear()
                self._finish(req, _result(req.sender, "Success", prefix=req.prefix,
                                          dummy_cp=getattr(getattr(req.sender, "kv_mgr", None), "is_dummy_cp_rank", False)))
            elif poll == backend.KVPoll.Failed:
                err, other = _failure(req.sender)
                self._finish(req, _result(req.sender, "Failed", err, other, stage="transfer"))
            else:
                undone.append(req)
        self.inflight = undone

    def step(self):
        self.pop_bootstrapped()
        self.forward()
        self.process_inflight_queue()

    def close(self):
        self.kv_manager.close()


class DecodeRequest:
    def __init__(self, req, kv_receiver):
        self.req, self.kv_receiver = req, kv_receiver
        self.waiting_for_input = False
        self.metadata_buffer_index = -1


class DecodeScheduler:
    """DecodePreallocQueue + DecodeTransferQueue for one rank."""

    ENSURE_RETRY_INTERVAL_S = 1.0
    MAX_ENSURE_RETRIES = 15

    def __init__(self, kv: RankKV, server_args, tp_rank=0, mla=False, with_heads=False, kvargs_cls=SGLangKVArgs, hook=None):
        self.kv, self.g = kv, kv.g
        attn_tp = int(getattr(server_args, "tp_size", 1) or 1)
        self.kv_manager = backend.KVManager(decode_kv_args(kv, tp_rank, attn_tp, with_heads, kvargs_cls),
                                            backend.DisaggregationMode.DECODE, server_args, mla)
        self.queue: List[DecodeRequest] = []
        self.pending: List[DecodeRequest] = []
        self.transfer_queue: List[DecodeRequest] = []
        self.free_meta = deque(range(self.g.aux_rows))
        self._retry_count, self._last_attempt = {}, {}
        self.done = {}
        self.other_rank_failed = set()  # rids another TP rank reports Failed for
        self.paths = {}  # rid -> "fast" | "ensure" | "query"
        self.hook = hook or (lambda event, req, **kw: None)

    @staticmethod
    def _addr(req):
        host = req.bootstrap_host
        return f"[{host}]:{req.bootstrap_port}" if ":" in host else f"{host}:{req.bootstrap_port}"

    def _all_reduce(self, dreqs):
        polls = []
        for d in dreqs:
            p = int(d.kv_receiver.poll())
            if d.req.rid in self.other_rank_failed:
                p = min(p, backend.KVPoll.Failed)
            polls.append(p)
        return polls

    def add(self, req: Req):
        r = backend.KVReceiver(mgr=self.kv_manager, bootstrap_addr=self._addr(req), bootstrap_room=req.bootstrap_room)
        d = DecodeRequest(req, r)
        self.queue.append(d)
        dp = self._resolve_prefill_dp_rank(req)
        if dp is not None:
            self.paths[req.rid] = "fast"
            r.init(dp)
        else:
            self.pending.append(d)

    def abort(self, rid):
        """The scheduler's abort path for a request in either queue."""
        for d in self.queue + self.transfer_queue:
            if d.req.rid == rid:
                d.req.aborted = "Aborted by AbortReq."
                d.kv_receiver.abort()

    def _resolve_prefill_dp_rank(self, req) -> Optional[int]:
        info = self.kv_manager.prefill_info_table.get(self._addr(req))
        if info is None:
            return None
        if req.disagg_prefill_dp_rank is not None:
            return req.disagg_prefill_dp_rank
        if info.dp_size == 1:
            return 0
        if info.follow_bootstrap_room:
            return req.bootstrap_room % info.dp_size
        return None

    def _resolve_pending(self):
        if not self.pending:
            return
        by_addr = {}
        for d in self.pending:
            by_addr.setdefault(self._addr(d.req), []).append(d)
        remaining, resolved = [], []
        now = time.monotonic()
        for addr, ds in by_addr.items():
            last = self._last_attempt.get(addr)
            if last is not None and now - last < self.ENSURE_RETRY_INTERVAL_S:
                remaining.extend(ds)
                continue
            self._last_attempt[addr] = now
            if self.kv_manager.try_ensure_parallel_info(addr):
                self._retry_count.pop(addr, None)
                self._last_attempt.pop(addr, None)
                need_query = []
                for d in ds:
                    dp = self._resolve_prefill_dp_rank(d.req)
                    if dp is not None:
                        self.paths[d.req.rid] = "ensure"
                        resolved.append((d, dp))
                    else:
                        need_query.append(d)
                if need_query:
                    ranks = backend.query_prefill_dp_ranks(addr, [d.req.bootstrap_room for d in need_query])
                    for d in need_query:
                        dp = ranks.get(str(d.req.bootstrap_room))
                        if dp is None:
                            remaining.append(d)
                        else:
                            self.paths[d.req.rid] = "query"
                            resolved.append((d, int(dp)))
                continue
            count = self._retry_count.get(addr, 0) + 1
            self._retry_count[addr] = count
            if count >= self.MAX_ENSURE_RETRIES:
                for d in ds:
                    d.req.aborted = f"Could not fetch prefill parallel info from {addr} after {count} attempts"
                    d.kv_receiver.abort()
                del self._retry_count[addr], self._last_attempt[addr]
            else:
                remaining.extend(ds)
        self.pending = remaining
        for d, dp in resolved:
            d.kv_receiver.init(dp)

    def _update_handshake_waiters(self):
        if not self.queue:
            return
        if all(d.waiting_for_input for d in self.queue) and not any(
                d.kv_receiver.conclude_state == backend.KVPoll.Failed for d in self.queue):
            return
        for d, poll in zip(self.queue, self._all_reduce(self.queue)):
            if poll == backend.KVPoll.Bootstrapping:
                pass
            elif poll == backend.KVPoll.WaitingForInput:
                d.waiting_for_input = True
            elif poll == backend.KVPoll.Failed:
                err, other = _failure(d.kv_receiver)
                d.req.aborted = d.req.aborted or f"Decode handshake failed with exception {err}"
                d.handshake_error = (err, other)
            else:
                raise ValueError(f"Unexpected poll case: {poll}")

    def pop_preallocated(self):
        self._resolve_pending()
        self._update_handshake_waiters()
        keep = []
        for d in self.queue:
            if d.req.aborted is not None:
                err, other = getattr(d, "handshake_error", (d.req.aborted, False))
                d.kv_receiver.clear()
                self.pending = [p for p in self.pending if p is not d]
                self.done[d.req.rid] = _result(d.kv_receiver, "Failed", err, other, stage="handshake")
            else:
                keep.append(d)
        self.queue, still = keep, []
        for d in self.queue:
            if not d.waiting_for_input or not self.free_meta:
                still.append(d)
                continue
            d.metadata_buffer_index = self.free_meta.popleft()
            page_indices = np.asarray(d.req.pages, dtype=np.int32)  # kv_to_page_indices(tokens after the prefix)
            d.kv_receiver.send_metadata(page_indices, d.metadata_buffer_index, [], decode_prefix_len=d.req.prefix_tokens)
            self.transfer_queue.append(d)
            self.hook("metadata", d.req)
        self.queue = still

    def _metadata_gate(self, polls):
        for i, p in enumerate(polls):
            if p == backend.KVPoll.Success and room_in_row(self.kv, self.transfer_queue[i].metadata_buffer_index) == 0:
                polls[i] = backend.KVPoll.Transferring

    def pop_transferred(self):
        if not self.transfer_queue:
            return
        polls = self._all_reduce(self.transfer_queue)
        self._metadata_gate(polls)
        remove = set()
        for i, (d, poll) in enumerate(zip(self.transfer_queue, polls)):
            if poll == backend.KVPoll.Failed:
                err, other = _failure(d.kv_receiver)
                d.kv_receiver.clear()
                self.done[d.req.rid] = _result(d.kv_receiver, "Failed", err, other, stage="transfer")
                remove.add(i)
            elif poll == backend.KVPoll.Success:
                actual = room_in_row(self.kv, d.metadata_buffer_index)
                if actual != d.req.bootstrap_room:
                    d.kv_receiver.clear()
                    self.done[d.req.rid] = _result(d.kv_receiver, "Failed", f"metadata row holds room {actual}", stage="commit")
                else:
                    bad = self.verify(d)
                    d.kv_receiver.clear()
                    self.done[d.req.rid] = _result(d.kv_receiver, "Success", bad=bad)
                remove.add(i)
            elif poll in (backend.KVPoll.Bootstrapping, backend.KVPoll.WaitingForInput, backend.KVPoll.Transferring):
                pass
            else:
                raise ValueError(f"Unexpected poll case: {poll}")
        for i in remove:
            idx = self.transfer_queue[i].metadata_buffer_index
            self.kv.aux[0][idx][:8] = 0  # bootstrap_room[idx] = 0 for the next owner
            self.free_meta.append(idx)
        self.transfer_queue = [d for i, d in enumerate(self.transfer_queue) if i not in remove]

    def verify(self, d: DecodeRequest) -> list:
        """(what, buffer, src page, dst page) that differ from the pattern,
        including prefix pages that were written."""
        req, g, bad = d.req, self.g, []
        if req.src_pages is None:
            return bad
        src = req.src_pages[req.prefix_tokens // g.page_size:]
        for b in range(g.nbuffers()):
            for s, p in zip(src, req.pages):
                if not np.array_equal(self.kv.kv[b][p], expected_page(g, req.bootstrap_room, b, s)):
                    bad.append(("page", b, s, p))
            for p in req.prefix_pages:
                if self.kv.kv[b][p].any():
                    bad.append(("prefix", b, None, p))
        for k in range(len(g.aux_item_lens)):
            if not np.array_equal(self.kv.aux[k][d.metadata_buffer_index], expected_aux(g, k, req.bootstrap_room)):
                bad.append(("aux", k, None, d.metadata_buffer_index))
        return bad

    def step(self):
        self.pop_preallocated()
        self.pop_transferred()

    def close(self):
        self.kv_manager.close()
