"""SGLang's prefill and decode scheduler call sequences (tests/sglang_sched.py)
driving kvxfer.sglang in two processes: a prefill scheduler in a peer process
and a decode scheduler here, or the other way round, with a KVBootstrapServer
here started as SGLang starts it. KVArgs are SGLang's own shape (no defaults)
filled as SGLang fills them. Every test checks that both sides end the room in
the same state; no --verify / checksum."""

from __future__ import annotations

import json
import socket
import time
import types
import urllib.request

import pytest

import kvxfer.sglang as backend
from conftest import DEADLINE, wait_until
from kvpattern import Geometry, RankKV
from sglang_sched import DecodeScheduler, PrefillScheduler, Req, decode_kv_args, prefill_kv_args

TIMEOUTS = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30"}

@pytest.fixture(autouse=True)
def short_timeouts(monkeypatch):
    for k, v in TIMEOUTS.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def bootstrap():
    # As SGLang's start_disagg_service: keywords host= and port=.
    with backend.KVBootstrapServer(host="127.0.0.1", port=0) as bs:
        yield bs


def server_args(bs, tp_size=1):
    return types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=bs.port, tp_size=tp_size, dp_size=1, pp_size=1,
                                 enable_dp_attention=False, kv_cache_dtype="auto", dist_init_addr=None,
                                 disaggregation_ib_device=None)


def add_cmd(bs, rid, room, tokens, pages, **kw):
    return dict(cmd="add", rid=rid, room=room, bootstrap=f"127.0.0.1:{bs.port}", tokens=tokens, pages=pages, **kw)


def decode_req(bs, rid, room, tokens, pages, src_pages, prefix_tokens=0, prefix_pages=()):
    return Req(rid, room, "127.0.0.1", bs.port, tokens, pages, prefix_tokens, prefix_pages, src_pages)


def prefill_req(bs, rid, room, tokens, pages, chunks=1, **hooks):
    # SGLang's prefill names its own bootstrap port; the host is the request's.
    return Req(rid, room, "127.0.0.1", bs.port, tokens, pages, chunks=chunks, **hooks)


def run(sched, peer, until, timeout=DEADLINE):
    """Step the local scheduler and collect the peer's events until
    until(events) is true; returns the events."""
    events = []
    end = time.monotonic() + timeout
    while True:
        sched.step()
        while (ev := peer.try_recv()) is not None:
            events.append(ev)
        if until(events):
            return events
        if time.monotonic() > end:
            raise AssertionError(f"not reached within {timeout} s; local done {sched.done}, peer events {events}")
        time.sleep(0.002)


def done_events(events):
    return {e["rid"]: e for e in events if e.get("event") == "done"}


