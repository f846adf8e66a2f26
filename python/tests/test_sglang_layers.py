"""kvxfer.sglang layer-wise sending between processes: prefill rank
processes (tests/peer.py "send_layers") send a room layer by layer, with
send_layers or the vLLM-shaped hooks (LayerwiseSaver: save_kv_layer by layer
name, wait_for_save), and a decode rank here checks every byte of the
destination pages itself (no checksum, no verify hook). Faults between
layers are checked on both sides."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer.sglang import KVPoll, KVTransferError, LayerwiseSaver, layer_index
from kvxfer.sglang.conn import _event_handle
from conftest import DEADLINE
from kvpattern import Geometry, expected_aux, expected_page
from test_sglang import bootstrap, check_pages, decode_rank, prefill_ranks, receive, short_timeouts  # noqa: F401


@pytest.mark.parametrize(
    "tp,mla,order,hooks,chunks",
    [(1, False, "chunk", False, 3), (2, False, "layer", False, 2), (1, False, "chunk", True, 2),
     (2, True, "layer", True, 1)],
    ids=["tp1-chunked", "tp2to1-head-slicing-layer-major", "vllm-hooks", "mla-dummy-hooks"],
)
def test_send_layers(peers, bootstrap, tp, mla, order, hooks, chunks):
    g = Geometry(mla=mla)
    pre = prefill_ranks(peers, bootstrap, tp, mla)
    kv, mgr = decode_rank(g, mla)
    try:
        room = 9000 + tp * 10 + int(hooks)
        src, dst, aux_row = [5, 6, 7, 20, 21, 40], [1, 2, 9, 10, 11, 30], 3
        for p in pre:
            p.send({"cmd": "send_layers", "room": room, "src_pages": src, "chunks": chunks, "order": order, "hooks": hooks, "aux_row": 2})
        r = receive(mgr, bootstrap, room, dst, aux_row)
        assert r.wait(KVPoll.Success, DEADLINE) == KVPoll.Success, r.failure_reason()
        results = [p.recv() for p in pre]
        assert all(res["state"] == KVPoll.Success for res in results), results
        if hooks:
            assert all(all(res.get("saved", [True])) for res in results), results
        check_pages(g, kv, room, src, dst)
        for k in range(len(g.aux_item_lens)):
            assert np.array_equal(kv.aux[k][aux_row], expected_aux(g, k, room)), f"aux buffer {k}"
    finally:
        mgr.close()


def test_send_layers_prefix(peers, bootstrap):
    """The decode holds 2 pages: only the pages after them go, layer by layer."""
    g = Geometry()
    (pre,) = prefill_ranks(peers, bootstrap, 1)
    kv, mgr = decode_rank(g)
    try:
        src, dst = [3, 4, 5, 6, 7], [10, 11, 12, 13, 14]
        pre.send({"cmd": "send_layers", "room": 71, "src_pages": src, "chunks": 2, "aux_row": 1})
        r = receive(mgr, bootstrap, 71, dst[2:], aux_row=4, prefix=2 * g.page_size)
        assert r.wait(KVPoll.Success, DEADLINE) == KVPoll.Success, r.failure_reason()
        assert pre.recv()["state"] == KVPoll.Success
        check_pages(g, kv, 71, src[2:], dst[2:])
        assert not any(kv.kv[b][d].any() for b in range(g.nbuffers()) for d in dst[:2]), "prefix pages were written"
    finally:
        mgr.close()


def layer_buffers(g, layer):
    """The K and V buffer indices of a layer (K buffers of every layer, then V)."""
    return [layer] if g.mla else [layer, g.layers + layer]


@pytest.mark.parametrize("fault", ["abort", "killed", "bad-event"])
def test_send_layers_fault_between_layers(peers, bootstrap, fault):
    """Layer 0 of the room landed, then the prefill aborts (its forward pass
    failed), is SIGKILLed, or hands an event CUDA cannot query: both sides
    report Failed, the decode's clear() returns once the producer is fenced,
    and layer 1 of the destination pages was never written."""
    g = Geometry()
    (pre,) = prefill_ranks(peers, bootstrap, 1)
    kv, mgr = decode_rank(g)
    try:
        room = {"abort": 81, "killed": 82, "bad-event": 83}[fault]
        src, dst = [1, 2, 3], [20, 21, 22]
        cmd = {"cmd": "send_layers", "room": room, "src_pages": src}
        cmd.update({"abort": {"abort_after_calls": 1}, "killed": {"die_after_calls": 1}, "bad-event": {"bad_event": True}}[fault])
        pre.send(cmd)
        r = receive(mgr, bootstrap, room, dst)
        if fault == "killed":
            assert pre.recv()["event"] == "dying"
            # It flushed layer 0 before dying: those bytes are in place.
            assert all(np.array_equal(kv.kv[b][d], expected_page(g, room, b, s_)) for b in layer_buffers(g, 0) for s_, d in zip(src, dst))
            pre.kill()
        assert r.wait(KVPoll.Success, DEADLINE) == KVPoll.Failed
        status, msg = r.failure_reason()
        assert status != 0 and str(room) in msg, msg
        if fault != "killed":
            res = pre.recv()
            assert res["state"] == KVPoll.Failed, res
            # The prefill says why; the decode learns the room was aborted
            # by its prefill (a refused call aborts the room from Python).
            want = "aborted by prefill" if fault == "abort" else "CUDA cannot be loaded"
            assert want in res["error"] and "aborted by prefill" in msg, (res, msg)
        t0 = time.monotonic()
        r.clear()  # returns once the producer is fenced (acknowledged, or its path cut)
        assert time.monotonic() - t0 < DEADLINE
        assert not any(kv.kv[b][d].any() for b in layer_buffers(g, 1) for d in dst), "layer 1 was written after the room stopped"
        with pytest.raises(KVTransferError):
            r.failure_exception()
    finally:
        mgr.close()


def test_layer_index_and_event_handle():
    assert layer_index(3) == 3
    assert layer_index("model.layers.12.self_attn.attn") == 12
    for bad in ("model.layers.attn", "a.1.b.2", True):
        with pytest.raises((ValueError, TypeError)):
            layer_index(bad)

    class TorchLike:
        cuda_event = 0x7F00

    class CtypesLike:
        class _P:
            value = 0x7F08

        _as_parameter_ = _P()

    assert _event_handle(None) is None
    assert _event_handle(TorchLike()) == 0x7F00
    assert _event_handle(CtypesLike()) == 0x7F08
    assert _event_handle(0x10) == 0x10
    with pytest.raises(ValueError, match="never recorded"):
        _event_handle(0)
    with pytest.raises(TypeError):
        _event_handle("event")


def test_layerwise_saver_without_requests():
    s = LayerwiseSaver()
    s.save_kv_layer("model.layers.0.attn")
    assert s.wait_for_save(0.1) is True
