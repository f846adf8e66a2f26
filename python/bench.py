#!/usr/bin/env python3
"""Throughput of the Python path (ctypes -> libkvxfer) beside the Go engine,
measured in the same run.

The Python side is Mooncake's usage: a target process registers a region and
an initiator writes BATCH blocks of SIZE bytes per batch_transfer_sync_write
call into it, by the target's virtual addresses, one call after another
(one batch in flight). The Go side is `kvxfer bench` with the same transport,
block size, batch depth and working set, one batch in flight. The two run in
alternating rounds (go, python, go, python, ...) so that machine load hits
both alike; the reported ratio is the median of the per-round ratios.

    python/bench.py                      # tcp, 1 MiB x 64, 3 rounds
    python/bench.py --transport shm --rounds 5 --json out.json
    python/bench.py --no-go              # the Python figure only

Needs libkvxfer.so (KVXFER_LIBRARY or `make python-lib`) and, for the Go
figure, bin/kvxfer (`make build`). Every byte of the target region is checked
once after the timed rounds (outside the timing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
if not os.environ.get("KVXFER_LIBRARY") and os.path.exists(os.path.join(ROOT, "build", "python", "libkvxfer.so")):
    os.environ["KVXFER_LIBRARY"] = os.path.join(ROOT, "build", "python", "libkvxfer.so")

import kvxfer  # noqa: E402


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def region(engine, transport, nbytes):
    """(address, keep-alive) of nbytes of registered memory: HostBuffer
    memory for shm (shared by fd), a bytearray otherwise."""
    if transport == "shm":
        hb = kvxfer.HostBuffer(nbytes, "bench")
        mem = hb
        addr = hb.addr
    else:
        mem = bytearray(nbytes)
        addr = kvxfer.address_of(mem)[0]
    if engine.register_memory(addr, nbytes) != 0:
        raise SystemExit(f"bench: register_memory: {engine.last_error}")
    return addr, mem


def serve(args):
    e = kvxfer.TransferEngine()
    if e.initialize("127.0.0.1", "P2PHANDSHAKE", args.transport, "") != 0:
        raise SystemExit(f"bench target: {e.last_error}")
    n = args.size * args.batch
    addr, mem = region(e, args.transport, n)
    print(json.dumps({"name": e.segment_name, "addr": addr}), flush=True)
    for line in sys.stdin:
        if line.strip() == "digest":
            print(hashlib.sha256(e.read_bytes_from_buffer(addr, n)).hexdigest(), flush=True)
    e.close()
    del mem


def go_round(args, tmp):
    out = os.path.join(tmp, "go.json")
    cmd = [args.kvxfer, "bench", "--transports", args.transport, "--sizes", str(args.size), "--depths", str(args.batch),
           "--inflight", "1", "--reps", str(args.reps), "--rep-time", f"{args.rep_time}s", "--warmup", "4",
           "--max-region", str(args.size * args.batch), "--no-verify", "--no-memcpy", "--quiet", "--json", out]
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench: {' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    with open(out) as f:
        rep = json.load(f)
    res = rep["results"][0]
    return res["gbps"]["median"], cmd


def py_round(args, e, name, src, dst):
    bufs = [src + i * args.size for i in range(args.batch)]
    peers = [dst + i * args.size for i in range(args.batch)]
    lens = [args.size] * args.batch
    for _ in range(4):  # warm-up
        if e.batch_transfer_sync_write(name, bufs, peers, lens) != 0:
            raise SystemExit(f"bench: batch_transfer_sync_write: {e.last_error}")
    reps = []
    for _ in range(args.reps):
        n = 0
        t0 = time.perf_counter()
        while True:
            rc = e.batch_transfer_sync_write(name, bufs, peers, lens)
            if rc != 0:
                raise SystemExit(f"bench: batch_transfer_sync_write: {rc}: {e.last_error}")
            n += 1
            dt = time.perf_counter() - t0
            if dt >= args.rep_time:
                break
        reps.append(n * args.size * args.batch / dt / 1e9)
    return statistics.median(reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transport", default="tcp", help="tcp or shm (both sides)")
    ap.add_argument("--size", type=parse_size, default=1 << 20, help="bytes per request (default 1M)")
    ap.add_argument("--batch", type=int, default=64, help="requests per batch_transfer_sync_write (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating go/python rounds (default 3)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per round and side (median)")
    ap.add_argument("--rep-time", type=float, default=1.0, help="seconds per repetition (default 1)")
    ap.add_argument("--kvxfer", default=os.path.join(ROOT, "bin", "kvxfer"), help="the kvxfer binary for the Go figure")
    ap.add_argument("--no-go", action="store_true", help="skip the Go figure")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args)

    target = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", "--transport", args.transport,
                               "--size", str(args.size), "--batch", str(args.batch)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(target.stdout.readline())
        e = kvxfer.TransferEngine()
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", args.transport, "") != 0:
            raise SystemExit(f"bench: {e.last_error}")
        n = args.size * args.batch
        src, mem = region(e, args.transport, n)
        view = mem.view() if hasattr(mem, "view") else memoryview(mem)
        pattern = bytes((i * 37 + 11) % 251 for i in range(65536))
        for off in range(0, n, len(pattern)):
            view[off:off + len(pattern)] = pattern[: n - off]
        rounds = []
        with tempfile.TemporaryDirectory() as tmp:
            go_cmd = None
            for r in range(args.rounds):
                go = None
                if not args.no_go:
                    go, go_cmd = go_round(args, tmp)
                py = py_round(args, e, info["name"], src, info["addr"])
                rounds.append({"go_gbps": go, "python_gbps": py, "ratio": py / go if go else None})
                print(f"round {r + 1}: python {py:.2f} GB/s" + (f", go {go:.2f} GB/s, ratio {py / go:.2f}x" if go else ""), flush=True)
        target.stdin.write("digest\n")
        target.stdin.flush()
        remote = target.stdout.readline().strip()
        local = hashlib.sha256(e.read_bytes_from_buffer(src, n)).hexdigest()
        verified = remote == local
        py_med = statistics.median(x["python_gbps"] for x in rounds)
        summary = {
            "transport": args.transport, "block_bytes": args.size, "batch": args.batch, "rounds": rounds,
            "python_gbps": py_med, "verified": verified, "library": kvxfer.library_path(),
            "load_average": os.getloadavg(), "command": " ".join(sys.argv),
        }
        if not args.no_go:
            summary["go_gbps"] = statistics.median(x["go_gbps"] for x in rounds)
            summary["ratio"] = statistics.median(x["ratio"] for x in rounds)
            summary["go_command"] = " ".join(go_cmd)
        line = f"{args.transport} {args.size >> 20} MiB x {args.batch}: python {py_med:.2f} GB/s"
        if not args.no_go:
            line += f", go (kvxfer bench) {summary['go_gbps']:.2f} GB/s, ratio {summary['ratio']:.2f}x (median of per-round ratios)"
        print(line + ("" if verified else "  VERIFY FAILED"))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        e.close()
        return 0 if verified else 1
    finally:
        target.stdin.close()
        target.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
