"""kvxfer.sglang between processes: prefill rank processes (tests/peer.py)
and a decode rank in this process (or the other way round), with a
KVBootstrapServer here. Every byte of the destination pages and aux rows is
checked against the pattern; failures are checked on both sides."""

from __future__ import annotations

import os
import signal
import socket
import time
import types

import numpy as np
import pytest

from kvxfer import KvxError
from kvxfer.sglang import (
    DisaggregationMode,
    KVArgs,
    KVBootstrapServer,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTransferError,
    PrefillServerInfo,
)
from conftest import DEADLINE
from kvpattern import Geometry, RankKV, expected_aux, expected_page

TIMEOUTS = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30"}


@pytest.fixture(autouse=True)
def short_timeouts(monkeypatch):
    for k, v in TIMEOUTS.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def bootstrap():
    with KVBootstrapServer("127.0.0.1", 0) as bs:
        yield bs


def server_args(bs_addr="127.0.0.1:8998", tp_size=1):
    host, _, port = bs_addr.rpartition(":")
    return types.SimpleNamespace(host=host, disaggregation_bootstrap_port=int(port), tp_size=tp_size, dp_size=1, pp_size=1,
                                 enable_dp_attention=False, kv_cache_dtype="auto", dist_init_addr=None)


def decode_rank(g, mla=False):
    kv = RankKV(g)
    mgr = KVManager(kv.kv_args(), DisaggregationMode.DECODE, server_args(), is_mla_backend=mla)
    return kv, mgr


def prefill_ranks(peers, bs, tp, mla=False, extra=()):
    args = ["prefill", "--bootstrap", bs.addr, "--tp-size", str(tp)] + (["--mla"] if mla else []) + list(extra)
    return [peers(*args, "--tp-rank", str(r), env=TIMEOUTS) for r in range(tp)]


def receive(mgr, bs, room, dst, aux_row=None, prefix=0):
    r = KVReceiver(mgr, bs.addr, room)
    assert r.poll() == KVPoll.Bootstrapping
    r.init(0)
    assert r.wait(KVPoll.WaitingForInput, DEADLINE) == KVPoll.WaitingForInput, r.failure_reason()
    r.send_metadata(np.asarray(dst, dtype=np.int32), aux_row, None, prefix)
    return r


def check_pages(g, kv, room, src, dst):
    bad = []
    for b in range(g.nbuffers()):
        for s, d in zip(src, dst):
            if not np.array_equal(kv.kv[b][d], expected_page(g, room, b, s)):
                bad.append((b, s, d))
    assert not bad, f"(buffer, src page, dst page) wrong: {bad[:8]}"


@pytest.mark.parametrize(
    "tp,mla",
    [(1, False), (2, False), (2, True)],
    ids=["tp1to1", "tp2to1-head-slicing", "mla-tp2to1-dummy-rank"],
)
def test_prefill_to_decode(peers, bootstrap, tp, mla):
    g = Geometry(mla=mla)
    pre = prefill_ranks(peers, bootstrap, tp, mla)
    kv, mgr = decode_rank(g, mla)
    try:
        room = (1 << 62) + 12345
        src, dst, aux_row = [5, 6, 7, 20, 21, 40, 41], [1, 2, 9, 10, 11, 30, 63], 3
        for p in pre:
            p.send({"cmd": "send", "room": room, "src_pages": src, "chunks": 3, "aux_row": 2})
        r = receive(mgr, bootstrap, room, dst, aux_row)
        assert r.wait(KVPoll.Success, DEADLINE) == KVPoll.Success, r.failure_reason()
        results = [p.recv() for p in pre]
        assert all(res["state"] == KVPoll.Success for res in results), results
        check_pages(g, kv, room, src, dst)
        untouched = [d for d in range(g.pages) if d not in dst]
        assert not any(kv.kv[b][d].any() for b in range(g.nbuffers()) for d in untouched)
        for k in range(len(g.aux_item_lens)):
            assert np.array_equal(kv.aux[k][aux_row], expected_aux(g, k, room)), f"aux buffer {k}"
            assert int.from_bytes(r.aux_row(k)[:8], "little") == room
        m = r.get_transfer_metric()
        item = g.item_len(1)
        assert m.transfer_total_bytes == len(src) * item * g.nbuffers() + sum(g.aux_item_lens)
        assert m.transfer_latency_s is not None and m.transfer_latency_s > 0
        r.clear()
        assert r.poll() == KVPoll.Success  # clear keeps the last state
    finally:
        mgr.close()


