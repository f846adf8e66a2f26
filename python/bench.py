#!/usr/bin/env python3
"""The Python path (ctypes -> libkvxfer) on the callers' shapes, with the Go
engine beside it, every figure a ratio measured in the same run.

Rows (--rows, default all):

go       Mooncake's usage against `kvxfer bench`: a target process registers
         SIZE x BATCH bytes, the initiator writes BATCH blocks of SIZE bytes
         per batch_transfer_sync_write call (lists of ints, one batch in
         flight); the Go side is `kvxfer bench` with the same transport,
         block, depth and working set. Rounds alternate go, python, ...; the
         ratio is the median of the per-round ratios.
submit   SGLang's per-token-slot batch (below), 262,144 entries for a
         4K-token request: the time to build the three arrays with numpy from
         the page tables and submit them (batch_transfer_async_write returns),
         and the submit alone from prebuilt lists. The transfer is waited
         for outside the timing.
sglang   the same batch's throughput (batch_transfer_sync_write) against the
         same bytes in page-sized entries, in alternating pairs of single
         calls (per-token, page-sized, per-token, ...: --pairs per round, or
         as many as fit in the round's time); the ratio is the median of the
         per-pair ratios, printed with their quartiles and range, this
         process's CPU time per call and the load average at the row's start
         and end. The descriptor counts before and after coalescing come
         from the library's metrics. On shm each pair is followed by this
         host's own copy ceiling: the same two shapes copied bare, with no
         engine, from the same source into HostBuffer memory of this process
         (the kind the target registers), by numpy (one memmove per 1 KiB
         token slot or 64 KiB page: ordinary stores, not shm's non-temporal
         kernel; engine/segengine's BenchmarkSGLangPairs times both) on as
         many threads as shm copies with (min(4, CPUs)); the row reports the
         bare copies' ratio and the median per-pair engine ratio / bare
         ratio ("vs bare": 1 when the engine loses nothing to the per-token
         shape beyond what the copy itself loses here).
threads  vLLM's sender pool: THREADS threads sharing one engine, each writing
         its share of DEPTH blocks of TSIZE bytes per call, against one thread
         writing DEPTH blocks per call (the same total depth), alternating.

The SGLang shape: LAYERS layers x K,V buffers, TOKENS tokens in pages of
PAGE tokens, prefill TP 1 and decode TP 2: each entry is one token's slice of
the heads (SLICE bytes of a 2*SLICE-byte prefill token) into a SLICE-byte
decode token; pages are scattered (random page tables on both sides), so
only the tokens of one page are equally strided. The page-sized baseline
moves the same bytes as one entry per (buffer, page): PAGE*SLICE bytes.

    python/bench.py                                  # all rows, tcp
    python/bench.py --rows go --size 16M --batch 64  # 1 GiB batches
    python/bench.py --rows sglang,threads --transport shm --json out.json

Needs libkvxfer.so (KVXFER_LIBRARY or `make python-lib`), numpy, and for the
go row bin/kvxfer (`make build`). Every row's target bytes are checked once
after its timed rounds (SHA-256 of the target's region against the expected
image, outside the timing). The machine's load average is printed with the
figures: on a shared machine only the same-run ratios mean anything.
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
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
if not os.environ.get("KVXFER_LIBRARY") and os.path.exists(os.path.join(ROOT, "build", "python", "libkvxfer.so")):
    os.environ["KVXFER_LIBRARY"] = os.path.join(ROOT, "build", "python", "libkvxfer.so")

import numpy as np  # noqa: E402

import kvxfer  # noqa: E402
from kvxfer import _lib  # noqa: E402

ROWS = ("go", "submit", "sglang", "threads")


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def region(engine, transport, nbytes):
    """(address, keep-alive, numpy view) of nbytes of registered memory:
    HostBuffer memory for shm (shared by fd), a numpy array otherwise."""
    if transport == "shm":
        hb = kvxfer.HostBuffer(nbytes, "bench")
        mem, addr, view = hb, hb.addr, hb.numpy(np.uint8)[:nbytes]
    else:
        mem = np.zeros(nbytes, dtype=np.uint8)
        addr, view = mem.ctypes.data, mem
    if engine.register_memory(addr, nbytes) != 0:
        raise SystemExit(f"bench: register_memory: {engine.last_error}")
    return addr, mem, view


def serve(args):
    """The target process: one region; answers "digest N" (SHA-256 of its
    first N bytes) and "zero N"."""
    e = kvxfer.TransferEngine()
    if e.initialize("127.0.0.1", "P2PHANDSHAKE", args.transport, "") != 0:
        raise SystemExit(f"bench target: {e.last_error}")
    addr, mem, view = region(e, args.transport, args.region)
    print(json.dumps({"name": e.segment_name, "addr": addr}), flush=True)
    for line in sys.stdin:
        cmd, _, n = line.strip().partition(" ")
        n = int(n or args.region)
        if cmd == "digest":
            print(hashlib.sha256(view[:n].tobytes()).hexdigest(), flush=True)
        elif cmd == "zero":
            view[:n] = 0
            print("ok", flush=True)
    e.close()
    del mem


class Target:
    """The target process and its region."""

    def __init__(self, args, nbytes):
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", "--transport", args.transport,
                                   "--region", str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = json.loads(self.p.stdout.readline())
        self.name, self.addr = info["name"], info["addr"]

    def ask(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


def timed(fn, reps, rep_time, nbytes):
    """Median GB/s over reps repetitions of at least rep_time seconds of fn()
    (which moves nbytes per call)."""
    out = []
    for _ in range(reps):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= rep_time:
                break
        out.append(n * nbytes / dt / 1e9)
    return statistics.median(out)


def fill(view, n, seed):
    """A byte pattern (period 65,521, prime: no block repeats another) over
    the first n bytes, in chunks."""
    pat = ((np.arange(65521, dtype=np.uint32) * 37 + seed) % 251).astype(np.uint8)
    tile = np.tile(pat, (1 << 24) // len(pat) + 2)
    for off in range(0, n, 1 << 24):
        m = min(1 << 24, n - off)
        start = off % len(pat)
        view[off:off + m] = tile[start:start + m]


def check(rc, e, what):
    if rc != 0:
        raise SystemExit(f"bench: {what}: {rc}: {e.last_error}")


def load():
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


# ---------------------------------------------------------------------------
# go: the Python path against `kvxfer bench`
# ---------------------------------------------------------------------------
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
    return rep["results"][0]["gbps"]["median"], cmd


def row_go(args, e, tgt, src, view):
    n = args.size * args.batch
    bufs = [src + i * args.size for i in range(args.batch)]
    peers = [tgt.addr + i * args.size for i in range(args.batch)]
    lens = [args.size] * args.batch
    fill(view, n, 11)
    call = lambda: check(e.batch_transfer_sync_write(tgt.name, bufs, peers, lens), e, "batch_transfer_sync_write")  # noqa: E731
    for _ in range(2):
        call()
    rounds, go_cmd = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            go, go_cmd = go_round(args, tmp)
            py = timed(call, args.reps, args.rep_time, n)
            rounds.append({"go_gbps": go, "python_gbps": py, "ratio": py / go})
            print(f"  go round {r + 1}: python {py:.2f} GB/s, go {go:.2f} GB/s, ratio {py / go:.2f}x (load {load()})", flush=True)
    verified = tgt.ask(f"digest {n}") == hashlib.sha256(view[:n].tobytes()).hexdigest()
    res = {"block_bytes": args.size, "batch": args.batch, "rounds": rounds, "go_command": " ".join(go_cmd),
           "python_gbps": statistics.median(x["python_gbps"] for x in rounds),
           "go_gbps": statistics.median(x["go_gbps"] for x in rounds),
           "ratio": statistics.median(x["ratio"] for x in rounds), "verified": verified}
    print(f"go: {args.transport} {fmt_size(args.size)} x {args.batch} ({fmt_size(n)} per call): python {res['python_gbps']:.2f} GB/s, "
          f"go (kvxfer bench) {res['go_gbps']:.2f} GB/s, ratio {res['ratio']:.2f}x (median of per-round ratios)"
          + ("" if verified else "  VERIFY FAILED"), flush=True)
    return res


# ---------------------------------------------------------------------------
# SGLang's per-token-slot batch
# ---------------------------------------------------------------------------
class Shape:
    """SGLang's hetero-TP shape (see the module doc)."""

    def __init__(self, args):
        self.layers, self.tokens, self.page, self.slice = args.layers, args.tokens, args.page, args.slice
        self.buffers = 2 * self.layers  # K and V
        self.src_tok, self.dst_tok = 2 * self.slice, self.slice
        self.src_buf, self.dst_buf = self.src_tok * self.tokens, self.dst_tok * self.tokens
        self.src_bytes, self.dst_bytes = self.buffers * self.src_buf, self.buffers * self.dst_buf
        rng = np.random.default_rng(27)
        self.src_pages = rng.permutation(self.tokens // self.page)
        self.dst_pages = rng.permutation(self.tokens // self.page)
        self.entries = self.buffers * self.tokens
        self.nbytes = self.entries * self.slice

    def token_arrays(self, src, dst, rank=1):
        """The per-token-slot batch: numpy uint64 (buffers, peers, lengths);
        decode rank `rank` takes the rank-th half of the heads. Built the way
        a caller would from its page tables: token -> slot in each side's
        pages, plus each buffer's base (int64 arithmetic, one array each)."""
        tok = np.arange(self.tokens, dtype=np.int64)
        s_off = (self.src_pages[tok // self.page] * self.page + tok % self.page) * self.src_tok
        d_off = (self.dst_pages[tok // self.page] * self.page + tok % self.page) * self.dst_tok
        buf = np.arange(self.buffers, dtype=np.int64)
        bufs = np.add.outer(buf * self.src_buf + (src + rank * self.slice), s_off).ravel().view(np.uint64)
        peers = np.add.outer(buf * self.dst_buf + dst, d_off).ravel().view(np.uint64)
        return bufs, peers, np.full(self.entries, self.slice, dtype=np.uint64)

    def page_arrays(self, src, dst):
        """The same bytes in page-sized entries (one per buffer and page;
        the source is a contiguous page-sized range of the prefill buffer)."""
        pb = self.page * self.slice
        buf = np.arange(self.buffers, dtype=np.int64)
        bufs = np.add.outer(buf * self.src_buf + src, self.src_pages.astype(np.int64) * pb).ravel().view(np.uint64)
        peers = np.add.outer(buf * self.dst_buf + dst, self.dst_pages.astype(np.int64) * pb).ravel().view(np.uint64)
        return bufs, peers, np.full(len(bufs), pb, dtype=np.uint64)

    def expected(self, view, src, dst, arrays):
        """The target image the arrays write (from the local bytes)."""
        bufs, peers, lens = arrays
        out = np.zeros(self.dst_bytes, dtype=np.uint8)
        n = int(lens[0])
        per = len(bufs) // self.buffers
        ar = np.arange(n, dtype=np.int64)
        for b in range(self.buffers):
            s = (bufs[b * per:(b + 1) * per].astype(np.int64) - src)[:, None] + ar
            d = (peers[b * per:(b + 1) * per].astype(np.int64) - dst)[:, None] + ar
            out[d.ravel()] = view[s.ravel()]
        return out


def descriptors(fn):
    """(requests, descriptors) the library counted for one call of fn."""
    t = kvxfer.metrics_text()
    r0, d0 = _lib.counter(t, "kvxfer_segment_requests_total"), _lib.counter(t, "kvxfer_segment_descriptors_total")
    fn()
    t = kvxfer.metrics_text()
    return int(_lib.counter(t, "kvxfer_segment_requests_total") - r0), int(_lib.counter(t, "kvxfer_segment_descriptors_total") - d0)


def row_submit(args, e, tgt, src, view, shape):
    res = {"entries": shape.entries, "reps": []}
    lists = [a.tolist() for a in shape.token_arrays(src, tgt.addr)]
    for i in range(args.submit_reps + 1):
        t0 = time.perf_counter()
        arrays = shape.token_arrays(src, tgt.addr)
        t1 = time.perf_counter()
        bid = e.batch_transfer_async_write(tgt.name, *arrays)
        t2 = time.perf_counter()
        if bid <= 0:
            raise SystemExit(f"bench: batch_transfer_async_write: {e.last_error}")
        check(e.get_batch_transfer_status([bid]), e, "get_batch_transfer_status")
        t3 = time.perf_counter()
        bid = e.batch_transfer_async_write(tgt.name, *lists)
        t4 = time.perf_counter()
        if bid <= 0:
            raise SystemExit(f"bench: batch_transfer_async_write (lists): {e.last_error}")
        check(e.get_batch_transfer_status([bid]), e, "get_batch_transfer_status")
        if i == 0:
            continue  # warm-up
        res["reps"].append({"prepare_ms": 1e3 * (t1 - t0), "submit_ms": 1e3 * (t2 - t1), "lists_submit_ms": 1e3 * (t4 - t3)})
    med = lambda k: statistics.median(r[k] for r in res["reps"])  # noqa: E731
    res.update(prepare_ms=med("prepare_ms"), submit_ms=med("submit_ms"), lists_submit_ms=med("lists_submit_ms"),
               total_ms=statistics.median(r["prepare_ms"] + r["submit_ms"] for r in res["reps"]))
    res["us_per_entry"] = 1e3 * res["total_ms"] / shape.entries
    print(f"submit: {shape.entries} entries (numpy, built from the page tables): prepare {res['prepare_ms']:.1f} ms + submit "
          f"{res['submit_ms']:.1f} ms = {res['total_ms']:.1f} ms ({res['us_per_entry']:.3f} us/entry, median of {args.submit_reps}); "
          f"from prebuilt lists: submit {res['lists_submit_ms']:.1f} ms (load {load()})", flush=True)
    return res


class BareCopy:
    """The SGLang shapes copied without an engine (see the module doc): from
    the source view into `dst`, a uint8 view of dst_bytes of this process's
    memory, on `threads` threads (numpy releases the GIL while it copies),
    each taking a contiguous share of the pages. tokens() and pages() copy
    what the per-token and the page-sized arrays move and return the
    seconds taken."""

    def __init__(self, shape, view, dst, threads):
        bufs, pages, per = shape.buffers, shape.tokens // shape.page, shape.page
        sv = view[:shape.src_bytes].view(f"V{shape.slice}").reshape(bufs, pages, per, 2)
        dv = dst[:shape.dst_bytes].view(f"V{shape.slice}").reshape(bufs, pages, per)
        pb = shape.page * shape.slice
        spg = view[:shape.src_bytes].view(f"V{pb}").reshape(bufs, shape.src_buf // pb)
        dpg = dst[:shape.dst_bytes].view(f"V{pb}").reshape(bufs, pages)
        sp, dp = shape.src_pages, shape.dst_pages
        # rank 1: the second 1 KiB half of every 2 KiB prefill token.
        self._tok = lambda lo, hi: [dv.__setitem__((slice(None), dp[p]), sv[:, sp[p], :, 1]) for p in range(lo, hi)]
        self._page = lambda lo, hi: [dpg.__setitem__((slice(None), dp[p]), spg[:, sp[p]]) for p in range(lo, hi)]
        self.threads, self.npages = max(1, threads), pages

    def _run(self, fn):
        k = self.threads
        ts = [threading.Thread(target=fn, args=(i * self.npages // k, (i + 1) * self.npages // k)) for i in range(k)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return time.perf_counter() - t0

    def tokens(self):
        return self._run(self._tok)

    def pages(self):
        return self._run(self._page)


def sglang_pairs(w_tok, w_page, nbytes, n, seconds, bare=None):
    """Alternating pairs of calls, one per-token batch then one page-sized
    batch, so both sides of a pair see the same moment's load: n pairs, or
    (n == 0) as many as fit in `seconds`, at least 3. Each pair: both
    sides' GB/s, this process's CPU time per call (time.process_time: the
    initiator only, not the target process) and the ratio per-token /
    page-sized; with bare (a BareCopy) also the bare copies of both shapes
    right after the pair, their ratio ("bare_ratio") and ratio / bare_ratio
    ("vs_bare")."""
    out, t_end = [], time.perf_counter() + seconds
    while (len(out) < n) if n > 0 else (len(out) < 3 or time.perf_counter() < t_end):
        c0, t0 = time.process_time(), time.perf_counter()
        w_tok()
        c1, t1 = time.process_time(), time.perf_counter()
        w_page()
        c2, t2 = time.process_time(), time.perf_counter()
        x = {"tokens_gbps": nbytes / (t1 - t0) / 1e9, "pages_gbps": nbytes / (t2 - t1) / 1e9,
             "ratio": (t2 - t1) / (t1 - t0), "tokens_cpu_ms": 1e3 * (c1 - c0), "pages_cpu_ms": 1e3 * (c2 - c1)}
        if bare is not None:
            bt, bp = bare.tokens(), bare.pages()
            x.update(bare_tokens_gbps=nbytes / bt / 1e9, bare_pages_gbps=nbytes / bp / 1e9, bare_ratio=bp / bt)
            x["vs_bare"] = x["ratio"] / x["bare_ratio"]
        out.append(x)
    return out


def quartiles(xs):
    """(25th percentile, median, 75th percentile) of xs (statistics'
    inclusive method; a single value for all three when len(xs) < 2)."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def fmt_load(la):
    return " ".join(f"{x:.1f}" for x in la)


def row_sglang(args, e, tgt, src, view, shape):
    tok = shape.token_arrays(src, tgt.addr)
    page = shape.page_arrays(src, tgt.addr)
    fill(view, shape.src_bytes, 29)
    w_tok = lambda: check(e.batch_transfer_sync_write(tgt.name, *tok), e, "batch_transfer_sync_write (tokens)")  # noqa: E731
    w_page = lambda: check(e.batch_transfer_sync_write(tgt.name, *page), e, "batch_transfer_sync_write (pages)")  # noqa: E731
    res = {"entries_tokens": len(tok[0]), "entries_pages": len(page[0]), "bytes": shape.nbytes, "rounds": []}
    res["tokens_requests"], res["tokens_descriptors"] = descriptors(w_tok)
    res["pages_requests"], res["pages_descriptors"] = descriptors(w_page)
    bare, bare_mem = None, None
    if args.transport == "shm":
        bare_mem = kvxfer.HostBuffer(shape.dst_bytes, "bench-bare")
        bare = BareCopy(shape, view, bare_mem.numpy(np.uint8), min(4, os.cpu_count() or 1))
        bare.tokens()  # first touch of the fresh pages, untimed
        bare.pages()
        res["bare_threads"] = bare.threads
    res["load_start"] = os.getloadavg()
    pairs = []
    for r in range(args.rounds):
        rnd = sglang_pairs(w_tok, w_page, shape.nbytes, args.pairs, 2 * args.reps * args.rep_time, bare)
        pairs += rnd
        q = quartiles([x["ratio"] for x in rnd])
        rd = {"pairs": len(rnd), "tokens_gbps": statistics.median(x["tokens_gbps"] for x in rnd),
              "pages_gbps": statistics.median(x["pages_gbps"] for x in rnd), "ratio": q[1], "ratio_p25": q[0], "ratio_p75": q[2]}
        extra = ""
        if bare is not None:
            rd.update(bare_ratio=statistics.median(x["bare_ratio"] for x in rnd), vs_bare=statistics.median(x["vs_bare"] for x in rnd))
            extra = f"; bare copy ratio {rd['bare_ratio']:.2f}x, engine / bare {rd['vs_bare']:.2f}"
        res["rounds"].append(rd)
        print(f"  sglang round {r + 1}: {len(rnd)} pairs, per-token {rd['tokens_gbps']:.2f} GB/s, page-sized {rd['pages_gbps']:.2f} GB/s, "
              f"ratio {q[1]:.2f}x (pairs p25 {q[0]:.2f}, p75 {q[2]:.2f}{extra}; load {load()})", flush=True)
    res["load_end"] = os.getloadavg()
    q = quartiles([x["ratio"] for x in pairs])
    res["pairs"] = pairs
    res.update(ratio_p25=q[0], ratio_p75=q[2], ratio_min=min(x["ratio"] for x in pairs), ratio_max=max(x["ratio"] for x in pairs),
               tokens_cpu_ms=statistics.median(x["tokens_cpu_ms"] for x in pairs),
               pages_cpu_ms=statistics.median(x["pages_cpu_ms"] for x in pairs))
    ok = True
    for name, arrays in (("pages", page), ("tokens", tok)):
        tgt.ask(f"zero {shape.dst_bytes}")
        check(e.batch_transfer_sync_write(tgt.name, *arrays), e, f"verify {name}")
        want = hashlib.sha256(shape.expected(view, src, tgt.addr, arrays).tobytes()).hexdigest()
        ok = ok and tgt.ask(f"digest {shape.dst_bytes}") == want
        if bare is not None:  # the bare copy moves the same bytes to the same places
            bv = bare_mem.numpy(np.uint8)[:shape.dst_bytes]
            bv[:] = 0
            bare.tokens() if name == "tokens" else bare.pages()
            ok = ok and hashlib.sha256(bv.tobytes()).hexdigest() == want
    res.update(verified=ok, tokens_gbps=statistics.median(x["tokens_gbps"] for x in pairs),
               pages_gbps=statistics.median(x["pages_gbps"] for x in pairs), ratio=q[1])
    bare_line = ""
    if bare is not None:
        bq, vq = quartiles([x["bare_ratio"] for x in pairs]), quartiles([x["vs_bare"] for x in pairs])
        res.update(bare_ratio=bq[1], bare_ratio_p25=bq[0], bare_ratio_p75=bq[2], vs_bare=vq[1], vs_bare_p25=vq[0], vs_bare_p75=vq[2],
                   bare_tokens_gbps=statistics.median(x["bare_tokens_gbps"] for x in pairs),
                   bare_pages_gbps=statistics.median(x["bare_pages_gbps"] for x in pairs))
        bare_line = (f"; bare copy (numpy, {bare.threads} threads, no engine) {res['bare_tokens_gbps']:.2f} vs {res['bare_pages_gbps']:.2f} GB/s, "
                     f"ratio {bq[1]:.2f}x (p25 {bq[0]:.2f}, p75 {bq[2]:.2f}); engine ratio / bare ratio {vq[1]:.2f} (median per pair; "
                     f"p25 {vq[0]:.2f}, p75 {vq[2]:.2f})")
        bare = None  # its views of bare_mem go before the memory does
        bare_mem.close()
    print(f"sglang: {shape.layers} layers x K,V, {shape.tokens} tokens, pages of {shape.page}, {shape.slice} B per token slot "
          f"({fmt_size(shape.nbytes)} per call): per-token entries {res['tokens_requests']} -> {res['tokens_descriptors']} descriptors "
          f"{res['tokens_gbps']:.2f} GB/s; page-sized entries {res['pages_requests']} -> {res['pages_descriptors']} descriptors "
          f"{res['pages_gbps']:.2f} GB/s; ratio {res['ratio']:.2f}x (median of {len(pairs)} per-pair ratios; p25 {q[0]:.2f}, p75 {q[2]:.2f}, "
          f"range {res['ratio_min']:.2f}..{res['ratio_max']:.2f}); this process's CPU per call {res['tokens_cpu_ms']:.0f} vs "
          f"{res['pages_cpu_ms']:.0f} ms{bare_line}; load {fmt_load(res['load_start'])} at the start, {fmt_load(res['load_end'])} at the end"
          + ("" if ok else "  VERIFY FAILED"), flush=True)
    return res


# ---------------------------------------------------------------------------
# threads: one engine shared by a sender pool
# ---------------------------------------------------------------------------
def row_threads(args, e, tgt, src, view):
    depth, size, k = args.thread_depth, args.thread_size, args.threads
    if depth % k:
        raise SystemExit(f"bench: --thread-depth {depth} is not a multiple of --threads {k}")
    total = depth * size
    view[:total] = 3
    bufs = np.uint64(src) + np.arange(depth, dtype=np.uint64) * np.uint64(size)
    peers = np.uint64(tgt.addr) + np.arange(depth, dtype=np.uint64)[::-1].copy() * np.uint64(size)  # reversed: no merging
    lens = np.full(depth, size, dtype=np.uint64)
    per = depth // k
    shares = [(bufs[i * per:(i + 1) * per], peers[i * per:(i + 1) * per], lens[i * per:(i + 1) * per]) for i in range(k)]

    def one():
        check(e.batch_transfer_sync_write(tgt.name, bufs, peers, lens), e, "batch_transfer_sync_write")

    def pool(seconds):
        """k threads, each calling with its share until seconds passed;
        aggregate GB/s."""
        counts = [0] * k
        errors = []
        start = threading.Barrier(k + 1)
        stop = time.perf_counter() + 3600

        def worker(i):
            start.wait()
            while time.perf_counter() < stop:
                rc = e.batch_transfer_sync_write(tgt.name, *shares[i])
                if rc != 0:
                    errors.append(f"{rc}: {e.last_error}")
                    return
                counts[i] += 1

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(k)]
        for t in ts:
            t.start()
        t0 = time.perf_counter()
        stop = t0 + seconds
        start.wait()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
        if errors:
            raise SystemExit(f"bench: thread pool: {errors[0]}")
        return sum(counts) * per * size / dt / 1e9

    one()
    pool(0.2)
    res = {"threads": k, "depth": depth, "block_bytes": size, "rounds": []}
    for r in range(args.rounds):
        s = timed(one, args.reps, args.rep_time, total)
        m = statistics.median(pool(args.rep_time) for _ in range(args.reps))
        res["rounds"].append({"one_gbps": s, "pool_gbps": m, "ratio": m / s})
        print(f"  threads round {r + 1}: {k} threads {m:.2f} GB/s, one thread {s:.2f} GB/s, ratio {m / s:.2f}x (load {load()})", flush=True)
    res.update(one_gbps=statistics.median(x["one_gbps"] for x in res["rounds"]),
               pool_gbps=statistics.median(x["pool_gbps"] for x in res["rounds"]),
               ratio=statistics.median(x["ratio"] for x in res["rounds"]))
    want = np.zeros(total, dtype=np.uint8)
    want[:] = 3
    res["verified"] = tgt.ask(f"digest {total}") == hashlib.sha256(want.tobytes()).hexdigest()
    print(f"threads: {k} threads x {per} blocks of {fmt_size(size)} per call vs one thread x {depth} (same total depth, "
          f"{fmt_size(total)}): {res['pool_gbps']:.2f} vs {res['one_gbps']:.2f} GB/s, ratio {res['ratio']:.2f}x"
          + ("" if res["verified"] else "  VERIFY FAILED"), flush=True)
    return res


def fmt_size(n):
    for unit, s in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {s}"
    return f"{n} B"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"rows to run, comma-separated ({','.join(ROWS)})")
    ap.add_argument("--transport", default="tcp", help="tcp or shm (both sides)")
    ap.add_argument("--size", type=parse_size, default=1 << 20, help="go row: bytes per request (default 1M)")
    ap.add_argument("--batch", type=int, default=64, help="go row: requests per call (default 64)")
    ap.add_argument("--layers", type=int, default=32, help="sglang rows: model layers (K and V buffers each; default 32)")
    ap.add_argument("--tokens", type=int, default=4096, help="sglang rows: tokens of the request (default 4096)")
    ap.add_argument("--page", type=int, default=64, help="sglang rows: tokens per page (default 64)")
    ap.add_argument("--slice", type=parse_size, default=1024, help="sglang rows: bytes per token slot and buffer on the decode (default 1K: "
                    "8 KV heads x 128 x fp16 at prefill TP 1, half of them per decode rank at TP 2)")
    ap.add_argument("--pairs", type=int, default=0, help="sglang row: alternating (per-token, page-sized) call pairs per round (default 0: as many "
                    "as fit in 2 x REPS x REP_TIME seconds, at least 3); the ratio is the median of all per-pair ratios")
    ap.add_argument("--threads", type=int, default=10, help="threads row: threads sharing the engine (default 10)")
    ap.add_argument("--thread-depth", type=int, default=160, help="threads row: blocks per call over all threads (default 160)")
    ap.add_argument("--thread-size", type=parse_size, default=256 << 10, help="threads row: bytes per block (default 256K)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per row (default 3)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per round and side (median)")
    ap.add_argument("--rep-time", type=float, default=1.0, help="seconds per repetition (default 1)")
    ap.add_argument("--submit-reps", type=int, default=5, help="submit row: timed submits (median; default 5)")
    ap.add_argument("--kvxfer", default=os.path.join(ROOT, "bin", "kvxfer"), help="the kvxfer binary for the go row")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--region", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for r in rows:
        if r not in ROWS:
            raise SystemExit(f"bench: unknown row {r!r}; want some of {','.join(ROWS)}")
    if args.pairs < 0:
        raise SystemExit(f"bench: --pairs must be >= 0 (0: as many as fit in the round's time), got {args.pairs}")
    shape = Shape(args)
    need_dst, need_src = 1, 1
    if "go" in rows:
        need_dst = need_src = args.size * args.batch
    if "submit" in rows or "sglang" in rows:
        need_dst, need_src = max(need_dst, shape.dst_bytes), max(need_src, shape.src_bytes)
    if "threads" in rows:
        need_dst = need_src = max(need_dst, need_src, args.thread_depth * args.thread_size)
    print(f"python/bench.py: transport {args.transport}, rows {','.join(rows)}, load average {load()} at start", flush=True)
    tgt = Target(args, need_dst)
    summary = {"transport": args.transport, "command": " ".join(sys.argv), "library": kvxfer.library_path(),
               "load_average_start": os.getloadavg()}
    e = kvxfer.TransferEngine()
    try:
        check(e.initialize("127.0.0.1", "P2PHANDSHAKE", args.transport, ""), e, "initialize")
        src, mem, view = region(e, args.transport, need_src)
        for r in rows:
            if r == "go":
                summary["go"] = row_go(args, e, tgt, src, view)
            elif r == "submit":
                summary["submit"] = row_submit(args, e, tgt, src, view, shape)
            elif r == "sglang":
                summary["sglang"] = row_sglang(args, e, tgt, src, view, shape)
            elif r == "threads":
                summary["threads"] = row_threads(args, e, tgt, src, view)
        summary["load_average_end"] = os.getloadavg()
        print(f"load average at the end {load()}: the machine is shared, so single figures swing; compare the same-run ratios", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        e.close()
        return 0 if all(summary[r].get("verified", True) for r in rows) else 1
    finally:
        tgt.close()


if __name__ == "__main__":
    sys.exit(main())