@pytest.mark.parametrize("mla,heads_from", [
    pytest.param(True, None, id="mla-decode-kvargs-as-sglang"),
    pytest.param(False, "config", id="mha-decode-kvargs-as-sglang-heads-from-model-config"),
    pytest.param(False, "env", id="mha-decode-kvargs-as-sglang-heads-from-env"),
    pytest.param(False, "kvargs", id="mha-decode-kvargs-with-heads"),
    pytest.param(False, None, id="mha-decode-kvargs-as-sglang-no-head-count"),
])
def test_scheduler_sequence(peers, bootstrap, monkeypatch, tmp_path, mla, heads_from):
    """Three requests, chunked prefill (3 chunks, a partial last page). The
    first request goes through try_ensure_parallel_info; once
    prefill_info_table knows the prefill, the next ones take the fast path.
    The decode's KV head count comes from nowhere (SGLang's KVArgs: the
    engine takes the prefill's from REGISTER_ACK; MLA needs none), from
    config.json at server_args.model_path, from KVXFER_TOTAL_KV_HEAD_NUM, or
    from KVArgs (the last three a cross-check)."""
    g = Geometry(mla=mla)
    pre = peers("sched-prefill", "--bootstrap", bootstrap.addr, *(["--mla"] if mla else []), env=TIMEOUTS)
    kv = RankKV(g)
    sa = server_args(bootstrap)
    monkeypatch.delenv("KVXFER_TOTAL_KV_HEAD_NUM", raising=False)
    if heads_from == "config":
        (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4 * g.heads, "num_key_value_heads": g.heads}))
        sa.model_path = str(tmp_path)
    elif heads_from == "env":
        monkeypatch.setenv("KVXFER_TOTAL_KV_HEAD_NUM", str(g.heads))
    dec = DecodeScheduler(kv, sa, mla=mla, with_heads=heads_from == "kvargs")
    try:
        rooms = {"r0": (1 << 62) + 7, "r1": 12345, "r2": 99}
        src = {"r0": [1, 2, 3, 4, 5], "r1": [10, 11, 12], "r2": [20, 21, 22, 23]}
        dst = {"r0": [40, 41, 42, 43, 44], "r1": [33, 31, 32], "r2": [50, 55, 51, 52]}
        tokens = {rid: len(p) * g.page_size - 1 for rid, p in src.items()}
        pre.send(add_cmd(bootstrap, "r0", rooms["r0"], tokens["r0"], src["r0"], chunks=3))
        dec.add(decode_req(bootstrap, "r0", rooms["r0"], tokens["r0"], dst["r0"], src["r0"]))
        run(dec, pre, lambda ev: bootstrap.addr in dec.kv_manager.prefill_info_table or "r0" in dec.done)
        info = dec.kv_manager.prefill_info_table[bootstrap.addr]
        assert (info.dp_size, info.attn_tp_size, info.page_size, info.follow_bootstrap_room) == (1, 1, g.page_size, True)
        for rid in ("r1", "r2"):
            pre.send(add_cmd(bootstrap, rid, rooms[rid], tokens[rid], src[rid], chunks=3))
            dec.add(decode_req(bootstrap, rid, rooms[rid], tokens[rid], dst[rid], src[rid]))
        events = run(dec, pre, lambda ev: len(dec.done) == 3 and len(done_events(ev)) == 3)
        pdone = done_events(events)
        assert dec.paths == {"r0": "ensure", "r1": "fast", "r2": "fast"}
        for rid in rooms:
            assert (pdone[rid]["state"], dec.done[rid]["state"]) == ("Success", "Success"), (pdone[rid], dec.done[rid])
            assert dec.done[rid]["bad"] == [], dec.done[rid]["bad"][:8]
            moved = len(src[rid]) * g.item_len(1) * g.nbuffers() + sum(g.aux_item_lens)
            assert pdone[rid]["bytes"] == moved and dec.done[rid]["bytes"] == moved  # read after clear()
            assert pdone[rid]["latency_s"] > 0 and dec.done[rid]["latency_s"] > 0
            assert pdone[rid]["prefix"] == 0 and pdone[rid]["dummy_cp"] is False
    finally:
        dec.close()


def test_decode_prefix_reuse(peers, bootstrap):
    """The decode's radix cache holds the first 2 pages: send_metadata(...,
    decode_prefix_len=8) with the pages after them only; the prefill's
    pop_decode_prefix_len gives 8, init gets the remaining page count, and
    the prefix pages are never written."""
    g = Geometry()
    pre = peers("sched-prefill", "--bootstrap", bootstrap.addr, env=TIMEOUTS)
    kv = RankKV(g)
    dec = DecodeScheduler(kv, server_args(bootstrap), with_heads=True)
    try:
        src, prefix_pages, dst = [3, 4, 5, 6, 7], [8, 9], [10, 11, 12]
        prefix = 2 * g.page_size
        tokens = len(src) * g.page_size - 2
        pre.send(add_cmd(bootstrap, "p", 77, tokens, src, chunks=2))
        dec.add(decode_req(bootstrap, "p", 77, tokens, dst, src, prefix, prefix_pages))
        events = run(dec, pre, lambda ev: "p" in dec.done and "p" in done_events(ev))
        p, d = done_events(events)["p"], dec.done["p"]
        assert (p["state"], d["state"]) == ("Success", "Success"), (p, d)
        assert p["prefix"] == prefix
        assert d["bad"] == [], d["bad"][:8]
        assert p["bytes"] == d["bytes"] == len(dst) * g.item_len(1) * g.nbuffers() + sum(g.aux_item_lens)
    finally:
        dec.close()


