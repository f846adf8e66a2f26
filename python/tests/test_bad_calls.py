"""Bad calls return an error code, never crash: every address and length a
caller passes is checked against what the caller registered before kvxfer
touches memory. Each case runs in a child interpreter, so a crash (SIGSEGV)
fails the test instead of killing pytest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import DEADLINE, HERE

PRELUDE = textwrap.dedent(
    """
    import ctypes, mmap, sys
    sys.path.insert(0, %r)
    import kvxfer
    from kvxfer import _lib
    e = kvxfer.TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, e.last_error
    """
) % os.path.join(HERE, "..")


def run_child(body: str) -> str:
    p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body) + "\nprint('survived')\n"],
                       capture_output=True, text=True, timeout=DEADLINE)
    assert p.returncode == 0 and "survived" in p.stdout, (
        f"the child died (status {p.returncode}):\nstdout: {p.stdout}\nstderr: {p.stderr[-3000:]}")
    return p.stdout


@pytest.mark.parametrize("dest,length,what", [
    ("0", "1", "is 0 (NULL)"),
    ("1", "1", "not inside memory registered"),
    ("0xdead0000", "4", "not inside memory registered"),
    ("buf + 8190", "4", "not inside memory registered"),  # runs past the end of the managed buffer
    ("buf - 1", "4", "not inside memory registered"),
    ("2**64 - 1", "1", "not inside memory registered"),
])
def test_write_bytes_to_unregistered_memory(dest, length, what):
    out = run_child(f"""
        buf = e.allocate_managed_buffer(8192)
        assert buf, e.last_error
        rc = e.write_bytes_to_buffer({dest}, b"abcd", {length})
        print("rc", rc, e.last_error)
        assert rc == -_lib.ERR_INVALID_ARGUMENT, (rc, e.last_error)
        assert {what!r} in e.last_error, e.last_error
        assert e.write_bytes_to_buffer(buf + 8188, b"abcd", 4) == 0, e.last_error  # the last bytes are fine
        try:
            e.read_bytes_from_buffer({dest}, {length})
        except ValueError as err:
            assert {what!r} in str(err), err
        else:
            raise AssertionError("read_bytes_from_buffer of unregistered memory did not raise")
        assert e.read_bytes_from_buffer(buf + 8188, 4) == b"abcd"
    """)
    assert "rc -1" in out


def test_write_bytes_to_device_memory_refused():
    """Memory registered as cuda:N is refused by the host copy (an address
    kvxfer cannot memmove into), before anything is touched."""
    run_child("""
        # register_memory only records the location here: the tcp transport
        # may refuse device memory on a host without CUDA, then there is
        # nothing registered and the range is refused as unregistered.
        hb = kvxfer.HostBuffer(4096)
        rc = e.register_memory(hb.addr, 4096, "cuda:0")
        r = e.write_bytes_to_buffer(hb.addr, b"x", 1)
        assert r == -_lib.ERR_INVALID_ARGUMENT, (r, e.last_error)
        assert ("device memory" in e.last_error) if rc == 0 else ("not inside memory registered" in e.last_error), e.last_error
    """)


def test_batch_submit_count_past_capacity():
    """kvx_batch_submit with n past the batch's capacity returns
    KVX_ERR_INVALID_ARGUMENT, and n past its free indices KVX_ERR_BUSY,
    without reading the array (it ends at a PROT_NONE page here)."""
    run_child("""
        t = kvxfer.TransferEngine()
        assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, t.last_error
        dst = t.allocate_managed_buffer(4096)
        src = e.allocate_managed_buffer(4096)
        seg, code = e._segment(t.segment_name, "test")
        assert seg, e.last_error
        page = mmap.PAGESIZE
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        base = libc.mmap(None, 2 * page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        assert base and base != ctypes.c_void_p(-1).value
        assert libc.mprotect(base + page, page, 0) == 0
        size = ctypes.sizeof(_lib.WriteRequest)
        arr = (_lib.WriteRequest * 2).from_address(base + page - 2 * size)  # two requests, then the guard page
        for i in range(2):
            arr[i].local_addr, arr[i].remote_offset, arr[i].length = src + 64 * i, dst + 64 * i, 64
            arr[i].remote_region, arr[i].count = _lib.REGION_PEER_ADDRESS, 1
        batch = ctypes.c_uint64(0)
        rc, msg = _lib.try_call("kvx_batch_alloc", seg, 2, ctypes.byref(batch))
        assert rc == _lib.OK, msg
        for n in (3, 1 << 20, 0xFFFFFFFF):
            rc, msg = _lib.try_call("kvx_batch_submit", batch.value, arr, n)
            assert rc == _lib.ERR_INVALID_ARGUMENT and "capacity" in msg, (n, rc, msg)
        one = ctypes.cast(ctypes.c_void_p(base + page - size), ctypes.POINTER(_lib.WriteRequest))
        rc, msg = _lib.try_call("kvx_batch_submit", batch.value, one, 1)
        assert rc == _lib.OK, msg
        rc, msg = _lib.try_call("kvx_batch_submit", batch.value, one, 2)
        assert rc == _lib.ERR_BUSY and "1 free" in msg, (rc, msg)
        rc, msg = _lib.try_call("kvx_batch_wait", batch.value, 30000)
        assert rc == _lib.OK, msg
        rc, msg = _lib.try_call("kvx_batch_free", batch.value)
        assert rc == _lib.OK, msg
    """)


def test_transfer_from_unregistered_memory():
    """A transfer whose local buffer is not registered is -6
    (KVX_ERR_NOT_REGISTERED), not a read of the address."""
    run_child("""
        t = kvxfer.TransferEngine()
        assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, t.last_error
        dst = t.allocate_managed_buffer(4096)
        for addr in (1, 0xdead0000):
            rc = e.transfer_sync_write(t.segment_name, addr, dst, 64)
            assert rc == -_lib.ERR_NOT_REGISTERED, (rc, e.last_error)
        rc = e.transfer_sync_write(t.segment_name, 0, dst, 1 << 64)
        assert rc < 0, rc
    """)