def test_decode_prefix_len(peers, bootstrap):
    """The decode holds the first 2 pages (8 tokens): the prefill learns the
    prefix (pop_decode_prefix_len) and sends only the pages after it."""
    g = Geometry()
    (pre,) = prefill_ranks(peers, bootstrap, 1)
    kv, mgr = decode_rank(g)
    try:
        room = 77
        src, dst = [3, 4, 5, 6, 7], [10, 11, 12, 13, 14]
        prefix_tokens = 2 * g.page_size
        pre.send({"cmd": "send", "room": room, "src_pages": src, "chunks": 2, "aux_row": 1})
        r = receive(mgr, bootstrap, room, dst[2:], aux_row=4, prefix=prefix_tokens)
        assert r.wait(KVPoll.Success, DEADLINE) == KVPoll.Success, r.failure_reason()
        res = pre.recv()
        assert res["state"] == KVPoll.Success and res["prefix"] == prefix_tokens, res
        check_pages(g, kv, room, src[2:], dst[2:])
        assert not any(kv.kv[b][d].any() for b in range(g.nbuffers()) for d in dst[:2]), "prefix pages were written"
        assert np.array_equal(kv.aux[0][4], expected_aux(g, 0, room))
        assert r.get_transfer_metric().transfer_total_bytes == 3 * g.item_len(1) * g.nbuffers() + sum(g.aux_item_lens)
    finally:
        mgr.close()


def test_host_buffers_over_shm(peers, bootstrap):
    """kvxfer.HostBuffer memory on both sides: transport auto picks shm."""
    g = Geometry()
    (pre,) = prefill_ranks(peers, bootstrap, 1, extra=["--host-buffers"])
    kv = RankKV(g, host_buffers=True)
    mgr = KVManager(kv.kv_args(), "decode", server_args())
    try:
        assert mgr.transport == pre.ready["transport"] == "shm"
        assert mgr.transports[0] == "shm", mgr.transports
        room = 5
        pre.send({"cmd": "send", "room": room, "src_pages": [1, 2, 3], "chunks": 2})
        r = receive(mgr, bootstrap, room, [7, 8, 9])
        assert r.wait(KVPoll.Success, DEADLINE) == KVPoll.Success, r.failure_reason()
        assert pre.recv()["state"] == KVPoll.Success
        check_pages(g, kv, room, [1, 2, 3], [7, 8, 9])
    finally:
        mgr.close()
        kv.close()


def _cma_expected():
    """The transport auto gives caller buffers on one host: cma, unless Yama
    forbids cross-memory attach here (ptrace_scope 3, or 2 without root)."""
    try:
        scope = int(open("/proc/sys/kernel/yama/ptrace_scope").read())
    except (OSError, ValueError):
        scope = 0
    return "tcp" if scope >= 3 or (scope == 2 and os.geteuid() != 0) else "cma"


def test_caller_buffers_over_cma(peers, bootstrap):
    """numpy arrays (the caller's own memory, as SGLang's KV pool) on both
    sides: shm cannot share them, so auto registers them with cma (tcp
    behind it) and the room runs on cma; mgr.transport and the ready line
    say so."""
    g = Geometry()
    (pre,) = prefill_ranks(peers, bootstrap, 1)
    kv, mgr = decode_rank(g)
    try:
        want = _cma_expected()
        assert mgr.transport == pre.ready["transport"] == want
        assert "shm" not in mgr.transports and mgr.transports[-1] == "tcp", mgr.transports
        room = 6
        pre.send({"cmd": "send", "room": room, "src_pages": [2, 3, 4], "chunks": 2})
        r = receive(mgr, bootstrap, room, [5, 6, 7])
        assert r.wait(KVPoll.Success, DEADLINE) == KVPoll.Success, r.failure_reason()
        assert pre.recv()["state"] == KVPoll.Success
        check_pages(g, kv, room, [2, 3, 4], [5, 6, 7])
    finally:
        mgr.close()


def test_unreachable_bootstrap(monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "3")
    g = Geometry()
    kv, mgr = decode_rank(g)
    try:
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            addr = f"127.0.0.1:{s.getsockname()[1]}"
        r = KVReceiver(mgr, addr, 9)
        r.init(0)
        assert r.wait(KVPoll.Success, DEADLINE) == KVPoll.Failed
        with pytest.raises(KVTransferError) as ei:
            r.failure_exception()
        assert ei.value.bootstrap_room == 9
        assert addr in str(ei.value) and "KVTransferError(bootstrap_room=9)" in str(ei.value), str(ei.value)
    finally:
        mgr.close()


