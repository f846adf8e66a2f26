"""The Mooncake backends of SGLang, LMCache and vLLM, driven through the
``mooncake`` shim with their own call sequences (written from their calls:
SGLang's srt/distributed/.../mooncake_transfer_engine.py MooncakeTransferEngine,
LMCache's v1/transfer_channel/mooncake_channel.py MooncakeChannel, the vLLM v1
connector Mooncake ships in mooncake_connector_v1.py), two processes on
loopback: the test is the sending side, tests/peer.py --caller the receiving
side set up as that caller sets up its engine."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

from conftest import peer_bytes, wait_until

MiB = 1 << 20
PAGE = 4096


class SGLangStyle:
    """What SGLang's MooncakeTransferEngine does with the engine: protocol
    "rdma" (MC_FORCE_TCP decides), session "host:rpc_port", errors caught and
    turned into -1, get_engine() handed to other components."""

    def __init__(self, hostname: str, ib_device=None):
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        self.hostname = hostname
        if self.engine.initialize(hostname, "P2PHANDSHAKE", "rdma", ib_device if ib_device is not None else "") != 0:
            raise RuntimeError("Mooncake Transfer Engine initialization failed.")
        self.session_id = f"{hostname}:{self.engine.get_rpc_port()}"

    def batch_register(self, ptrs, lengths) -> int:
        try:
            return self.engine.batch_register_memory(ptrs, lengths)
        except Exception:
            return -1

    def batch_deregister(self, ptrs) -> int:
        try:
            return self.engine.batch_unregister_memory(ptrs)
        except Exception:
            return -1

    def transfer_sync(self, session_id, buffer, peer_buffer_address, length) -> int:
        try:
            return self.engine.transfer_sync_write(session_id, buffer, peer_buffer_address, length)
        except Exception:
            return -1

    def batch_transfer_sync(self, session_id, buffers, peer_buffer_addresses, lengths) -> int:
        try:
            return self.engine.batch_transfer_sync_write(session_id, buffers, peer_buffer_addresses, lengths)
        except Exception:
            return -1

    def send_probe(self, peer_session_id) -> int:
        return self.engine.send_probe(peer_session_id)

    def get_engine(self):
        return self.engine.get_engine()


def contiguous_runs(src: np.ndarray, dst: np.ndarray):
    """Split paired page lists where either side stops being consecutive (as
    SGLang groups pages before a transfer)."""
    brk = np.where((np.diff(src) != 1) | (np.diff(dst) != 1))[0] + 1
    return np.split(src, brk), np.split(dst, brk)


def test_sglang_mooncake_backend(peers, monkeypatch):
    """SGLang's sequence: protocol "rdma" under MC_FORCE_TCP=1 (runs on tcp),
    batch_register_memory of the KV buffers, page-run addresses computed with
    numpy (numpy integers as addresses), transfer_sync per run and one
    batch_transfer_sync, send_probe, get_engine; then the decode dies and the
    next transfer fails instead of hanging."""
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    decode = peers("mooncake", "--caller", "sglang", "--name", "127.0.0.1", env={"MC_FORCE_TCP": "1"})
    assert decode.ready["transport"] == "tcp"
    dst_k, dst_v = decode.ready["regions"]["a"], decode.ready["regions"]["b"]
    te = SGLangStyle("127.0.0.1")
    assert te.engine.transport == "tcp"
    assert te.get_engine() is not None
    k = np.random.default_rng(5).integers(0, 256, MiB, dtype=np.uint8)
    v = np.random.default_rng(6).integers(0, 256, MiB, dtype=np.uint8)
    assert te.batch_register([k.ctypes.data, v.ctypes.data], [k.nbytes, v.nbytes]) == 0, te.engine.last_error
    src_pages = np.array([3, 4, 5, 9, 10, 40], dtype=np.int64)
    dst_pages = np.array([0, 1, 2, 7, 8, 100], dtype=np.int64)
    src_runs, dst_runs = contiguous_runs(src_pages, dst_pages)
    assert len(src_runs) == 3
    for s, d in zip(src_runs, dst_runs):
        src_addr = k.ctypes.data + s[0] * PAGE  # numpy int64
        dst_addr = dst_k + d[0] * PAGE
        assert isinstance(src_addr, np.integer)
        assert te.transfer_sync(decode.ready["name"], src_addr, dst_addr, len(s) * PAGE) == 0, te.engine.last_error
    bufs = [v.ctypes.data + s[0] * PAGE for s in src_runs]
    dsts = [dst_v + d[0] * PAGE for d in dst_runs]
    lens = [np.int64(len(s) * PAGE) for s in src_runs]
    assert te.batch_transfer_sync(decode.ready["name"], bufs, dsts, lens) == 0, te.engine.last_error
    for sp, dp in zip(src_pages, dst_pages):
        assert peer_bytes(decode, dst_k + dp * PAGE, PAGE) == k[sp * PAGE:(sp + 1) * PAGE].tobytes()
        assert peer_bytes(decode, dst_v + dp * PAGE, PAGE) == v[sp * PAGE:(sp + 1) * PAGE].tobytes()
    assert te.send_probe(decode.ready["name"]) == 0
    decode.kill()
    assert te.transfer_sync(decode.ready["name"], k.ctypes.data, dst_k, PAGE) < 0
    assert te.send_probe(decode.ready["name"]) != 0
    assert te.batch_deregister([k.ctypes.data, v.ctypes.data]) == 0
    te.engine.close()


class LMCacheStyle:
    """What LMCache's MooncakeChannel does: hostname from MC_LOCAL_HOSTNAME
    (default "localhost"), metadata MC_METADATA_SERVER (P2PHANDSHAKE),
    protocol MC_PROTOCOL (tcp), one registered buffer, one
    transfer_sync_write per page."""

    def __init__(self, buffer_ptr: int, buffer_size: int, align: int):
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        hostname = os.getenv("MC_LOCAL_HOSTNAME", "localhost")
        rc = self.engine.initialize(hostname, os.getenv("MC_METADATA_SERVER", "P2PHANDSHAKE"), os.getenv("MC_PROTOCOL", "tcp"),
                                    os.getenv("MC_DEVICE_NAME", ""))
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize failed with code {rc}")
        self.session_id = f"{hostname}:{self.engine.get_rpc_port()}"
        self.buffer_ptr, self.buffer_size, self.align = buffer_ptr, buffer_size, align
        rc = self.engine.register_memory(buffer_ptr, buffer_size)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory failed with code {rc}")

    def batched_write(self, target_session, remote_base, local_pages, remote_pages) -> int:
        for lp, rp in zip(local_pages, remote_pages):
            ret = self.engine.transfer_sync_write(target_session, self.buffer_ptr + lp * self.align, remote_base + rp * self.align, self.align)
            if ret < 0:
                raise RuntimeError(f"Mooncake transfer_sync_write failed with code {ret}")
        return len(local_pages)

    def close(self):
        self.engine.unregister_memory(self.buffer_ptr)
        self.engine.close()


def lmcache_hostnames():
    names = [None]  # MC_LOCAL_HOSTNAME unset: "localhost"
    h = socket.gethostname()
    try:
        if socket.gethostbyname(h):
            names.append(h)
    except OSError:
        pass
    return names


@pytest.mark.parametrize("hostname", lmcache_hostnames(), ids=lambda h: h or "default-localhost")
def test_lmcache_mooncake_channel(peers, monkeypatch, hostname):
    """LMCache's channel with a host name (its default "localhost", or this
    machine's name): both sides name their session "hostname:rpc_port" and
    the writes land (before: initialize failed unless given an IP)."""
    env = {}
    if hostname:
        monkeypatch.setenv("MC_LOCAL_HOSTNAME", hostname)
        env["MC_LOCAL_HOSTNAME"] = hostname
    else:
        monkeypatch.delenv("MC_LOCAL_HOSTNAME", raising=False)
    for k in ("MC_METADATA_SERVER", "MC_PROTOCOL", "MC_FORCE_TCP"):
        monkeypatch.delenv(k, raising=False)
    receiver = peers("mooncake", "--caller", "lmcache", env=env)
    want_host = hostname or "localhost"
    assert receiver.ready["name"].rsplit(":", 1)[0] == want_host
    buf = np.random.default_rng(9).integers(0, 256, 16 * PAGE, dtype=np.uint8)
    ch = LMCacheStyle(buf.ctypes.data, buf.nbytes, PAGE)
    try:
        assert ch.session_id.startswith(want_host + ":")
        assert ch.batched_write(receiver.ready["name"], receiver.ready["regions"]["a"], [0, 5, 6], [10, 11, 200]) == 3
        for lp, rp in ((0, 10), (5, 11), (6, 200)):
            assert peer_bytes(receiver, receiver.ready["regions"]["a"] + rp * PAGE, PAGE) == buf[lp * PAGE:(lp + 1) * PAGE].tobytes()
        receiver.kill()
        with pytest.raises(RuntimeError, match="transfer_sync_write failed"):
            ch.batched_write(receiver.ready["name"], receiver.ready["regions"]["a"], [0], [0])
    finally:
        ch.close()


def test_vllm_mooncake_connector(peers):
    """The vLLM v1 connector: initialize(IP, P2PHANDSHAKE, protocol),
    batch_register_memory of the KV tensors, batch_transfer_sync_write of
    block runs; submitted asynchronously too, polled with
    transfer_check_status."""
    decode = peers("mooncake", "--caller", "vllm", "--name", "127.0.0.1")
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    try:
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        kv = [np.full(MiB, i + 1, dtype=np.uint8) for i in range(2)]
        assert e.batch_register_memory([t.ctypes.data for t in kv], [t.nbytes for t in kv]) == 0
        session = decode.ready["name"]
        dst = [decode.ready["regions"]["a"], decode.ready["regions"]["b"]]
        block = 16 * 1024
        src_ptrs = [kv[0].ctypes.data + 2 * block, kv[1].ctypes.data + 2 * block]
        dst_ptrs = [dst[0] + 7 * block, dst[1] + 7 * block]
        assert e.batch_transfer_sync_write(session, src_ptrs, dst_ptrs, [3 * block, 3 * block]) == 0, e.last_error
        assert peer_bytes(decode, dst[1] + 7 * block, 3 * block) == bytes([2]) * 3 * block
        bid = e.transfer_submit_write(session, kv[0].ctypes.data, dst[0], block)
        assert bid > 0
        assert wait_until(lambda: e.transfer_check_status(bid) or None) == 1
        assert peer_bytes(decode, dst[0], block) == bytes([1]) * block
    finally:
        e.close()