def test_abort_from_prefill_mid_chunks(peers, bootstrap):
    """AbortReq on the prefill after the first of three chunks (the batch
    result aborts and clears the sender): both sides end Failed."""
    g = Geometry()
    pre = peers("sched-prefill", "--bootstrap", bootstrap.addr, env=TIMEOUTS)
    dec = DecodeScheduler(RankKV(g), server_args(bootstrap), with_heads=True)
    try:
        src = list(range(1, 10))
        pre.send(add_cmd(bootstrap, "a", 31, len(src) * g.page_size, src, chunks=3, abort_after_chunks=1))
        dec.add(decode_req(bootstrap, "a", 31, len(src) * g.page_size, list(range(20, 29)), src))
        events = run(dec, pre, lambda ev: "a" in dec.done and "a" in done_events(ev))
        p, d = done_events(events)["a"], dec.done["a"]
        assert (p["state"], d["state"]) == ("Failed", "Failed"), (p, d)
        assert "aborted by prefill" in d["error"] and "31" in d["error"], d
        assert d["is_from_another_rank"] is False
    finally:
        dec.close()


def test_abort_from_decode_while_prefill_forwards(peers, bootstrap):
    """The decode aborts a request after send_metadata while the prefill has
    not sent it yet (its forward is held): the prefill then forwards and
    sends, and both sides end Failed."""
    g = Geometry()
    pre = peers("sched-prefill", "--bootstrap", bootstrap.addr, env=TIMEOUTS)
    dec = DecodeScheduler(RankKV(g), server_args(bootstrap), with_heads=True)
    try:
        src = [1, 2, 3, 4]
        pre.send(add_cmd(bootstrap, "d", 32, len(src) * g.page_size, src, chunks=2, hold=True))
        dec.add(decode_req(bootstrap, "d", 32, len(src) * g.page_size, [5, 6, 7, 8], src))
        run(dec, pre, lambda ev: dec.transfer_queue)
        dec.abort("d")
        pre.send({"cmd": "release", "rid": "d"})
        events = run(dec, pre, lambda ev: "d" in dec.done and "d" in done_events(ev))
        p, d = done_events(events)["d"], dec.done["d"]
        assert (p["state"], d["state"]) == ("Failed", "Failed"), (p, d)
        assert "aborted by decode" in p["error"], p
    finally:
        dec.close()


def test_failure_from_another_rank(peers, bootstrap):
    """Another decode TP rank reports Failed: the all-reduced poll is Failed
    while this rank's room is not. failure_exception() then says so
    (is_from_another_rank, which SGLang logs at debug level), aborts the room
    here, and the prefill fails too."""
    g = Geometry()
    pre = peers("sched-prefill", "--bootstrap", bootstrap.addr, env=TIMEOUTS)
    dec = DecodeScheduler(RankKV(g), server_args(bootstrap), with_heads=True)
    try:
        src = [1, 2, 3]
        pre.send(add_cmd(bootstrap, "o", 33, len(src) * g.page_size, src, hold=True))
        dec.add(decode_req(bootstrap, "o", 33, len(src) * g.page_size, [4, 5, 6], src))
        run(dec, pre, lambda ev: dec.transfer_queue)
        dec.other_rank_failed.add("o")
        pre.send({"cmd": "release", "rid": "o"})
        events = run(dec, pre, lambda ev: "o" in dec.done and "o" in done_events(ev))
        p, d = done_events(events)["o"], dec.done["o"]
        assert (p["state"], d["state"]) == ("Failed", "Failed"), (p, d)
        assert d["is_from_another_rank"] is True and "another rank" in d["error"], d
        assert p["is_from_another_rank"] is False
    finally:
        dec.close()