def test_abort_from_prefill(peers, bootstrap):
    g = Geometry()
    (pre,) = prefill_ranks(peers, bootstrap, 1)
    kv, mgr = decode_rank(g)
    try:
        pre.send({"cmd": "send", "room": 31, "src_pages": [1, 2], "abort_when_waiting": True})
        r = receive(mgr, bootstrap, 31, [3, 4])
        assert r.wait(KVPoll.Success, DEADLINE) == KVPoll.Failed
        res = pre.recv()
        assert res["state"] == KVPoll.Failed and "aborted by prefill" in res["error"], res
        with pytest.raises(KVTransferError, match="aborted by prefill"):
            r.failure_exception()
    finally:
        mgr.close()


def test_abort_from_decode(peers, bootstrap):
    g = Geometry()
    (pre,) = prefill_ranks(peers, bootstrap, 1)
    kv, mgr = decode_rank(g)
    try:
        pre.send({"cmd": "send", "room": 32, "src_pages": [1, 2]})
        r = KVReceiver(mgr, bootstrap.addr, 32)
        r.init(0)
        assert r.wait(KVPoll.WaitingForInput, DEADLINE) == KVPoll.WaitingForInput
        r.abort()
        assert r.poll() == KVPoll.Failed
        with pytest.raises(KVTransferError, match="aborted"):
            r.failure_exception()
        res = pre.recv()
        assert res["state"] == KVPoll.Failed and "aborted by decode" in res["error"], res
    finally:
        mgr.close()


def test_duplicate_room(peers, bootstrap):
    g = Geometry()
    (pre,) = prefill_ranks(peers, bootstrap, 1)
    first = pre.call({"cmd": "create", "room": 41})
    assert first["state"] == KVPoll.Bootstrapping
    second = pre.call({"cmd": "create", "room": 41})
    assert second["state"] == KVPoll.Failed and "41" in second["error"] and "active" in second["error"], second
    kv, mgr = decode_rank(g)
    try:
        r1 = KVReceiver(mgr, bootstrap.addr, 42, prefill_dp_rank=0)
        r2 = KVReceiver(mgr, bootstrap.addr, 42, prefill_dp_rank=0)
        assert r1.poll() != KVPoll.Failed
        assert r2.poll() == KVPoll.Failed
        with pytest.raises(KVTransferError, match="42"):
            r2.failure_exception()
        assert r1.poll() != KVPoll.Failed  # the first receiver is untouched
    finally:
        mgr.close()


def test_prefill_killed_mid_transfer(peers, bootstrap):
    """Fault without verification: the prefill rank dies (SIGKILL) after the
    first of three chunks; the decode's room fails (it never reports Success)
    and names the lost peer, as the dead prefill never reported Success."""
    g = Geometry()
    (pre,) = prefill_ranks(peers, bootstrap, 1)
    kv, mgr = decode_rank(g)
    try:
        pre.send({"cmd": "send", "room": 51, "src_pages": list(range(12)), "chunks": 3, "die_after_chunks": 1})
        r = receive(mgr, bootstrap, 51, list(range(20, 32)))
        assert pre.recv()["event"] == "dying"
        pre.kill()
        t0 = time.monotonic()
        assert r.wait(KVPoll.Success, DEADLINE) == KVPoll.Failed
        assert time.monotonic() - t0 < DEADLINE
        status, msg = r.failure_reason()
        assert status != 0 and "51" in msg, msg
    finally:
        mgr.close()


def test_stalled_prefill_same_outcome_on_both_sides(peers, bootstrap):
    """Fault without verification: the prefill rank stalls (SIGSTOP) after
    the first of three chunks; the decode fails the room (silent peer) and,
    once the prefill runs again (SIGCONT) and sends the rest, the prefill's
    room fails too: one outcome for the room on both sides, never a Success
    the decode has already given up on."""
    g = Geometry()
    (pre,) = prefill_ranks(peers, bootstrap, 1)
    kv, mgr = decode_rank(g)
    try:
        room = 52
        pre.send({"cmd": "send", "room": room, "src_pages": list(range(12)), "chunks": 3, "pause_after_chunks": 1})
        r = receive(mgr, bootstrap, room, list(range(20, 32)))
        assert pre.recv()["event"] == "paused"
        pre.kill(signal.SIGSTOP)
        try:
            assert r.wait(KVPoll.Success, DEADLINE) == KVPoll.Failed
            status, msg = r.failure_reason()
            assert status != 0 and str(room) in msg, msg
        finally:
            pre.kill(signal.SIGCONT)
        pre.send({"cmd": "continue"})
        res = pre.recv()
        assert res["state"] == KVPoll.Failed, f"decode failed the room ({msg}) but the prefill reported {res}"
    finally:
        mgr.close()


