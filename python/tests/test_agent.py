"""kvxfer.Agent (kvx_agent_*) in one process: two agents on tcp and shm, a
WRITE and a READ with notifications, states, wait, cancel of a finished
request, telemetry, notifications larger than get_notifs' first buffer,
and the refusals."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvxfer
from kvxfer import agent as A

BLOCK = 4096
BLOCKS = 8


def blocks(buf):
    return [(buf.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)]


@pytest.fixture(params=["tcp", "shm"])
def pair(request):
    made = []

    def mk(name, fill):
        a = A.Agent(name, transport=request.param)
        if request.param == "shm":
            hb = kvxfer.HostBuffer(BLOCKS * BLOCK, name)
            buf = hb.numpy()
            made.append(hb)
        else:
            buf = np.zeros(BLOCKS * BLOCK, dtype=np.uint8)
        if fill:
            buf[:] = np.arange(buf.size) // BLOCK + 1
        reg = a.register([(buf.ctypes.data, buf.nbytes, 0)], "DRAM")
        made.append(a)
        return a, buf, reg

    p, pbuf, _ = mk("p", True)
    d, dbuf, _ = mk("d", False)
    yield p, pbuf, d, dbuf
    for m in reversed(made):
        m.close()


def wait_notifs(a, sender, n):
    got = []
    for _ in range(3000):
        got += a.get_notifs().get(sender, [])
        if len(got) >= n:
            return got
        time.sleep(0.01)
    raise AssertionError(f"{a.name}: {len(got)} of {n} notifications from {sender}")


def test_read_write_notify(pair):
    p, pbuf, d, dbuf = pair
    assert d.add_remote(p.metadata()) == "p"
    local = d.prep_dlist(A.AGENT_LOCAL, blocks(dbuf))
    remote = d.prep_dlist("p", blocks(pbuf))
    x = d.make_xfer("READ", local, [1, 2], remote, np.array([5, 6]), notif=b"r:1")
    assert d.state(x)[0] == A.NOT_POSTED
    assert d.post(x) == A.PROC
    st, why = d.wait(x, 30)
    assert st == A.DONE and why == "", why
    assert A.STATE_NAMES[st] == "DONE"
    assert wait_notifs(p, "d", 1) == [b"r:1"]
    assert (dbuf[BLOCK:2 * BLOCK] == 6).all() and (dbuf[2 * BLOCK:3 * BLOCK] == 7).all()
    t = d.telemetry(x)
    assert t.total_bytes == 2 * BLOCK and t.desc_count == 2 and t.start_us > 0
    assert d.cancel(x) == A.DONE  # nothing in flight: the final state
    d.release(x)
    with pytest.raises(kvxfer.KvxError) as e:
        d.state(x)
    assert e.value.status == kvxfer._lib.ERR_BAD_HANDLE
    # WRITE: local block 1 (now the prefill's block 5) into the prefill's block 0.
    w = d.make_xfer("WRITE", local, [1], remote, [0], notif="w:1")
    d.post(w)
    assert d.wait(w, 30)[0] == A.DONE
    assert wait_notifs(p, "d", 1) == [b"w:1"]
    assert (pbuf[:BLOCK] == 6).all()


def test_notifications_larger_than_the_first_buffer(pair):
    p, _, d, _ = pair
    d.add_remote(p.metadata())
    msgs = [bytes([i]) * (60 << 10) for i in range(3)]  # 180 KiB in all
    for m in msgs:
        d.send_notif("p", m)
    assert wait_notifs(p, "d", 3) == msgs


def test_refusals(pair):
    p, pbuf, d, dbuf = pair
    with pytest.raises(kvxfer.KvxError) as e:
        d.prep_dlist("p", blocks(pbuf))
    assert e.value.status == kvxfer._lib.ERR_NOT_FOUND and "unknown remote agent" in str(e.value)
    d.add_remote(p.metadata())
    local, remote = d.prep_dlist("", blocks(dbuf)), d.prep_dlist("p", blocks(pbuf))
    with pytest.raises(kvxfer.KvxError) as e:
        d.make_xfer("READ", local, [BLOCKS], remote, [0])
    assert e.value.status == kvxfer._lib.ERR_INVALID_ARGUMENT and f"local index {BLOCKS}" in str(e.value)
    with pytest.raises(ValueError):
        d.make_xfer("COPY", local, [0], remote, [0])
    with pytest.raises(ValueError):
        d.register([(1, 2)], "DRAM")
    with pytest.raises(ValueError, match="DRAM"):
        d.prep_dlist("", blocks(dbuf), "FILE")
    with pytest.raises(kvxfer.KvxError) as e:
        d.prep_dlist("", [(dbuf.ctypes.data + dbuf.nbytes, 64, 0)])
    assert e.value.status == kvxfer._lib.ERR_NOT_REGISTERED
    p.remove_remote("d")  # the prefill fences the decode
    x = d.make_xfer("READ", local, [0], remote, [0])
    try:
        d.post(x)
        st, why = d.wait(x, 30)
    except kvxfer.KvxError as e2:
        st, why = A.ERR, str(e2)
    assert st == A.ERR and why
    assert (dbuf[:BLOCK] == 0).all()
    with pytest.raises(kvxfer.KvxError) as e:
        d.send_notif("p", b"late")
    assert e.value.status == kvxfer._lib.ERR_PEER_LOST and "removed" in str(e.value)