def test_prefill_killed_mid_transfer(peers, bootstrap):
    """The prefill process dies (SIGKILL) after the first of three chunks:
    the decode's room fails (never Success) within the deadline, naming the
    room, and the dead prefill never reported Success."""
    g = Geometry()
    pre = peers("sched-prefill", "--bootstrap", bootstrap.addr, env=TIMEOUTS)
    dec = DecodeScheduler(RankKV(g), server_args(bootstrap), with_heads=True)
    try:
        src = list(range(12))
        pre.send(add_cmd(bootstrap, "k", 51, len(src) * g.page_size, src, chunks=3, die_after_chunks=1))
        dec.add(decode_req(bootstrap, "k", 51, len(src) * g.page_size, list(range(20, 32)), src))
        events = run(dec, pre, lambda ev: any(e.get("event") == "dying" for e in ev))
        pre.kill()
        t0 = time.monotonic()
        while "k" not in dec.done:
            dec.step()
            assert time.monotonic() - t0 < DEADLINE, "decode did not fail the room of a killed prefill"
            time.sleep(0.005)
        assert dec.done["k"]["state"] == "Failed" and "51" in dec.done["k"]["error"], dec.done["k"]
        assert "k" not in done_events(events)
    finally:
        dec.close()


def test_decode_killed_after_metadata(peers, bootstrap):
    """The decode process dies (SIGKILL) after send_metadata: the prefill
    scheduler here sends and its room ends Failed, not Success."""
    g = Geometry()
    dec = peers("sched-decode", "--bootstrap", bootstrap.addr, "--with-heads", env=TIMEOUTS)
    pre = PrefillScheduler(RankKV(g), server_args(bootstrap))
    try:
        src = [1, 2, 3, 4]
        tokens = len(src) * g.page_size
        dec.send(add_cmd(bootstrap, "x", 61, tokens, [5, 6, 7, 8], src_pages=src, die_after_metadata=True))
        req = prefill_req(bootstrap, "x", 61, tokens, src, chunks=2, hold=True)
        pre.add(req)
        # The decode stops after send_metadata; the prefill gets its metadata
        # (WaitingForInput: the request moves on to its forward).
        run(pre, dec, lambda ev: any(e.get("event") == "dying" for e in ev) and pre.waiting)
        dec.kill()
        req.hooks["released"] = True
        t0 = time.monotonic()
        while "x" not in pre.done:
            pre.step()
            assert time.monotonic() - t0 < DEADLINE, "prefill did not fail the room of a killed decode"
            time.sleep(0.005)
        assert pre.done["x"]["state"] == "Failed" and "61" in pre.done["x"]["error"], pre.done["x"]
    finally:
        pre.close()


def test_prefill_scheduler_here_decode_peer(peers, bootstrap):
    """The mirror of test_scheduler_sequence: the prefill scheduler in this
    process and the decode scheduler in a peer, with a decode prefix."""
    g = Geometry()
    dec = peers("sched-decode", "--bootstrap", bootstrap.addr, "--with-heads", env=TIMEOUTS)
    pre = PrefillScheduler(RankKV(g), server_args(bootstrap))
    try:
        src = [2, 3, 4, 5, 6, 7]
        tokens = len(src) * g.page_size - 3
        dec.send(add_cmd(bootstrap, "m", 88, tokens, [30, 31, 32, 33], src_pages=src, prefix_tokens=2 * g.page_size,
                         prefix_pages=[40, 41]))
        pre.add(prefill_req(bootstrap, "m", 88, tokens, src, chunks=3))
        events = run(pre, dec, lambda ev: "m" in pre.done and "m" in done_events(ev))
        p, d = pre.done["m"], done_events(events)["m"]
        assert (p["state"], d["state"]) == ("Success", "Success"), (p, d)
        assert d["bad"] == [] and p["prefix"] == 2 * g.page_size
    finally:
        pre.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        return r.status