def test_decode_killed_before_send(peers, bootstrap):
    """Fault without verification: the decode rank dies after send_metadata;
    the prefill's room then fails instead of reporting Success."""
    g = Geometry()
    dec = peers("decode", "--bootstrap", bootstrap.addr, env=TIMEOUTS)
    kv = RankKV(g)
    mgr = KVManager(kv.kv_args(), DisaggregationMode.PREFILL, server_args(bootstrap.addr))
    try:
        room = 61
        kv.fill(room)
        s = KVSender(mgr, bootstrap.addr, room, [0], 0)
        dec.send({"cmd": "recv", "room": room, "dst_pages": [1, 2, 3, 4], "die_after_metadata": True})
        assert s.wait(KVPoll.WaitingForInput, DEADLINE) == KVPoll.WaitingForInput
        assert dec.recv()["event"] == "dying"
        dec.kill()
        s.init(4, None)
        s.send(np.array([1, 2], dtype=np.int32))
        s.send([3, 4])
        assert s.wait(KVPoll.Success, DEADLINE) == KVPoll.Failed
        with pytest.raises(KVTransferError) as ei:
            s.failure_exception()
        assert "61" in str(ei.value)
    finally:
        mgr.close()


def test_local_misuse_fails_the_room(peers, bootstrap):
    """send() before init(), or pages beyond the buffers, fail the room (both
    sides) instead of raising from send()."""
    g = Geometry()
    dec = peers("decode", "--bootstrap", bootstrap.addr, env=TIMEOUTS)
    kv = RankKV(g)
    mgr = KVManager(kv.kv_args(), "prefill", server_args(bootstrap.addr))
    try:
        s = KVSender(mgr, bootstrap.addr, 71, [0], 0)
        dec.send({"cmd": "recv", "room": 71, "dst_pages": [1, 2]})
        assert s.wait(KVPoll.WaitingForInput, DEADLINE) == KVPoll.WaitingForInput
        s.send([1, 2])  # before init
        assert s.poll() == KVPoll.Failed
        with pytest.raises(KVTransferError, match="before init"):
            s.failure_exception()
        assert dec.recv()["state"] == KVPoll.Failed  # the decode learned it too

        s2 = KVSender(mgr, bootstrap.addr, 72, [0], 0)
        dec.send({"cmd": "recv", "room": 72, "dst_pages": [1, 2]})
        assert s2.wait(KVPoll.WaitingForInput, DEADLINE) == KVPoll.WaitingForInput
        s2.init(2)
        s2.send([1, g.pages + 5])
        assert s2.poll() == KVPoll.Failed
        with pytest.raises(KVTransferError, match=str(g.pages + 5)):
            s2.failure_exception()
        assert dec.recv()["state"] == KVPoll.Failed
    finally:
        mgr.close()


def test_manager_refuses_bad_buffers():
    g = Geometry()
    kv = RankKV(g)
    args = kv.kv_args()
    args.kv_item_lens = [g.item_len(1) + 3] * len(args.kv_data_ptrs)  # not whole head rows
    with pytest.raises(KvxError) as ei:
        KVManager(args, "decode", server_args())
    assert "kv_item_lens" in str(ei.value) or "item" in str(ei.value), str(ei.value)
    with pytest.raises(ValueError, match="parallel lists"):
        KVManager(KVArgs(kv_data_ptrs=[1, 2], kv_data_lens=[1], kv_item_lens=[1, 1], kv_location="host"), "decode", server_args())
    with pytest.raises(ValueError, match="prefill or decode"):
        KVManager(args, "null", server_args())
    with pytest.raises(ValueError, match="kv_data_ptrs is empty"):
        KVManager(KVArgs(), "decode", server_args())


def test_prefill_needs_a_bootstrap_server(monkeypatch):
    """A prefill rank whose bootstrap server is not there fails to start
    within the bootstrap timeout, naming the address."""
    g = Geometry()
    kv = RankKV(g)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "2")
    with pytest.raises(KvxError) as ei:
        KVManager(kv.kv_args(), "prefill", server_args(addr))
    assert addr in str(ei.value), str(ei.value)


