"""Batch calls take their per-entry arguments as arrays handed to C in place
(kvx_batch_submit_soa): numpy arrays of any integer dtype, buffers of 64-bit
integers (array.array, memoryview, bytes), lists of ints and numpy integer
scalars. Every form moves the same bytes; bad input is refused naming what
and where, and nothing is written then."""

from __future__ import annotations

import array

import numpy as np
import pytest

import kvxfer
from kvxfer import _lib
from kvxfer._memory import u64_array
from conftest import peer_bytes

MiB = 1 << 20
BLOCK = 256
N = 64


def _forms(bufs, dsts, lens):
    """The same batch in each accepted form."""
    u = lambda v: np.asarray(v, dtype=np.uint64)  # noqa: E731
    return {
        "list": (list(bufs), list(dsts), list(lens)),
        "tuple-of-np-scalars": (tuple(np.uint64(x) for x in bufs), tuple(np.int64(x) for x in dsts), tuple(np.uint32(x) for x in lens)),
        "numpy-uint64": (u(bufs), u(dsts), u(lens)),
        "numpy-int64": (u(bufs).astype(np.int64), u(dsts).astype(np.int64), u(lens).astype(np.int32)),
        "numpy-strided-view": (np.repeat(u(bufs), 2)[::2], np.repeat(u(dsts), 2)[::2], np.repeat(u(lens), 2)[::2]),
        "array.array": (array.array("Q", bufs), array.array("Q", dsts), array.array("Q", lens)),
        "memoryview-bytes": (memoryview(u(bufs).tobytes()), u(dsts).tobytes(), bytearray(u(lens).tobytes())),
    }


@pytest.mark.parametrize("form", list(_forms([1], [1], [1])))
def test_every_form_writes_the_same_bytes(peers, local, form):
    target = peers("mooncake", "--protocol", "tcp")
    name, regions = target.ready["name"], target.ready["regions"]
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, N * BLOCK * 2, dtype=np.uint8)
    assert local.register_memory(src.ctypes.data, src.nbytes) == 0, local.last_error
    base = src.ctypes.data
    # Scattered sources and destinations, reversed order, one run adjacent
    # on both sides (entries 0..3): what the engine may merge and must not
    # confuse.
    order = list(range(N))[::-1]
    bufs = [base + 2 * BLOCK * i for i in order]
    dsts = [regions["a"] + BLOCK * i for i in range(N)]
    bufs[:4] = [base + BLOCK * k for k in range(4)]
    lens = [BLOCK] * N
    b, d, n = _forms(bufs, dsts, lens)[form]
    assert local.batch_transfer_sync_write(name, b, d, n) == 0, local.last_error
    got = peer_bytes(target, regions["a"], N * BLOCK)
    want = b"".join(src[x - base:x - base + BLOCK].tobytes() for x in bufs)
    assert got == want
    # The async path and the read path take the same arrays.
    bid = local.batch_transfer_async_write(name, b, d, n)
    assert bid > 0, local.last_error
    assert local.get_batch_transfer_status([bid]) == 0
    back = np.zeros(N * BLOCK, dtype=np.uint8)
    assert local.register_memory(back.ctypes.data, back.nbytes) == 0, local.last_error
    rb = [back.ctypes.data + BLOCK * i for i in range(N)]
    assert local.batch_transfer_sync_read(name, rb, dsts, lens) == 0, local.last_error
    assert back.tobytes() == want


@pytest.mark.parametrize(
    "bufs, dsts, lens, code, words",
    [
        ("ok", "ok", np.array([16, 0], dtype=np.uint64), _lib.ERR_INVALID_ARGUMENT, ["1", "length is 0"]),
        ("ok", "ok", np.array([16, -4], dtype=np.int64), _lib.ERR_INVALID_ARGUMENT, ["lengths[1]", "-4 is negative"]),
        ("ok", "ok", [16, 1.5], _lib.ERR_INVALID_ARGUMENT, ["lengths[1]", "float"]),
        ("ok", "ok", np.array([16.0, 16.0]), _lib.ERR_INVALID_ARGUMENT, ["lengths", "float64"]),
        ("ok", "ok", np.zeros((2, 1), dtype=np.uint64), _lib.ERR_INVALID_ARGUMENT, ["2-D"]),
        ("ok", "ok", [16], _lib.ERR_INVALID_ARGUMENT, ["different sizes"]),
        ("ok", "ok", "16", _lib.ERR_INVALID_ARGUMENT, ["lengths", "str"]),
        ("ok", "ok", memoryview(b"\x10\x00\x00\x00" * 2).cast("I"), _lib.ERR_INVALID_ARGUMENT, ["format 'I'"]),
        ("unreg", "ok", [16, 16], _lib.ERR_NOT_REGISTERED, ["write 1", "not inside memory registered"]),
        ("ok", "outside", [16, 16], _lib.ERR_OUT_OF_BOUNDS, ["write 1", "not inside any region the peer registered"]),
        ([], [], [], _lib.ERR_INVALID_ARGUMENT, ["no requests"]),
    ],
)
def test_bad_arrays_are_refused(peers, local, bufs, dsts, lens, code, words):
    target = peers("mooncake", "--protocol", "tcp")
    name, regions = target.ready["name"], target.ready["regions"]
    src = np.full(64, 7, dtype=np.uint8)
    assert local.register_memory(src.ctypes.data, src.nbytes) == 0
    good_b = np.array([src.ctypes.data, src.ctypes.data + 16], dtype=np.uint64)
    good_d = np.array([regions["a"], regions["a"] + 16], dtype=np.uint64)
    b = {"ok": good_b, "unreg": np.array([src.ctypes.data, 0x1000], dtype=np.uint64)}.get(bufs, bufs) if isinstance(bufs, str) else bufs
    d = {"ok": good_d, "outside": np.array([regions["a"], 0x10], dtype=np.uint64)}.get(dsts, dsts) if isinstance(dsts, str) else dsts
    assert local.batch_transfer_sync_write(name, b, d, lens) == -code, local.last_error
    for w in words:
        assert w in local.last_error, local.last_error
    # Nothing was written.
    assert peer_bytes(target, regions["a"], 32) == bytes(32)