def test_bootstrap_server_constructors():
    """KVBootstrapServer(port) as older SGLang calls it listens on that port
    (not 8998); host=/port= keywords as newer SGLang; ``thread`` is alive
    until close(), as SGLang's bootstrap-server process expects."""
    port = free_port()
    bs = backend.KVBootstrapServer(port)
    try:
        assert (bs.host, bs.port) == ("127.0.0.1", port) and health(port) == 200
        assert bs.thread.is_alive()
    finally:
        bs.close()
    bs.thread.join(timeout=5)
    assert not bs.thread.is_alive()
    bs.close()  # idempotent
    port = free_port()
    with backend.KVBootstrapServer(host="127.0.0.1", port=port, dp_size=2) as bs:
        assert bs.port == port and health(port) == 200
    with backend.KVBootstrapServer(str(free_port())) as bs:
        assert bs.host == "127.0.0.1"
    for bad in (-1, 70000, "http", 1.5, True):
        with pytest.raises(ValueError, match="port"):
            backend.KVBootstrapServer("127.0.0.1", bad)


def test_try_ensure_parallel_info_and_dp_query(peers, bootstrap, monkeypatch):
    """False (never an exception) while nobody answers or no prefill rank has
    registered (503), True once one has, with the topology cached;
    query_prefill_dp_ranks gives {} for rooms the directory does not know."""
    monkeypatch.setattr("kvxfer.sglang.conn.DIRECTORY_TIMEOUT_S", 2.0)
    g = Geometry()
    dec = DecodeScheduler(RankKV(g), server_args(bootstrap), with_heads=True)
    try:
        mgr = dec.kv_manager
        nobody = f"127.0.0.1:{free_port()}"
        assert mgr.try_ensure_parallel_info(nobody) is False
        assert mgr.try_ensure_parallel_info(bootstrap.addr) is False  # 503: no prefill rank yet
        assert mgr.prefill_info_table == {}
        peers("sched-prefill", "--bootstrap", bootstrap.addr, env=TIMEOUTS)
        assert mgr.try_ensure_parallel_info(bootstrap.addr) is True
        assert mgr.prefill_info_table[bootstrap.addr].dp_size == 1
        assert backend.query_prefill_dp_ranks(bootstrap.addr, [5, 6]) == {}
        assert backend.KVReceiver.query_prefill_dp_ranks(nobody, [5]) == {}
    finally:
        dec.close()


def test_rebootstrap_without_prefill_http_port(peers, bootstrap):
    """submit_prefill_recompute (SGLang's PD rebootstrap) when the directory
    reports no prefill_http_port: the room fails here and at the prefill,
    naming the missing port, instead of an AttributeError in the
    scheduler."""
    g = Geometry()
    pre = peers("sched-prefill", "--bootstrap", bootstrap.addr, env=TIMEOUTS)
    dec = DecodeScheduler(RankKV(g), server_args(bootstrap), with_heads=True)
    try:
        pre.send(add_cmd(bootstrap, "b", 71, 2 * g.page_size, [1, 2], hold=True))
        dec.add(decode_req(bootstrap, "b", 71, 2 * g.page_size, [3, 4], [1, 2]))
        run(dec, pre, lambda ev: dec.transfer_queue)
        dec.kv_manager.submit_prefill_recompute(dec.transfer_queue[0].kv_receiver, {"rid": "b"})
        pre.send({"cmd": "release", "rid": "b"})
        events = run(dec, pre, lambda ev: "b" in dec.done and "b" in done_events(ev))
        assert dec.done["b"]["state"] == "Failed" and "prefill_http_port" in dec.done["b"]["error"], dec.done["b"]
        assert done_events(events)["b"]["state"] == "Failed"
    finally:
        dec.close()