def test_control_auth_and_max_peers_arguments(peers, bootstrap, monkeypatch):
    """Control-frame authentication and the peer bound through kvx_kv_config
    (KVManager keyword arguments), without --verify: a decode with
    control_auth=True drops the frames of a prefill that does not tag them,
    and its room fails naming the unauthenticated frames and the setting;
    the prefill's room fails too. A prefill with the same token and
    KVXFER_CONTROL_AUTH=1 (the environment fallback) serves the same decode.
    A decode with max_peers=1 refuses the second prefill rank of a TP-2
    room naming the bound."""
    short = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "5", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "5"}
    for k, v in short.items():
        monkeypatch.setenv(k, v)
    for k in ("KVXFER_CONTROL_AUTH", "KVXFER_MAX_PEERS", "KVXFER_BOOTSTRAP_AUTH_TOKEN", "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    g = Geometry()
    kv = RankKV(g)
    with pytest.raises(KvxError, match="BootstrapAuthToken"):
        KVManager(kv.kv_args(), DisaggregationMode.DECODE, server_args(), control_auth=True)
    with pytest.raises(ValueError, match="max_peers"):
        KVManager(kv.kv_args(), DisaggregationMode.DECODE, server_args(), max_peers=0)
    sa = server_args()
    sa.bootstrap_auth_token = "deployment-token"
    mgr = KVManager(kv.kv_args(), DisaggregationMode.DECODE, sa, control_auth=True)
    try:
        (plain,) = prefill_ranks(peers, bootstrap, 1)
        plain.send({"cmd": "send", "room": 61, "src_pages": [1, 2]})
        r = KVReceiver(mgr, bootstrap.addr, 61)
        r.init(0)
        assert r.wait(KVPoll.Success, DEADLINE) == KVPoll.Failed
        _, msg = r.failure_reason()
        assert "unauthenticated" in msg and "control_auth" in msg, msg
        res = plain.recv()
        assert res["state"] == KVPoll.Failed, res
        plain.close()

        with KVBootstrapServer("127.0.0.1", 0) as bs2:
            env = dict(short, KVXFER_CONTROL_AUTH="1", KVXFER_BOOTSTRAP_AUTH_TOKEN="deployment-token")
            authed = peers("prefill", "--bootstrap", bs2.addr, "--tp-size", "1", "--tp-rank", "0", env=env)
            authed.send({"cmd": "send", "room": 62, "src_pages": [1, 2]})
            r = receive(mgr, bs2, 62, [3, 4])
            assert r.wait(KVPoll.Success, DEADLINE) == KVPoll.Success, r.failure_reason()
            assert authed.recv()["state"] == KVPoll.Success
            check_pages(g, kv, 62, [1, 2], [3, 4])
    finally:
        mgr.close()

    kv2 = RankKV(g)
    one = KVManager(kv2.kv_args(), DisaggregationMode.DECODE, server_args(), max_peers=1)
    try:
        pre = prefill_ranks(peers, bootstrap, 2)
        for p in pre:
            p.send({"cmd": "send", "room": 63, "src_pages": [1, 2]})
        r = KVReceiver(one, bootstrap.addr, 63)
        r.init(0)
        assert r.wait(KVPoll.Success, DEADLINE) == KVPoll.Failed
        _, msg = r.failure_reason()
        assert "too many control peers" in msg and "MaxPeers 1" in msg, msg
        assert all(p.recv()["state"] == KVPoll.Failed for p in pre)
    finally:
        one.close()


def test_prefill_declares_allocation_policy_and_layout(bootstrap):
    """A prefill KVManager registers server_args'
    disaggregation_decode_allocation_policy and KVArgs' dsv41_spec_layout,
    as SGLang's register_to_bootstrap does, so the directory's topology
    answer carries them to decodes (a decode running prefill_complete fails
    every room whose prefill declares "early")."""
    import json
    import urllib.request

    g = Geometry()
    kv = RankKV(g)
    args = kv.kv_args()
    args.dsv41_spec_layout = {"num_draft_tokens": 6, "block_size": 128}
    sa = server_args(bootstrap.addr)
    sa.disaggregation_decode_allocation_policy = "prefill_complete"
    mgr = KVManager(args, DisaggregationMode.PREFILL, sa)
    try:
        url = f"http://{bootstrap.addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        with urllib.request.urlopen(url, timeout=10) as resp:
            info = json.load(resp)
        assert info["decode_allocation_policy"] == "prefill_complete", info
        assert info["dsv41_spec_layout"] == {"num_draft_tokens": 6, "block_size": 128}, info
        parsed = PrefillServerInfo.from_json(info)
        assert parsed.decode_allocation_policy == "prefill_complete" and parsed.dsv41_spec_layout == info["dsv41_spec_layout"], parsed
        assert not parsed.extra, parsed.extra
        old = {k: v for k, v in info.items() if k not in ("decode_allocation_policy", "dsv41_spec_layout")}
        assert PrefillServerInfo.from_json(old).decode_allocation_policy == "early"  # SGLang 0094505's key set
    finally:
        mgr.close()
