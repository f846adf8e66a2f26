"""A peer process for the tests: one JSON object per line on stdin (a command),
one per line on stdout (its result). The first stdout line is
{"event": "ready", ...}.

    peer.py mooncake --protocol tcp|shm [--name H] [--metadata M] [--target] [--caller sglang|lmcache|vllm]
    peer.py prefill --bootstrap HOST:PORT --tp-size N --tp-rank R [--mla] [--host-buffers]
    peer.py decode --bootstrap HOST:PORT [--mla] [--host-buffers]
    peer.py sched-prefill --bootstrap HOST:PORT [--tp-size N --tp-rank R] [--mla] [--http-port P] [--policy POLICY]
    peer.py sched-decode --bootstrap HOST:PORT [--mla] [--with-heads] [--policy POLICY]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import kvxfer  # noqa: E402
from kvpattern import Geometry, RankKV  # noqa: E402

REGION = 1 << 20


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def commands():
    for line in sys.stdin:
        line = line.strip()
        if line:
            yield json.loads(line)


def mooncake(args):
    """A Mooncake TransferEngine peer. Default: P2P, two 1 MiB regions
    registered (a bytearray and a numpy array; managed and HostBuffer memory on
    shm). --target: set up as Mooncake's transfer_engine_target.py does
    (initialize(--name, --metadata, --protocol), get_first_buffer_address of
    its own name, a managed buffer of --capacity when that is 0). --caller:
    initialize and register as that caller's Mooncake backend does (sglang:
    protocol "rdma" with MC_FORCE_TCP from the environment, batch_register_memory;
    lmcache: hostname from MC_LOCAL_HOSTNAME or "localhost", register_memory;
    vllm: batch_register_memory of KV tensors)."""
    from mooncake.engine import TransferEngine  # the shim: what callers import

    e = TransferEngine()
    keep = []
    if args.caller:
        hostname = args.name
        proto = {"sglang": "rdma", "lmcache": args.protocol, "vllm": args.protocol}[args.caller]
        if args.caller == "lmcache":
            hostname = os.environ.get("MC_LOCAL_HOSTNAME", "localhost")
        rc = e.initialize(hostname, args.metadata, proto, "")
        if rc != 0:
            out({"event": "error", "rc": rc, "error": e.last_error})
            return 1
        session = f"{hostname}:{e.get_rpc_port()}"
        if args.protocol == "shm":
            bufs = [kvxfer.HostBuffer(REGION) for _ in range(2)]
            keep += bufs
            ptrs, lens = [b.addr for b in bufs], [b.nbytes for b in bufs]
        else:
            arrs = [np.zeros(REGION, dtype=np.uint8) for _ in range(2)]
            keep += arrs
            ptrs, lens = [a.ctypes.data for a in arrs], [a.nbytes for a in arrs]
        if args.caller == "lmcache":
            assert e.register_memory(ptrs[0], lens[0]) == 0, e.last_error
            assert e.register_memory(ptrs[1], lens[1]) == 0, e.last_error
        else:
            assert e.batch_register_memory(ptrs, lens) == 0, e.last_error
        regions = {"a": ptrs[0], "b": ptrs[1]}
        name = session
    elif args.target:
        rc = e.initialize(args.name, args.metadata, args.protocol, "")
        if rc != 0:
            out({"event": "error", "rc": rc, "error": e.last_error})
            return 1
        name = args.name if args.metadata != "P2PHANDSHAKE" else e.segment_name
        if args.protocol == "cma":
            # cma: the target's buffer is its own memory (a numpy array),
            # registered before Mooncake's target looks for a first buffer.
            arr = np.zeros(args.capacity, dtype=np.uint8)
            keep.append(arr)
            assert e.register_memory(arr.ctypes.data, arr.nbytes) == 0, e.last_error
        buf = e.get_first_buffer_address(name)
        if buf == 0:
            buf = e.allocate_managed_buffer(args.capacity)
            assert buf != 0, e.last_error
        regions = {"a": buf}
    else:
        rc = e.initialize(args.name, args.metadata, args.protocol, "")
        if rc != 0:
            out({"event": "error", "rc": rc, "error": e.last_error})
            return 1
        name = e.segment_name
        if args.protocol == "shm":
            a = e.allocate_managed_buffer(REGION)
            hb = kvxfer.HostBuffer(REGION)
            keep.append(hb)
            assert e.register_memory(hb.addr, hb.nbytes) == 0, e.last_error
            regions = {"a": a, "b": hb.addr}
        else:
            ba = bytearray(REGION)
            arr = np.zeros(REGION, dtype=np.uint8)
            keep += [ba, arr]
            assert e.register_memory(ba) == 0, e.last_error  # a buffer object (kvxfer extension)
            assert e.register_memory(arr.ctypes.data, arr.nbytes) == 0, e.last_error  # an address, as Mooncake
            regions = {"a": kvxfer.address_of(ba)[0], "b": int(arr.ctypes.data)}
    out({"event": "ready", "name": name, "rpc_port": e.get_rpc_port(), "regions": regions, "size": REGION,
         "transport": e.transport, "pid": os.getpid()})
    for c in commands():
        cmd = c["cmd"]
        if cmd == "read":
            out({"hex": e.read_bytes_from_buffer(c["addr"], c["len"]).hex()})
        elif cmd == "write":
            data = bytes.fromhex(c["hex"])
            out({"rc": e.write_bytes_to_buffer(c["addr"], data, len(data))})
        elif cmd == "register":
            hb = kvxfer.HostBuffer(c["len"])
            keep.append(hb)
            out({"rc": e.register_memory(hb.addr, hb.nbytes), "addr": hb.addr})
        elif cmd == "unregister":
            out({"rc": e.unregister_memory(c["addr"])})
        elif cmd == "exit":
            break
    e.close()
    return 0


def server_args(bootstrap, tp_size, args=None):
    host, _, port = bootstrap.rpartition(":")
    sa = types.SimpleNamespace(host=host, disaggregation_bootstrap_port=int(port), tp_size=tp_size, dp_size=1,
                               pp_size=1, enable_dp_attention=False, kv_cache_dtype="auto", dist_init_addr=None)
    if args is not None and getattr(args, "http_port", None):
        sa.port = args.http_port  # SGLang's --port: registered as prefill_http_port
    if args is not None and getattr(args, "policy", None):
        sa.disaggregation_decode_allocation_policy = args.policy
    return sa


def prefill(args):
    from kvxfer.sglang import DisaggregationMode, KVManager, KVPoll, KVSender

    g = Geometry(mla=args.mla)
    kv = RankKV(g, tp=args.tp_size, rank=args.tp_rank, host_buffers=args.host_buffers)
    mgr = KVManager(kv.kv_args(), DisaggregationMode.PREFILL, server_args(args.bootstrap, args.tp_size), is_mla_backend=args.mla)
    out({"event": "ready", "transport": mgr.transport, "pid": os.getpid()})
    held = {}
    for c in commands():
        cmd = c["cmd"]
        if cmd == "exit":
            break
        room = c["room"]
        if cmd == "create":  # a sender that is kept (duplicate-room test)
            s = KVSender(mgr, args.bootstrap, room, [0], 0)
            held.setdefault(room, []).append(s)
            res = {"room": room, "state": s.poll()}
            if s.poll() == KVPoll.Failed:
                res["error"] = s.failure_reason()[1]
            out(res)
            continue
        if cmd == "send_layers":
            out(_send_layers(mgr, args, g, kv, c))
            continue
        # cmd == "send": the request's source pages, in chunks.
        kv.fill(room)
        s = KVSender(mgr, args.bootstrap, room, [0], 0)
        st = s.wait(KVPoll.WaitingForInput, 60)
        res = {"room": room}
        if st == KVPoll.WaitingForInput:
            prefix = s.pop_decode_prefix_len()
            res["prefix"] = prefix
            pages = c["src_pages"][prefix // g.page_size:]
            aux = c.get("aux_row")
            if aux is not None:
                kv.fill_aux(aux, room)
            if c.get("abort_when_waiting"):
                s.abort()
            s.init(len(pages), aux)
            chunks = max(1, c.get("chunks", 1))
            step = max(1, -(-len(pages) // chunks))
            parts = [pages[i:i + step] for i in range(0, len(pages), step)] or [[]]
            for k, part in enumerate(parts):
                if c.get("die_after_chunks") == k:
                    out({"event": "dying", "room": room, "chunks_sent": k})
                    time.sleep(600)
                if c.get("pause_after_chunks") == k:
                    # The test stops this process (SIGSTOP) here, lets it go
                    # on (SIGCONT) and then says "continue".
                    out({"event": "paused", "room": room, "chunks_sent": k})
                    sys.stdin.readline()
                if s.should_send_kv_chunk(len(part), k == len(parts) - 1):
                    s.send(np.asarray(part, dtype=np.int32))
            st = s.wait(KVPoll.Success, 60)
        res["state"] = st
        if st == KVPoll.Failed:
            try:
                s.failure_exception()
            except Exception as e:  # KVTransferError
                res["error"] = str(e)
        m = s.get_transfer_metric()
        res["bytes"] = m.transfer_total_bytes
        out(res)
        s.clear()
    mgr.close()
    return 0


def _send_layers(mgr, args, g, kv, c):
    """A room sent layer by layer: "chunks" chunks of the pages after the
    decode's prefix, each sent layer by layer ("order": "chunk" = every
    layer of a chunk before the next chunk, "layer" = every chunk of a layer
    before the next layer), with send_layers or, with "hooks", the
    vLLM-shaped begin_layers / save_kv_layer(layer name) / wait_for_save.
    "abort_after_calls": k aborts after k calls (a forward pass failing
    between layers); "stall_after_calls": k stops sending and only waits."""
    from kvxfer.sglang import KVPoll, KVSender, LayerwiseSaver

    room = c["room"]
    kv.fill(room)
    s = KVSender(mgr, args.bootstrap, room, [0], 0)
    res = {"room": room, "state": s.wait(KVPoll.WaitingForInput, 60)}
    if res["state"] == KVPoll.WaitingForInput:
        prefix = s.pop_decode_prefix_len()
        pages = c["src_pages"][prefix // g.page_size:]
        aux = c.get("aux_row")
        if aux is not None:
            kv.fill_aux(aux, room)
        s.init(len(pages), aux)
        step = max(1, -(-len(pages) // max(1, c.get("chunks", 1))))
        chunks = [pages[i:i + step] for i in range(0, len(pages), step)] or [[]]
        calls = [(ch, layer) for ch in chunks for layer in range(g.layers)]
        if c.get("order") == "layer":
            calls = [(ch, layer) for layer in range(g.layers) for ch in chunks]
        saver = LayerwiseSaver()
        for k, (ch, layer) in enumerate(calls):
            if c.get("abort_after_calls") == k:
                s.wait_for_save(30)
                s.abort()
                break
            if c.get("stall_after_calls") == k:
                break
            if c.get("die_after_calls") == k:  # the test SIGKILLs this process now
                s.wait_for_save(30)
                out({"event": "dying", "room": room, "calls": k})
                time.sleep(600)
            if c.get("bad_event") and k == 1:
                s.send_layers(np.asarray(ch, dtype=np.int32), layer, cuda_event=0xDEAD)
                break
            arr = np.asarray(ch, dtype=np.int32)
            if c.get("hooks"):
                if layer == 0 or c.get("order") == "layer":
                    saver.add(s, arr)
                saver.save_kv_layer(f"model.layers.{layer}.self_attn.attn")
                if layer == g.layers - 1 or c.get("order") == "layer":
                    res.setdefault("saved", []).append(saver.wait_for_save(30))
            else:
                s.send_layers(arr, layer)
        res["state"] = s.wait(KVPoll.Success, 60)
    if res["state"] == KVPoll.Failed:
        res["error"] = s.failure_reason()[1]
    s.clear()
    return res


def decode(args):
    from kvxfer.sglang import DisaggregationMode, KVManager, KVPoll, KVReceiver

    g = Geometry(mla=args.mla)
    kv = RankKV(g, tp=1, rank=0, host_buffers=args.host_buffers)
    mgr = KVManager(kv.kv_args(), DisaggregationMode.DECODE, server_args(args.bootstrap, 1), is_mla_backend=args.mla)
    out({"event": "ready", "transport": mgr.transport, "pid": os.getpid()})
    for c in commands():
        if c["cmd"] == "exit":
            break
        room = c["room"]
        r = KVReceiver(mgr, args.bootstrap, room)
        r.init(0)
        st = r.wait(KVPoll.WaitingForInput, 60)
        if st == KVPoll.WaitingForInput:
            r.send_metadata(np.asarray(c["dst_pages"], dtype=np.int32), c.get("aux_row"))
            if c.get("die_after_metadata"):
                out({"event": "dying", "room": room})
                time.sleep(600)
            st = r.wait(KVPoll.Success, 60)
        res = {"room": room, "state": st}
        if st == KVPoll.Failed:
            res["error"] = r.failure_reason()[1]
        out(res)
        r.clear()
    mgr.close()
    return 0


def _scheduler_loop(sched, make_req):
    """Drive a tests/sglang_sched.py scheduler: commands arrive on stdin
    (read on a thread, so the loop never blocks), each step is one SGLang
    scheduler cycle, and every finished request is reported as
    {"event": "done", "rid", ...result}."""
    import queue
    import threading

    cmds: queue.Queue = queue.Queue()

    def read():
        for c in commands():
            cmds.put(c)
        cmds.put({"cmd": "exit"})

    threading.Thread(target=read, daemon=True).start()
    reqs = {}
    while True:
        try:
            while True:
                c = cmds.get_nowait()
                if c["cmd"] == "exit":
                    sched.close()
                    return 0
                if c["cmd"] == "add":
                    r = make_req(c)
                    reqs[r.rid] = r
                    sched.add(r)
                elif c["cmd"] == "abort":
                    sched.abort(c["rid"])
                elif c["cmd"] == "release":
                    reqs[c["rid"]].hooks["released"] = True
        except queue.Empty:
            pass
        sched.step()
        for rid in list(sched.done):
            out({"event": "done", "rid": rid, **sched.done.pop(rid)})
        time.sleep(0.002)


def _sched_req(c):
    from sglang_sched import Req

    host, _, port = c["bootstrap"].rpartition(":")
    hooks = {k: c[k] for k in ("hold", "hold_complete", "die_after_chunks", "die_after_metadata", "abort_after_chunks") if k in c}
    return Req(c["rid"], c["room"], host, int(port), c["tokens"], c["pages"], c.get("prefix_tokens", 0),
               c.get("prefix_pages", ()), c.get("src_pages"), c.get("chunks", 1), **hooks)


def _die(event, req, **kw):
    """Scheduler hook: stop here (the test SIGKILLs this process); report
    when a request was marked computed (prefill_complete)."""
    if event == "marked":
        out({"event": "marked", "rid": req.rid})
    if event == "chunk" and req.hooks.get("die_after_chunks") == kw.get("k"):
        out({"event": "dying", "rid": req.rid, "chunks_sent": kw["k"]})
        time.sleep(600)
    if event == "metadata" and req.hooks.get("die_after_metadata"):
        out({"event": "dying", "rid": req.rid})
        time.sleep(600)


def sched_prefill(args):
    from sglang_sched import PrefillScheduler

    g = Geometry(mla=args.mla)
    kv = RankKV(g, tp=args.tp_size, rank=args.tp_rank)
    sched = PrefillScheduler(kv, server_args(args.bootstrap, args.tp_size, args), args.tp_rank, args.mla, hook=_die)
    out({"event": "ready", "transport": sched.kv_manager.transport, "pid": os.getpid()})
    return _scheduler_loop(sched, _sched_req)


def sched_decode(args):
    from sglang_sched import DecodeScheduler

    g = Geometry(mla=args.mla)
    kv = RankKV(g)
    sched = DecodeScheduler(kv, server_args(args.bootstrap, 1, args), 0, args.mla, with_heads=args.with_heads, hook=_die)
    out({"event": "ready", "transport": sched.kv_manager.transport, "pid": os.getpid()})
    return _scheduler_loop(sched, _sched_req)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="role", required=True)
    m = sub.add_parser("mooncake")
    m.add_argument("--protocol", default="tcp")
    m.add_argument("--name", default="127.0.0.1", help="local_hostname")
    m.add_argument("--metadata", default="P2PHANDSHAKE")
    m.add_argument("--target", action="store_true", help="set up as Mooncake's transfer_engine_target.py")
    m.add_argument("--capacity", type=int, default=8 << 20)
    m.add_argument("--caller", choices=["sglang", "lmcache", "vllm"])
    for name in ("prefill", "decode", "sched-prefill", "sched-decode"):
        p = sub.add_parser(name)
        p.add_argument("--bootstrap", required=True)
        p.add_argument("--tp-size", type=int, default=1)
        p.add_argument("--tp-rank", type=int, default=0)
        p.add_argument("--mla", action="store_true")
        p.add_argument("--host-buffers", action="store_true")
        p.add_argument("--with-heads", action="store_true")
        p.add_argument("--http-port", type=int, default=0, help="server_args.port (the prefill's HTTP API port)")
        p.add_argument("--policy", default=None, help="server_args.disaggregation_decode_allocation_policy")
    args = ap.parse_args()
    roles = {"mooncake": mooncake, "prefill": prefill, "decode": decode, "sched-prefill": sched_prefill, "sched-decode": sched_decode}
    return roles[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