def test_rebootstrap_reaches_prefill_http_port(peers, bootstrap):
    """The prefill registers server_args.port as prefill_http_port (as
    SGLang's register_to_bootstrap), the topology carries it, and the
    decode's submit_prefill_recompute (SGLang's PD rebootstrap) POSTs the
    payload to http://{bootstrap host}:{port}/generate, where a stand-in for
    the prefill's HTTP API receives it; the room then completes on both
    sides."""
    import http.server
    import threading

    got = []

    class Generate(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            got.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a):
            pass

    api = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Generate)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    g = Geometry()
    pre = peers("sched-prefill", "--bootstrap", bootstrap.addr, "--http-port", str(api.server_port), env=TIMEOUTS)
    dec = DecodeScheduler(RankKV(g), server_args(bootstrap), with_heads=True)
    try:
        pre.send(add_cmd(bootstrap, "b", 72, 2 * g.page_size, [1, 2], hold=True))
        dec.add(decode_req(bootstrap, "b", 72, 2 * g.page_size, [3, 4], [1, 2]))
        run(dec, pre, lambda ev: dec.transfer_queue)
        assert dec.kv_manager.prefill_info_table[bootstrap.addr].prefill_http_port == api.server_port
        dec.kv_manager.submit_prefill_recompute(dec.transfer_queue[0].kv_receiver, {"rid": "b", "bootstrap_room": 72})
        wait_until(lambda: got, what="POST /generate at the prefill's HTTP port")
        assert got == [("/generate", {"rid": "b", "bootstrap_room": 72})], got
        pre.send({"cmd": "release", "rid": "b"})
        events = run(dec, pre, lambda ev: "b" in dec.done and "b" in done_events(ev))
        assert (dec.done["b"]["state"], done_events(events)["b"]["state"]) == ("Success", "Success"), (dec.done["b"], done_events(events)["b"])
    finally:
        dec.close()
        api.shutdown()


def test_kvargs_sglang_shape_and_refusals(bootstrap):
    """KVManager() on SGLang's own KVArgs class, and refusals naming what
    kvxfer cannot move (ValueError, before anything starts)."""
    g = Geometry()
    kv = RankKV(g)
    sa = server_args(bootstrap)
    args = decode_kv_args(kv, 0, 1)
    assert not hasattr(args, "kv_head_num") and not hasattr(args, "prefill_start_layer")
    mgr = backend.KVManager(args, backend.DisaggregationMode.DECODE, sa, False)
    mgr.close()
    cases = [
        ("mla_compression_ratios", [0, 4], "DeepSeek-V4"),
        ("dcp_size", 2, "decode context parallel"),
        ("state_data_ptrs", [[int(kv.kv[0].ctypes.data)], [int(kv.kv[1].ctypes.data)]], "state components"),
    ]
    for field, value, match in cases:
        a = prefill_kv_args(kv, 0, False)
        setattr(a, field, value)
        with pytest.raises(ValueError, match=match):
            backend.KVManager(a, "decode", sa)
    cp = server_args(bootstrap)
    cp.attn_cp_size = 2
    with pytest.raises(ValueError, match="attn_cp_size"):
        backend.KVManager(decode_kv_args(kv, 0, 1), "decode", cp)
    err = backend.KVTransferError(5, "why", True)
    assert (err.bootstrap_room, err.failure_reason, err.is_from_another_rank, str(err)) == (5, "why", True, "KVTransferError(bootstrap_room=5): why")


