"""kvxfer.TransferEngine against a peer process, as Mooncake's Python API is
used: P2PHANDSHAKE, register, write by the peer's virtual address, read back,
async submit/check, and the failures (outside every region, unreachable,
stalled and killed peers, unsupported READ)."""

from __future__ import annotations

import ctypes
import logging
import signal
import time

import numpy as np
import pytest

import kvxfer
from kvxfer import engine as kengine
from conftest import peer_bytes, wait_until

MiB = 1 << 20


@pytest.mark.parametrize("kind", ["bytearray", "numpy"])
def test_write_and_read_back_tcp(peers, local, kind):
    target = peers("mooncake", "--protocol", "tcp")
    name, regions = target.ready["name"], target.ready["regions"]
    assert name == f"127.0.0.1:{target.ready['rpc_port']}"
    rng = np.random.default_rng(7)
    payload = rng.integers(0, 256, 3 * 65536 + 5, dtype=np.uint8)
    if kind == "bytearray":
        src = bytearray(payload.tobytes())
        assert local.register_memory(src) == 0, local.last_error
        addr = kvxfer.address_of(src)[0]
    else:
        src = payload.copy()
        assert local.register_memory(src.ctypes.data, src.nbytes) == 0, local.last_error
        addr = src.ctypes.data
    # One write into each peer region at an offset (peer virtual addresses).
    assert local.transfer_sync_write(name, addr, regions["a"] + 100, 65536) == 0, local.last_error
    assert peer_bytes(target, regions["a"] + 100, 65536) == payload[:65536].tobytes()
    # A batch across both regions.
    bufs = [addr + 65536, addr + 2 * 65536, addr + 3 * 65536]
    dsts = [regions["b"], regions["b"] + 65536 * 3, regions["a"] + MiB - 5]
    lens = [65536, 65536, 5]
    assert local.batch_transfer_sync_write(name, bufs, dsts, lens) == 0, local.last_error
    for b, d, n in zip(bufs, dsts, lens):
        assert peer_bytes(target, d, n) == payload[b - addr:b - addr + n].tobytes()
    assert local.get_first_buffer_address(name) == regions["a"]
    assert local.segment_regions(name) == [(regions["a"], MiB), (regions["b"], MiB)]
    assert local.unregister_memory(addr) == 0
    # After unregistering, the source is refused (not registered: -6).
    assert local.transfer_sync_write(name, addr, regions["a"], 16) == -kvxfer._lib.ERR_NOT_REGISTERED