def test_u64_array_is_in_place_for_uint64():
    a = np.arange(10, dtype=np.uint64)
    u = u64_array(a, "x")
    assert u.ptr == a.ctypes.data and u.n == 10 and u.sum() == 45
    v = u64_array([1, 2, np.uint64(3)], "x")
    assert v.n == 3 and v.sum() == 6
    with pytest.raises(ValueError, match=r"x\[1\]"):
        u64_array([1, -2], "x")
    with pytest.raises(TypeError, match="bool"):
        u64_array(np.array([True]), "x")
    w = u64_array(array.array("Q", [5, 6]), "x")
    assert w.n == 2 and w.sum() == 11
    assert u64_array(np.array([], dtype=np.uint64), "x").n == 0


def test_buffer_objects_as_addresses_still_work(peers, local):
    """kvxfer's extension: an element of buffers may be a buffer object."""
    target = peers("mooncake", "--protocol", "tcp")
    name, regions = target.ready["name"], target.ready["regions"]
    src = bytearray(b"kvxfer-buffer-element!" * 10)
    assert local.register_memory(src) == 0, local.last_error
    assert local.batch_transfer_sync_write(name, [src], [regions["b"]], [len(src)]) == 0, local.last_error
    assert peer_bytes(target, regions["b"], len(src)) == bytes(src)
    assert kvxfer.address_of(src)[1] == len(src)


def test_coalescing_counts_in_metrics(peers, local):
    """SGLang's per-token-slot shape (a half-token head slice per entry,
    pages of 16 tokens scattered) reaches the transport as one strided
    descriptor per page; the library's metrics count both."""
    target = peers("mooncake", "--protocol", "tcp")
    name, regions = target.ready["name"], target.ready["regions"]
    pages, ptok, slice_ = 8, 16, 256
    src = np.random.default_rng(3).integers(0, 256, pages * ptok * 2 * slice_, dtype=np.uint8)
    assert local.register_memory(src.ctypes.data, src.nbytes) == 0
    sp, dp = np.array([3, 0, 6, 1, 7, 2, 5, 4]), np.array([5, 2, 7, 0, 3, 6, 1, 4])
    tok = np.arange(pages * ptok)
    s_tok, d_tok = sp[tok // ptok] * ptok + tok % ptok, dp[tok // ptok] * ptok + tok % ptok
    bufs = (src.ctypes.data + slice_ + s_tok * 2 * slice_).astype(np.uint64)
    dsts = (regions["a"] + d_tok * slice_).astype(np.uint64)
    lens = np.full(len(bufs), slice_, dtype=np.uint64)
    before = kvxfer.metrics_text()
    assert local.batch_transfer_sync_write(name, bufs, dsts, lens) == 0, local.last_error
    after = kvxfer.metrics_text()
    grew = {m: _lib.counter(after, m) - _lib.counter(before, m) for m in ("kvxfer_segment_requests_total", "kvxfer_segment_descriptors_total")}
    assert grew == {"kvxfer_segment_requests_total": pages * ptok, "kvxfer_segment_descriptors_total": pages}, grew
    got = np.frombuffer(peer_bytes(target, regions["a"], pages * ptok * slice_), dtype=np.uint8)
    for t in range(pages * ptok):
        s0 = int(bufs[t]) - src.ctypes.data
        d0 = int(dsts[t]) - regions["a"]
        assert (got[d0:d0 + slice_] == src[s0:s0 + slice_]).all(), t