def test_wrong_model_head_count_fails_both_sides(peers, bootstrap, monkeypatch):
    """A decode told the wrong KV head count (KVXFER_TOTAL_KV_HEAD_NUM) moves
    nothing: both sides fail the room, naming both counts. A count that is
    not a number is refused when the manager is created."""
    g = Geometry()
    kv = RankKV(g)
    monkeypatch.setenv("KVXFER_TOTAL_KV_HEAD_NUM", "x")
    with pytest.raises(ValueError, match="KVXFER_TOTAL_KV_HEAD_NUM"):
        DecodeScheduler(kv, server_args(bootstrap))
    monkeypatch.setenv("KVXFER_TOTAL_KV_HEAD_NUM", str(2 * g.heads))
    pre = peers("sched-prefill", "--bootstrap", bootstrap.addr, env=TIMEOUTS)
    dec = DecodeScheduler(kv, server_args(bootstrap))
    try:
        pre.send(add_cmd(bootstrap, "w", 81, 2 * g.page_size, [1, 2]))
        dec.add(decode_req(bootstrap, "w", 81, 2 * g.page_size, [3, 4], [1, 2]))
        events = run(dec, pre, lambda ev: "w" in dec.done and "w" in done_events(ev))
        p, d = done_events(events)["w"], dec.done["w"]
        assert (p["state"], d["state"]) == ("Failed", "Failed"), (p, d)
        want = f"prefill {g.heads}, decode {2 * g.heads}"
        assert want in d["error"], d
        assert not kv.kv[0][3].any(), "a refused room wrote pages"
    finally:
        dec.close()


PC = "prefill_complete"


def pc_args(bs):
    sa = server_args(bs)
    sa.disaggregation_decode_allocation_policy = PC
    return sa


def timeline_has(room, what):
    """Whether this process's KV manager holding room has a timeline event
    whose detail contains what (kvx_room_timeline)."""
    from kvxfer import _lib

    try:
        tl = json.loads(_lib.get_string("kvx_room_timeline", room))
    except _lib.KvxError:
        return False
    return any(what in (e.get("detail") or "") for e in tl.get("events", []))


def step_until(sched, cond, what, timeout=DEADLINE):
    t0 = time.monotonic()
    while not cond():
        sched.step()
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.005)


def test_prefill_complete_policy(peers, bootstrap):
    """SGLang's decode_allocation_policy "prefill_complete" on both sides:
    the decode scheduler reserves nothing for a request (its receiver stays
    Bootstrapping, no send_metadata) while the prefill has not called
    mark_prefill_complete(); once it does, the request runs as under
    "early" and every byte is verified on the decode. Two requests, one
    held, one not: the one the prefill computed is not held back."""
    g = Geometry()
    pre = peers("sched-prefill", "--bootstrap", bootstrap.addr, "--policy", PC, env=TIMEOUTS)
    dec = DecodeScheduler(RankKV(g), pc_args(bootstrap), with_heads=False)
    try:
        src = {"h": [1, 2, 3], "f": [4, 5]}
        dst = {"h": [10, 11, 12], "f": [13, 14]}
        for rid, room in (("h", 81), ("f", 82)):
            pre.send(add_cmd(bootstrap, rid, room, len(src[rid]) * g.page_size, src[rid], hold_complete=rid == "h"))
            dec.add(decode_req(bootstrap, rid, room, len(src[rid]) * g.page_size, dst[rid], src[rid]))
        events = run(dec, pre, lambda ev: "f" in dec.done and "f" in done_events(ev))
        assert (dec.done["f"]["state"], dec.done["f"]["bad"]) == ("Success", []), dec.done["f"]
        held = [d for d in dec.queue if d.req.rid == "h"]
        assert held and not held[0].waiting_for_input and held[0].kv_receiver.poll() == backend.KVPoll.Bootstrapping
        assert all(d.req.rid != "h" for d in dec.transfer_queue)  # no pages given for it
        assert [e["rid"] for e in events if e.get("event") == "marked"] == ["f"]
        pre.send({"cmd": "release", "rid": "h"})
        events = run(dec, pre, lambda ev: "h" in dec.done and "h" in done_events(ev))
        assert (dec.done["h"]["state"], dec.done["h"]["bad"], done_events(events)["h"]["state"]) == ("Success", [], "Success"), dec.done["h"]
    finally:
        dec.close()


