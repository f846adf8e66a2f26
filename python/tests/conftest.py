"""Test helpers: peer processes (tests/peer.py) spoken to in JSON lines, with
deadlines so that nothing hangs."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

#: Generous: the CI machine is shared by several jobs.
DEADLINE = float(os.environ.get("KVXFER_TEST_DEADLINE", "60"))


class Peer:
    """A tests/peer.py process. send() a command, recv() its JSON answer
    (with a deadline), kill() it; close() ends it in any case."""

    def __init__(self, *args, env=None):
        e = dict(os.environ)
        e.update(env or {})
        self.args = args
        self.p = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "peer.py"), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=e,
        )
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.recv()
        assert self.ready.get("event") == "ready", f"peer {args} did not start: {self.ready}"

    def _read(self):
        for line in self.p.stdout:
            self._q.put(line)
        self._q.put(None)

    def send(self, obj):
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def recv(self, timeout=DEADLINE):
        try:
            line = self._q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"peer {self.args}: no answer within {timeout} s") from None
        if line is None:
            raise AssertionError(f"peer {self.args} exited (status {self.p.wait()}) without answering")
        return json.loads(line)

    def try_recv(self):
        """The next JSON answer if one has arrived, else None (never waits);
        AssertionError when the peer exited."""
        try:
            line = self._q.get_nowait()
        except queue.Empty:
            return None
        if line is None:
            self._q.put(None)
            raise AssertionError(f"peer {self.args} exited (status {self.p.wait()})")
        return json.loads(line)

    def call(self, obj, timeout=DEADLINE):
        self.send(obj)
        return self.recv(timeout)

    def kill(self, sig=signal.SIGKILL):
        self.p.send_signal(sig)
        if sig == signal.SIGKILL:
            self.p.wait(timeout=DEADLINE)

    def close(self):
        if self.p.poll() is None:
            try:
                self.send({"cmd": "exit"})
                self.p.wait(timeout=10)
            except Exception:
                self.p.kill()
                self.p.wait()
        for f in (self.p.stdin, self.p.stdout):
            try:
                f.close()
            except Exception:
                pass


@pytest.fixture
def peers():
    """Start peers with peers(*args); all are ended after the test."""
    started = []

    def start(*args, env=None):
        p = Peer(*args, env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


def wait_until(cond, timeout=DEADLINE, what="condition"):
    """Poll cond() until true (returns its value) or fail after timeout."""
    end = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.01)


@pytest.fixture
def local():
    """An initialized tcp kvxfer.TransferEngine in this process (P2P)."""
    import kvxfer

    e = kvxfer.TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, e.last_error
    yield e
    e.close()


def peer_bytes(peer, addr, n) -> bytes:
    """n bytes at addr in a tests/peer.py mooncake peer's memory."""
    return bytes.fromhex(peer.call({"cmd": "read", "addr": int(addr), "len": int(n)})["hex"])
