"""vLLM's NixlConnector on kvxfer through the ``nixl`` package, in two
processes: this one is the decode worker, tests/nixl_peer.py the prefill
worker. The calls, their arguments and their order are those of vLLM's
NixlConnectorWorker (register_kv_caches, the handshake, add_remote_agent,
_read_blocks, _pop_done_transfers, _get_new_notifs, shutdown); then the
faults: a bad descriptor index, an unknown agent, a removed agent, a
prefill killed around a read."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from conftest import DEADLINE, HERE, wait_until

import nixl_peer as P  # noqa: E402  (the geometry and pattern)
from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402
from nixl._bindings import (  # noqa: E402
    nixlInvalidParamError,
    nixlNotFoundError,
    nixlRemoteDisconnectError,
    nixlXferTelemetry,
)


class Prefill:
    """tests/nixl_peer.py: send() a command, recv() its answer."""

    def __init__(self, transport="tcp"):
        env = dict(os.environ, KVXFER_TRANSPORT=transport)
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "nixl_peer.py")], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.recv()
        assert self.ready.get("event") == "ready", self.ready

    def _read(self):
        for line in self.p.stdout:
            self.q.put(line)
        self.q.put(None)

    def recv(self, timeout=DEADLINE):
        try:
            line = self.q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"prefill: no answer within {timeout} s") from None
        assert line is not None, f"prefill exited with status {self.p.wait()}"
        return json.loads(line)

    def call(self, obj, timeout=DEADLINE):
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()
        return self.recv(timeout)

    def kill(self):
        self.p.send_signal(signal.SIGKILL)
        self.p.wait(timeout=DEADLINE)

    def close(self):
        if self.p.poll() is None:
            try:
                self.call({"cmd": "exit"}, timeout=1)
            except Exception:
                pass
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


@pytest.fixture(params=["tcp", "cma"])
def transport(request, monkeypatch):
    """Both workers' transport: tcp, and cma (same host, the caller's own
    numpy/torch memory; shm would need kvxfer's memfd memory)."""
    monkeypatch.setenv("KVXFER_TRANSPORT", request.param)
    return request.param


@pytest.fixture
def prefill(transport):
    p = Prefill(transport)
    yield p
    p.close()


class Decode:
    """The decode worker's nixl state, built the way NixlConnectorWorker
    builds it."""

    def __init__(self):
        self.agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(num_threads=4, capture_telemetry=True))
        self.caches = P.make_caches(False)
        self.descs, self.local = P.register(self.agent, self.caches)
        self.num_regions = len(self.caches)
        self.remote = None
        self.remote_name = None

    def add_remote_agent(self, hs):
        """add_remote_agent: load the metadata, prepare the remote blocks."""
        self.remote_name = self.agent.add_remote_agent(bytes.fromhex(hs["agent_metadata"]))
        blocks = [(base + b * hs["block_lens"][i], P.BLOCK_LEN, hs["device_id"])
                  for i, base in enumerate(hs["kv_caches_base_addr"]) for b in range(hs["num_blocks"])]
        self.remote = self.agent.prep_xfer_dlist(self.remote_name, self.agent.get_xfer_descs(blocks, "DRAM"))
        return self.remote_name

    def desc_ids(self, block_ids):
        """_get_block_descs_ids: region_id * num_blocks + block_id."""
        region_ids = np.arange(self.num_regions)[:, None]
        return (region_ids * P.NUM_BLOCKS + np.array(block_ids)[None, :]).flatten()

    def read(self, req, local_blocks, remote_blocks):
        """_read_blocks: make_prepped_xfer("READ", ...) and transfer."""
        h = self.agent.make_prepped_xfer("READ", self.local, self.desc_ids(local_blocks), self.remote,
                                         self.desc_ids(remote_blocks), notif_msg=f"{req}:1".encode())
        return h, self.agent.transfer(h)

    def wait_done(self, h):
        """_pop_done_transfers: poll check_xfer_state until it is not PROC."""
        return wait_until(lambda: (s := self.agent.check_xfer_state(h)) != "PROC" and s, what="transfer end")

    def close(self):
        """shutdown's order."""
        self.agent.release_dlist_handle(self.local)
        if self.remote is not None:
            self.agent.release_dlist_handle(self.remote)
        if self.remote_name is not None:
            self.agent.remove_remote_agent(self.remote_name)
        self.agent.deregister_memory(self.descs)
        self.agent.close()


@pytest.fixture
def decode(transport):
    d = Decode()
    yield d
    d.close()