def test_prefill_complete_policy_mismatch(peers, bootstrap):
    """A decode running prefill_complete against a prefill declaring
    "early": the room fails on both sides, naming both policies."""
    g = Geometry()
    pre = peers("sched-prefill", "--bootstrap", bootstrap.addr, env=TIMEOUTS)
    dec = DecodeScheduler(RankKV(g), pc_args(bootstrap))
    try:
        pre.send(add_cmd(bootstrap, "m", 83, 2 * g.page_size, [1, 2]))
        dec.add(decode_req(bootstrap, "m", 83, 2 * g.page_size, [3, 4], [1, 2]))
        events = run(dec, pre, lambda ev: "m" in dec.done and "m" in done_events(ev))
        assert dec.done["m"]["state"] == "Failed" and "policy mismatch" in dec.done["m"]["error"] and '"early"' in dec.done["m"]["error"], dec.done["m"]
        assert done_events(events)["m"]["state"] == "Failed" and "policy mismatch" in done_events(events)["m"]["error"]
    finally:
        dec.close()


@pytest.mark.parametrize("after_mark", [False, True], ids=["before-mark", "after-mark"])
def test_prefill_complete_prefill_killed(peers, bootstrap, after_mark):
    """The prefill process dies (SIGKILL) before it marked the request
    computed (the decode waiting to reserve) or after (its first chunk not
    sent): the decode's room fails within the deadline instead of waiting
    out its waiting timeout, and it never reported Success."""
    g = Geometry()
    pre = peers("sched-prefill", "--bootstrap", bootstrap.addr, "--policy", PC, env=TIMEOUTS)
    dec = DecodeScheduler(RankKV(g), pc_args(bootstrap))
    try:
        src = [1, 2, 3, 4]
        hook = dict(die_after_chunks=0) if after_mark else dict(hold_complete=True)
        pre.send(add_cmd(bootstrap, "k", 84 + after_mark, len(src) * g.page_size, src, **hook))
        dec.add(decode_req(bootstrap, "k", 84 + after_mark, len(src) * g.page_size, [5, 6, 7, 8], src))
        if after_mark:
            run(dec, pre, lambda ev: any(e.get("event") == "dying" for e in ev))
            assert dec.transfer_queue  # it had reserved and sent its pages
        else:
            step_until(dec, lambda: timeline_has(84, "SUBSCRIBE sent"), "the decode did not subscribe")
            assert not dec.transfer_queue and dec.queue[0].kv_receiver.poll() == backend.KVPoll.Bootstrapping
        pre.kill()
        step_until(dec, lambda: "k" in dec.done, "decode did not fail the room of a killed prefill")
        assert dec.done["k"]["state"] == "Failed", dec.done["k"]
    finally:
        dec.close()


def test_prefill_complete_decode_killed_while_waiting(peers, bootstrap):
    """The decode process dies (SIGKILL) while it waits for the prefill to
    compute (it subscribed, reserved nothing): the prefill's room ends
    Failed, not Success, whether or not it was marked computed."""
    g = Geometry()
    dec = peers("sched-decode", "--bootstrap", bootstrap.addr, "--policy", PC, env=TIMEOUTS)
    pre = PrefillScheduler(RankKV(g), pc_args(bootstrap))
    try:
        src = [1, 2]
        tokens = len(src) * g.page_size
        dec.send(add_cmd(bootstrap, "w", 86, tokens, [5, 6], src_pages=src))
        req = prefill_req(bootstrap, "w", 86, tokens, src, hold_complete=True)
        pre.add(req)
        # The decode resolves and subscribes; it reserves nothing meanwhile.
        step_until(pre, lambda: timeline_has(86, "SUBSCRIBE received"), "the decode did not subscribe")
        assert req.sender.poll() == backend.KVPoll.Bootstrapping and dec.try_recv() is None
        dec.kill()
        step_until(pre, lambda: "w" in pre.done, "prefill did not fail the room of a killed decode")
        assert pre.done["w"]["state"] == "Failed" and "86" in pre.done["w"]["error"], pre.done["w"]
    finally:
        pre.close()