@pytest.mark.parametrize("kind", ["bytearray", "numpy"])
def test_async_submit_and_check_tcp(peers, local, kind):
    target = peers("mooncake", "--protocol", "tcp")
    name, regions = target.ready["name"], target.ready["regions"]
    src = bytearray(b"kvxfer-async-" * 20000) if kind == "bytearray" else np.arange(MiB // 4, dtype=np.uint32)
    assert local.register_memory(src) == 0, local.last_error
    addr, n, _ = kvxfer.address_of(src)
    n = min(n, MiB)
    bid = local.transfer_submit_write(name, addr, regions["b"], n)
    assert bid > 0, local.last_error
    status = wait_until(lambda: local.transfer_check_status(bid) or None, what="transfer_check_status != 0")
    assert status == 1
    assert local.transfer_check_status(bid) == 1  # asked again: still done, never "failed"
    assert local.transfer_check_status(987654321) == -1  # never submitted
    expect = bytes(memoryview(src).cast("B")[:n])
    assert peer_bytes(target, regions["b"], n) == expect
    ids = [local.batch_transfer_async_write(name, [addr, addr + 4096], [regions["a"], regions["a"] + 8192], [4096, 4096])
           for _ in range(3)]
    assert all(i > 0 for i in ids), local.last_error
    assert local.get_batch_transfer_status(ids) == 0
    assert peer_bytes(target, regions["a"] + 8192, 4096) == expect[4096:8192]


def test_outside_every_region_is_refused_and_logged(peers, local, caplog):
    target = peers("mooncake", "--protocol", "tcp")
    name, regions = target.ready["name"], target.ready["regions"]
    src = bytearray(64)
    assert local.register_memory(src) == 0
    addr = kvxfer.address_of(src)[0]
    bad = regions["a"] + MiB - 8  # 16 bytes from here cross the region's end
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        rc = local.transfer_sync_write(name, addr, bad, 16)
    assert rc == -kvxfer._lib.ERR_OUT_OF_BOUNDS
    text = caplog.text
    assert name in text and f"{bad:#x}" in text and "+16 bytes" in text, text
    assert "not inside any region the peer registered" in text
    # Asynchronous submits return Mooncake's failure sentinel 0; the status
    # of batch 0 is "failed" and last_error / last_code say why.
    assert local.transfer_submit_write(name, addr, 0x10, 16) == 0
    assert local.last_code == -kvxfer._lib.ERR_OUT_OF_BOUNDS
    assert local.transfer_check_status(0) == -1
    assert "not inside any region the peer registered" in local.last_error
    assert local.batch_transfer_async_write(name, [addr], [0x10], [16]) == 0
    # Nothing was written to the peer.
    assert peer_bytes(target, regions["a"] + MiB - 8, 8) == bytes(8)


def test_region_registered_after_open(peers, local):
    target = peers("mooncake", "--protocol", "tcp")
    name = target.ready["name"]
    src = bytearray(b"late" * 1024)
    assert local.register_memory(src) == 0
    addr = kvxfer.address_of(src)[0]
    assert local.send_probe(name) == 0  # opens the segment: the descriptor has two regions
    late = target.call({"cmd": "register", "len": 8192})
    assert late["rc"] == 0
    # The first write misses the cached descriptor, refreshes it once and lands.
    assert local.transfer_sync_write(name, addr, late["addr"] + 4096, 4096) == 0, local.last_error
    assert peer_bytes(target, late["addr"] + 4096, 4096) == bytes(src)


def test_reads_on_tcp(peers, local):
    """One-sided READ on tcp: transfer_sync_read, batch_transfer_sync_read,
    transfer_sync(..., READ), batch_transfer_async_read and
    transfer_submit_read return the peer's bytes; a range outside the peer's
    memory is -8 with nothing read; a killed peer is -12."""
    target = peers("mooncake", "--protocol", "tcp")
    name, a = target.ready["name"], target.ready["regions"]["a"]
    src_hex = (b"tcp-read" * 512).hex()
    assert target.call({"cmd": "write", "addr": a, "hex": src_hex})["rc"] == 0
    dst = bytearray(16384)
    assert local.register_memory(dst) == 0
    base = kvxfer.address_of(dst)[0]
    assert local.transfer_sync_read(name, base, a, 32) == 0, local.last_error
    assert bytes(dst[:32]) == b"tcp-read" * 4
    assert local.batch_transfer_sync_read(name, [base + 4096, base + 8192], [a + 8, a + 16], [16, 24]) == 0, local.last_error
    assert bytes(dst[4096:4112]) == b"tcp-read" * 2 and bytes(dst[8192:8216]) == b"tcp-read" * 3
    assert local.transfer_sync(name, base + 100, a, 8, kengine.TransferOpcode.READ) == 0, local.last_error
    assert bytes(dst[100:108]) == b"tcp-read"
    bid = local.batch_transfer_async_read(name, [base + 12288], [a], [4096])
    assert bid > 0, local.last_error
    assert local.get_batch_transfer_status([bid]) == 0, local.last_error
    assert bytes(dst[12288:16384]) == b"tcp-read" * 512
    dst[:64] = bytes(64)
    bid = local.transfer_submit_read(name, base, a + 64, 64)
    assert bid > 0, local.last_error
    while (st := local.transfer_check_status(bid)) == 0:
        pass
    assert st == 1, local.last_error
    assert bytes(dst[:64]) == b"tcp-read" * 8
    # Outside the peer's memory: refused, nothing read.
    before = bytes(dst)
    assert local.transfer_sync_read(name, base, a + (1 << 20) - 4, 8) == -8
    assert bytes(dst) == before
    # A killed peer: the read fails as a lost peer, no hang.
    target.kill()
    assert local.transfer_sync_read(name, base, a, 4096) == -12, local.last_error


@pytest.mark.parametrize("protocol", ["cma", "auto"])
def test_caller_memory_same_host(peers, protocol):
    """The caller's own memory (a bytearray, a numpy array) registers and
    moves between two processes on one host: with "cma", and with "auto",
    which picks cma for the segment API (shm would refuse this memory)."""
    target = peers("mooncake", "--protocol", "cma")
    name, regions = target.ready["name"], target.ready["regions"]
    assert target.ready["transport"] == "cma"
    e = kvxfer.TransferEngine()
    try:
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0, e.last_error
        assert e.transport == "cma"
        plain = bytearray(8192)
        arr = np.zeros(MiB, dtype=np.uint8)
        assert e.register_memory(plain) == 0, e.last_error
        assert e.register_memory(arr.ctypes.data, arr.nbytes) == 0, e.last_error
        data = bytes(range(256)) * 16
        arr[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        assert e.transfer_sync_write(name, arr.ctypes.data, regions["b"] + 100, len(data)) == 0, e.last_error
        assert peer_bytes(target, regions["b"] + 100, len(data)) == data
        target.call({"cmd": "write", "addr": regions["a"] + 8, "hex": (b"cma-read!" * 10).hex()})
        addr = ctypes.addressof(ctypes.c_char.from_buffer(plain))
        assert e.transfer_sync_read(name, addr + 16, regions["a"] + 8, 90) == 0, e.last_error
        assert bytes(plain[16:106]) == b"cma-read!" * 10
        # Out of bounds of the target's region: refused, nothing written.
        assert e.transfer_sync_write(name, arr.ctypes.data, regions["b"] + target.ready["size"] - 10, 64) < 0
    finally:
        e.close()


def test_shm_write_and_sync_read(peers):
    target = peers("mooncake", "--protocol", "shm")
    name, regions = target.ready["name"], target.ready["regions"]
    e = kvxfer.TransferEngine()
    try:
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "shm", "") == 0, e.last_error
        assert e.transport == "shm"
        plain = bytearray(4096)
        assert e.register_memory(plain) == -kvxfer._lib.ERR_UNSUPPORTED_MEMORY
        assert "HostBuffer" in e.last_error  # says what to use instead
        buf = e.allocate_managed_buffer(MiB)
        assert buf != 0, e.last_error
        data = bytes(range(256)) * 64
        assert e.write_bytes_to_buffer(buf, data, len(data)) == 0
        assert e.transfer_sync_write(name, buf, regions["b"] + 512, len(data)) == 0, e.last_error
        assert peer_bytes(target, regions["b"] + 512, len(data)) == data
        # The peer writes its own memory; we read it with a one-sided READ.
        target.call({"cmd": "write", "addr": regions["a"] + 8, "hex": (b"shm-read!" * 10).hex()})
        assert e.transfer_sync_read(name, buf + 4096, regions["a"] + 8, 90) == 0, e.last_error
        assert e.read_bytes_from_buffer(buf + 4096, 90) == b"shm-read!" * 10
        assert e.transfer_sync(name, buf + 8192, regions["a"] + 8, 90, kengine.TransferOpcode.READ) == 0
        assert e.read_bytes_from_buffer(buf + 8192, 9) == b"shm-read!"
        rid = e.batch_transfer_async_read(name, [buf + 12288], [regions["a"] + 8], [9])
        assert rid > 0
        assert e.get_batch_transfer_status([rid]) == 0
        assert e.read_bytes_from_buffer(buf + 12288, 9) == b"shm-read!"
        assert e.free_managed_buffer(buf, MiB) == 0
        assert e.free_managed_buffer(buf, MiB) == -kvxfer._lib.ERR_NOT_REGISTERED
    finally:
        e.close()


def test_unreachable_peer(local, caplog):
    src = bytearray(16)
    assert local.register_memory(src) == 0
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        rc = local.transfer_sync_write("127.0.0.1:1", kvxfer.address_of(src)[0], 0x1000, 16)
    assert rc < 0 and rc in (-kvxfer._lib.ERR_PEER_LOST, -kvxfer._lib.ERR_TIMEOUT)
    assert time.monotonic() - t0 < 30
    assert "127.0.0.1:1" in caplog.text
    assert local.get_first_buffer_address("127.0.0.1:1") == 0
    assert local.send_probe("127.0.0.1:1") < 0


def test_killed_peer_fails_not_hangs(peers, local):
    """Fault without verification: the target dies (SIGKILL) between
    transfers; the initiator's next transfers fail (negative), not hang."""
    target = peers("mooncake", "--protocol", "tcp")
    name, regions = target.ready["name"], target.ready["regions"]
    src = np.ones(MiB, dtype=np.uint8)
    assert local.register_memory(src) == 0
    assert local.transfer_sync_write(name, src.ctypes.data, regions["a"], MiB) == 0
    target.kill()
    t0 = time.monotonic()
    rc = local.transfer_sync_write(name, src.ctypes.data, regions["a"], MiB)
    assert rc < 0, "a write to a killed peer reported success"
    bid = local.transfer_submit_write(name, src.ctypes.data, regions["a"], MiB)
    if bid > 0:
        assert wait_until(lambda: local.transfer_check_status(bid) or None) in (-1, -2)
    assert time.monotonic() - t0 < 40


def test_stalled_peer_times_out(peers, monkeypatch):
    """MC_TRANSFER_TIMEOUT: a SIGSTOPped peer never acknowledges; the sync
    write returns -10 and an async batch reports -2 (timed out)."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    target = peers("mooncake", "--protocol", "tcp")
    name, regions = target.ready["name"], target.ready["regions"]
    e = kvxfer.TransferEngine()
    assert e.transfer_timeout_ns == 5 * 10**9
    try:
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src = np.ones(MiB, dtype=np.uint8)
        assert e.register_memory(src) == 0
        assert e.send_probe(name) == 0
        target.kill(signal.SIGSTOP)
        try:
            # The signal is asynchronous: submit only once the peer is stopped
            # (else a 1 MiB write can still complete before it lands).
            wait_until(lambda: proc_state(target.p.pid) in ("T", "t"), what="peer stopped")
            bid = e.transfer_submit_write(name, src.ctypes.data, regions["a"], MiB)
            t0 = time.monotonic()
            rc = e.transfer_sync_write(name, src.ctypes.data, regions["b"], MiB)
            took = time.monotonic() - t0
            assert rc == -kvxfer._lib.ERR_TIMEOUT, e.last_error
            assert 4 < took < 30
            if bid > 0:
                assert wait_until(lambda: e.transfer_check_status(bid) or None, timeout=30) == -2
        finally:
            target.kill(signal.SIGCONT)
    finally:
        e.close()


def proc_state(pid: int) -> str:
    """The process state letter of /proc/PID/stat ("T" when stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_registration_errors(local, caplog):
    buf = bytearray(4096)
    assert local.register_memory(buf) == 0
    assert local.register_memory(buf) < 0  # overlaps the registered region
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        assert local.unregister_memory(0x12345) == -kvxfer._lib.ERR_NOT_REGISTERED
    assert "no region is registered at 0x12345" in caplog.text
    assert local.register_memory(0, 10) < 0
    assert local.register_memory(12345) < 0  # an address without a capacity
    assert local.register_memory(b"immutable bytes") == -kvxfer._lib.ERR_INVALID_ARGUMENT  # peers would write it
    assert "read-only" in local.last_error
    a, b = bytearray(100), bytearray(100)
    # batch: the second overlaps buf, so the first is rolled back
    assert local.batch_register_memory([a, buf], [100, 100]) < 0
    assert local.unregister_memory(a) == -kvxfer._lib.ERR_NOT_REGISTERED
    assert local.batch_register_memory([a, b], [100, 100]) == 0
    assert local.batch_unregister_memory([a, b]) == 0
    assert local.batch_register_memory([a], [1, 2]) == -kvxfer._lib.ERR_INVALID_ARGUMENT


def test_managed_buffer_and_bytes(local):
    addr = local.allocate_managed_buffer(10000)
    assert addr != 0
    assert local.write_bytes_to_buffer(addr, b"0123456789", 10) == 0
    assert local.read_bytes_from_buffer(addr + 3, 4) == b"3456"
    assert local.write_bytes_to_buffer(addr, b"01", 10) == -kvxfer._lib.ERR_INVALID_ARGUMENT
    assert local.free_managed_buffer(addr, 10000) == 0


def test_initialize_errors(caplog):
    e = kvxfer.TransferEngine()
    try:
        assert e.get_rpc_port() < 0
        assert e.transfer_sync_write("127.0.0.1:1", 0, 0, 1) < 0
        with caplog.at_level(logging.ERROR, logger="kvxfer"):
            assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == -17
            assert e.initialize("127.0.0.1", "redis://127.0.0.1:6379", "tcp", "") == -17
            assert e.initialize("127.0.0.1", "http://127.0.0.1:1/metadata", "tcp", "") == -kvxfer._lib.ERR_METADATA
        assert "nvlink" in caplog.text and "redis" in caplog.text and "http://127.0.0.1:1/metadata" in caplog.text
        assert e.initialize("127.0.0.1:0", "P2PHANDSHAKE", "tcp", "mlx5_0") == 0  # device_name ignored by tcp
        assert e.get_rpc_port() > 0
        assert e.segment_name == f"127.0.0.1:{e.get_rpc_port()}"
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -kvxfer._lib.ERR_BUSY
        assert e.transfer_sync("x:1", 0, 0, 1, kengine.TransferOpcode.WRITE, notify=kengine.TransferNotify("a", "b")) == -17
        assert e.get_notifies() == []
        assert e.warmup_efa_segment("x") == 0
        assert e.get_engine_ptr() != 0
        with pytest.raises(NotImplementedError):
            e.get_local_topology()
    finally:
        e.close()
    e.close()  # idempotent


@pytest.mark.parametrize(
    "raw,want",
    [(None, 30), ("", 30), ("2", 5), ("5", 5), ("120", 120), ("abc", 30)],
)
def test_transfer_timeout_env(raw, want):
    env = {} if raw is None else {"MC_TRANSFER_TIMEOUT": raw}
    assert kengine.transfer_timeout_s(env) == want


@pytest.mark.parametrize(
    "server,mtype,want",
    [
        ("P2PHANDSHAKE", None, "P2PHANDSHAKE"),
        ("", None, "P2PHANDSHAKE"),
        ("etcd://10.0.0.1:2379", None, "etcd://10.0.0.1:2379"),
        ("10.0.0.1:2379", None, "etcd://10.0.0.1:2379"),
        ("10.0.0.1:2379", "etcd", "etcd://10.0.0.1:2379"),
        ("10.0.0.1:2379", "p2p", "P2PHANDSHAKE"),
        ("http://h:8080/metadata", None, "http://h:8080/metadata"),
        ("HTTP://h:8080/metadata", None, "http://h:8080/metadata"),
        ("h:8080/metadata", "http", "http://h:8080/metadata"),
        ("h:6379", "redis", ValueError),
        ("redis://h:6379", None, ValueError),
    ],
)
def test_parse_metadata_server(server, mtype, want):
    if want is ValueError:
        with pytest.raises(ValueError, match="P2PHANDSHAKE.*http://host:port/metadata"):
            kengine.parse_metadata_server(server, mtype)
    else:
        assert kengine.parse_metadata_server(server, mtype) == want


@pytest.mark.parametrize(
    "s,want",
    [("h", ("h", None)), ("h:1", ("h", 1)), ("[::1]", ("::1", None)), ("[::1]:7", ("::1", 7)), ("fe80::1", ("fe80::1", None))],
)
def test_split_host_port(s, want):
    assert kengine.split_host_port(s) == want


def test_address_of():
    ba = bytearray(10)
    addr, n, keep = kvxfer.address_of(ba)
    assert n == 10 and addr == ctypes.addressof((ctypes.c_char * 10).from_buffer(ba))
    a = np.zeros((4, 4), dtype=np.float32)
    assert kvxfer.address_of(a)[:2] == (a.ctypes.data, 64)
    with pytest.raises(TypeError, match="not C-contiguous"):
        kvxfer.address_of(a[:, 1])
    with pytest.raises(TypeError, match="read-only"):
        kvxfer.address_of(memoryview(b"abc"))
    with pytest.raises(TypeError, match="neither an address"):
        kvxfer.address_of(object())
    assert kvxfer.address_of(1234) == (1234, 0, None)