def test_nixl_connector_order(prefill, decode):
    hs = prefill.ready["handshake"]
    assert decode.add_remote_agent(hs) == prefill.ready["agent"]
    # The prefill finished request "req-1" and holds its blocks for the decode.
    remote_blocks, local_blocks = [3, 4, 17, 30], [0, 1, 8, 9]
    assert prefill.call({"cmd": "hold", "req": "req-1", "blocks": remote_blocks}) == {"held": "req-1"}
    h, st = decode.read("req-1", local_blocks, remote_blocks)
    assert st in ("PROC", "DONE")
    assert decode.wait_done(h) == "DONE", decode.agent.xfer_error(h)
    # DONE on the decode; the prefill frees the blocks only on the
    # notification, which came after the data: the decode holds the pattern,
    # not the 0xEE of a freed block.
    assert prefill.call({"cmd": "wait_freed", "req": "req-1"}) == {"freed": True, "sender": decode.agent.name}
    for r, c in enumerate(decode.caches):
        for lb, rb in zip(local_blocks, remote_blocks):
            assert (c[lb] == P.pattern(r, rb)).all(), f"region {r} block {lb}"
        assert (c[2] == 0).all()
    t = decode.agent.get_xfer_telemetry(h)
    assert isinstance(t, nixlXferTelemetry)
    assert t.totalBytes == decode.num_regions * len(local_blocks) * P.BLOCK_LEN
    assert t.descCount == decode.num_regions * len(local_blocks)
    assert t.xferDuration >= t.postDuration >= 0 and t.startTime > 0
    decode.agent.release_xfer_handle(h)
    # A full prefix-cache hit: a notification on its own frees the blocks.
    prefill.call({"cmd": "hold", "req": "req-2", "blocks": [5]})
    decode.agent.send_notif(decode.remote_name, notif_msg=b"req-2:1")
    assert prefill.call({"cmd": "wait_freed", "req": "req-2"})["freed"]
    assert prefill.call({"cmd": "status"}) == {"held": [], "freed": ["req-1", "req-2"]}


def test_bad_index_and_unknown_agent(prefill, decode):
    decode.add_remote_agent(prefill.ready["handshake"])
    n = decode.num_regions * P.NUM_BLOCKS
    with pytest.raises(nixlInvalidParamError, match=f"remote index {n}"):
        decode.agent.make_prepped_xfer("READ", decode.local, [0], decode.remote, [n], notif_msg=b"x:1")
    with pytest.raises(nixlInvalidParamError, match="local index -1"):
        decode.agent.make_prepped_xfer("READ", decode.local, np.array([-1]), decode.remote, np.array([0]))
    with pytest.raises(nixlInvalidParamError, match="want the same number"):
        decode.agent.make_prepped_xfer("READ", decode.local, [0, 1], decode.remote, [0])
    with pytest.raises(nixlNotFoundError, match="unknown remote agent"):
        decode.agent.prep_xfer_dlist("no-such-agent", [(0x1000, 16, 0)], "DRAM")
    with pytest.raises(nixlNotFoundError):
        decode.agent.send_notif("no-such-agent", notif_msg=b"x")
    with pytest.raises(nixlInvalidParamError, match="magic"):
        decode.agent.add_remote_agent(b"\x80\x04 a pickled NIXL metadata blob.....")
    outside = [(prefill.ready["handshake"]["kv_caches_base_addr"][0] + P.NUM_BLOCKS * P.BLOCK_LEN * 1024, 64, 0)]
    with pytest.raises(nixlInvalidParamError, match="not inside any region"):
        decode.agent.prep_xfer_dlist(decode.remote_name, outside, "DRAM")
    assert decode.agent.check_remote_metadata(decode.remote_name)
    assert not decode.agent.check_remote_metadata("no-such-agent")
    # Nothing was written by the refused requests.
    assert all((c == 0).all() for c in decode.caches)


def test_removed_agent_is_refused(prefill, decode):
    decode.add_remote_agent(prefill.ready["handshake"])
    h, _ = decode.read("req-3", [0], [0])
    assert decode.wait_done(h) == "DONE"
    decode.agent.release_xfer_handle(h)
    assert prefill.call({"cmd": "remove", "agent": decode.agent.name}) == {"removed": decode.agent.name}
    decode.caches[0][1] = 0
    h, st = decode.read("req-4", [1], [1])
    assert st == "ERR" or decode.wait_done(h) == "ERR"
    assert (decode.caches[0][1] == 0).all(), "a read through a fenced data path landed"
    with pytest.raises(nixlRemoteDisconnectError, match="removed"):
        decode.agent.send_notif(decode.remote_name, notif_msg=b"req-4:1")
    decode.agent.release_xfer_handle(h)


def test_prefill_killed_around_a_read(prefill, decode):
    decode.add_remote_agent(prefill.ready["handshake"])
    every = list(range(P.NUM_BLOCKS))
    h, _ = decode.read("req-5", every, every)
    prefill.kill()
    st = decode.wait_done(h)
    if st == "DONE":  # the read finished before the kill: then it is whole
        for r, c in enumerate(decode.caches):
            assert all((c[b] == P.pattern(r, b)).all() for b in every), f"region {r}: DONE with partial data"
    else:
        assert st == "ERR", st
    decode.agent.release_xfer_handle(h)
    # After the kill every read fails, and says why.
    h, st = decode.read("req-6", [2], [2])
    assert st == "ERR" or decode.wait_done(h) == "ERR"
    assert decode.agent.xfer_error(h)
    with pytest.raises(nixlRemoteDisconnectError):
        decode.agent.send_notif(decode.remote_name, notif_msg=b"req-6:1")
    decode.agent.release_xfer_handle(h)
    # shutdown after the peer died still works (the remove is local).
