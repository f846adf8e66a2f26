"""Mooncake behaviour beyond the method names: integer-like addresses,
get_engine(), MC_FORCE_TCP, host names in initialize, the HTTP metadata server
(Mooncake's routes and rules, its Python class and command) with its faults,
and the ``mooncake`` shim package."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest

import kvxfer
from kvxfer import engine as kengine
from conftest import HERE, peer_bytes, wait_until

MiB = 1 << 20
PY = os.path.join(HERE, "..")


class Index:
    """An integer-like object (what pybind11 accepts through __index__)."""

    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


@pytest.mark.parametrize("conv", [np.uint64, np.int64, Index, int], ids=["np.uint64", "np.int64", "__index__", "int"])
def test_integer_like_addresses(peers, local, conv):
    """Every address, length and id argument takes numpy integers and
    __index__ objects, as Mooncake's pybind11 binding does (before: -1
    "read-only buffer")."""
    target = peers("mooncake", "--protocol", "tcp")
    name, regions = target.ready["name"], target.ready["regions"]
    src = np.arange(2 * 4096, dtype=np.uint8)
    base = src.ctypes.data
    assert local.register_memory(conv(base), conv(src.nbytes)) == 0, local.last_error
    assert local.transfer_sync_write(name, conv(base), conv(regions["b"]), conv(4096)) == 0, local.last_error
    assert peer_bytes(target, regions["b"], 4096) == src[:4096].tobytes()
    addrs = np.array([base, base + 4096], dtype=np.uint64)  # numpy array elements are numpy scalars
    dsts = np.array([regions["a"], regions["a"] + 8192], dtype=np.int64)
    lens = np.array([4096, 4096], dtype=np.int64)
    assert local.batch_transfer_sync_write(name, [conv(int(x)) for x in addrs], [conv(int(x)) for x in dsts], [conv(int(x)) for x in lens]) == 0
    assert local.batch_transfer_sync_write(name, list(addrs), list(dsts), list(lens)) == 0, local.last_error
    assert peer_bytes(target, regions["a"] + 8192, 4096) == src[4096:].tobytes()
    bid = local.transfer_submit_write(name, conv(base), conv(regions["a"]), conv(64))
    assert bid > 0, local.last_error
    assert wait_until(lambda: local.transfer_check_status(conv(bid)) or None) == 1
    buf = local.allocate_managed_buffer(conv(8192))
    assert buf != 0, local.last_error
    assert local.write_bytes_to_buffer(conv(buf), b"abcdef", conv(6)) == 0
    assert local.read_bytes_from_buffer(conv(buf + 2), conv(3)) == b"cde"
    assert local.free_managed_buffer(conv(buf), conv(8192)) == 0
    assert local.unregister_memory(conv(base)) == 0, local.last_error


def test_bad_integer_arguments(local):
    src = np.zeros(64, dtype=np.uint8)
    assert local.register_memory(np.int64(-1), 64) == -kvxfer._lib.ERR_INVALID_ARGUMENT
    assert "not an address" in local.last_error
    assert local.register_memory(src.ctypes.data, 64.0) == -kvxfer._lib.ERR_INVALID_ARGUMENT
    assert "not an integer" in local.last_error
    assert local.batch_transfer_sync_write("127.0.0.1:1", [src.ctypes.data], [1.5], [8]) == -kvxfer._lib.ERR_INVALID_ARGUMENT
    assert local.write_bytes_to_buffer(-5, b"x", 1) == -kvxfer._lib.ERR_INVALID_ARGUMENT
    assert local.transfer_check_status("7") == -1
    with pytest.raises(ValueError):
        local.read_bytes_from_buffer(0, 4)
    with pytest.raises(TypeError):
        kvxfer.address_of(True)


def test_get_engine():
    e = kvxfer.TransferEngine()
    try:
        assert e.get_engine() is None  # Mooncake's engine is null before initialize
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        inner = e.get_engine()
        assert isinstance(inner, kengine.InnerTransferEngine)
        assert inner is e.get_engine()
        assert inner.handle == e.get_engine_ptr() != 0
        assert inner.segment_name == e.segment_name and inner.transport == "tcp"
    finally:
        e.close()


@pytest.mark.parametrize(
    "value,forced",
    [(None, False), ("1", True), ("true", True), ("", True), ("yes", True), ("0", False), ("false", False), ("OFF", False)],
)
def test_force_tcp_values(value, forced):
    env = {} if value is None else {"MC_FORCE_TCP": value}
    assert kengine.force_tcp(env) is forced


def test_force_tcp_turns_rdma_into_tcp(monkeypatch):
    """Older SGLang always passes protocol "rdma"; MC_FORCE_TCP=1 runs it on
    tcp, as Mooncake's engine does."""
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    for proto in ("rdma", "auto", "shm"):
        e = kvxfer.TransferEngine()
        try:
            assert e.initialize("127.0.0.1", "P2PHANDSHAKE", proto, "mlx5_0") == 0, e.last_error
            assert e.transport == "tcp"
        finally:
            e.close()
    monkeypatch.setenv("MC_FORCE_TCP", "0")
    e = kvxfer.TransferEngine()
    try:
        rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "")
        assert rc != 0 or e.transport == "rdma"  # not forced: real RDMA or its error
    finally:
        e.close()


def local_names():
    names = ["localhost"]
    h = socket.gethostname()
    try:
        ip = socket.gethostbyname(h)
    except OSError:
        return names
    if ip.startswith("127.") or ip in {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}:
        names.append(h)
    return names


@pytest.mark.parametrize("hostname", local_names())
def test_host_name_as_local_hostname(peers, hostname):
    """initialize("localhost", ...) and this machine's name (before: "no such
    device"): the engine is named "name:rpc_port", and a peer process writes
    to it by that name, as LMCache and SGLang build their session ids."""
    e = kvxfer.TransferEngine()
    try:
        assert e.initialize(hostname, "P2PHANDSHAKE", "tcp", "") == 0, e.last_error
        session = f"{hostname}:{e.get_rpc_port()}"
        assert e.segment_name == session
        dst = np.zeros(MiB, dtype=np.uint8)
        assert e.register_memory(dst.ctypes.data, dst.nbytes) == 0
        writer = kvxfer.TransferEngine()
        try:
            assert writer.initialize(hostname, "P2PHANDSHAKE", "tcp", "") == 0
            src = np.full(4096, 7, dtype=np.uint8)
            assert writer.register_memory(src.ctypes.data, src.nbytes) == 0
            assert writer.transfer_sync_write(session, src.ctypes.data, dst.ctypes.data + 100, 4096) == 0, writer.last_error
            assert dst[100:4196].tolist() == [7] * 4096
        finally:
            writer.close()
    finally:
        e.close()
    bad = kvxfer.TransferEngine()
    assert bad.initialize("no-such-host.invalid", "P2PHANDSHAKE", "tcp", "") == -kvxfer._lib.ERR_INVALID_ARGUMENT
    assert "no-such-host.invalid" in bad.last_error and "does not resolve" in bad.last_error
    bad.close()


# ---------------------------------------------------------------------------
# HTTP metadata server
# ---------------------------------------------------------------------------
def http(method, url, key=None, body=None):
    """(status, body bytes, content type) of one request; key None = no key
    parameter at all."""
    u = url if key is None else url + "?key=" + urllib.parse.quote(key, safe="")
    req = urllib.request.Request(u, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers.get("Content-Type", "")


def test_metadata_server_mooncake_rules():
    """The assertions of Mooncake's test_http_metadata_server.py over HTTP,
    and the C++ server's rpc_meta rule."""
    with kvxfer.MetadataServer() as srv:
        url = srv.url
        for m in ("GET", "PUT", "DELETE"):  # missing key: 400 for every method
            assert http(m, url, body=b"value" if m == "PUT" else None)[0] == 400
        assert http("PUT", url, "", b"value")[0] == 400  # empty key
        assert http("PUT", url, "   ", b"value")[0] == 400  # blank key
        assert http("GET", url, "")[0] == 400
        # keys are stripped before use
        assert http("PUT", url, "  valid  ", b"value")[:2] == (200, b"metadata updated")
        st, body, ctype = http("GET", url, "  valid  ")
        assert (st, body) == (200, b"value") and ctype.startswith("application/json")
        assert http("GET", url, "valid")[:2] == (200, b"value")
        # round trip, delete, absent
        assert http("PUT", url, "mooncake/ram/127.0.0.1:12345", b'{"buffers":[]}')[0] == 200
        assert http("GET", url, "mooncake/ram/127.0.0.1:12345")[:2] == (200, b'{"buffers":[]}')
        assert http("DELETE", url, "mooncake/ram/127.0.0.1:12345")[:2] == (200, b"metadata deleted")
        assert http("GET", url, "mooncake/ram/127.0.0.1:12345")[0] == 404
        assert http("DELETE", url, "mooncake/ram/127.0.0.1:12345")[0] == 404
        # rpc_meta keys are written once
        assert http("PUT", url, "mooncake/rpc_meta/h:1", b'{"rpc_port":1}')[0] == 200
        assert http("PUT", url, "mooncake/rpc_meta/h:1", b'{"rpc_port":1}')[:2] == (200, b"metadata unchanged")
        st, body, _ = http("PUT", url, "mooncake/rpc_meta/h:1", b'{"rpc_port":2}')
        assert st == 400 and b"Duplicate rpc_meta" in body
        assert http("GET", url, "mooncake/rpc_meta/h:1")[1] == b'{"rpc_port":1}'
        assert http("POST", url, "x", b"v")[0] == 405
        assert http("GET", "http://" + srv.addr + "/health")[:2] == (200, b"OK")
    assert not srv.running


def test_metadata_server_bad_input_never_crashes():
    """Malformed query strings, control bytes, oversized keys and a client
    that hangs up mid-body: each answered (or dropped) without a crash, and
    the server keeps answering."""
    with kvxfer.MetadataServer() as srv:
        host, port = srv.addr.rsplit(":", 1)
        for raw in (b"GET /metadata?key=%zz HTTP/1.0\r\n\r\n", b"PUT /metadata?key=a%00b HTTP/1.0\r\nContent-Length: 1\r\n\r\nx",
                    b"GET /metadata?key=" + b"k" * 5000 + b" HTTP/1.0\r\n\r\n", b"\x00\xff garbage\r\n\r\n",
                    b"PUT /metadata?key=cut HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nabc"):
            with socket.create_connection((host, int(port)), timeout=10) as c:
                c.sendall(raw)
                c.shutdown(socket.SHUT_WR)
                reply = c.recv(200)
            assert raw.startswith(b"PUT /metadata?key=cut") or reply.startswith(b"HTTP/1.") and (b" 400 " in reply[:13]), (raw[:40], reply)
        assert http("GET", srv.url, "cut")[0] == 404
        assert http("PUT", srv.url, "still-up", b"1")[0] == 200


def test_mooncake_http_metadata_server_shim():
    """mooncake.http_metadata_server: Mooncake's KVBootstrapServer class and
    its command, on kvxfer's server."""
    from mooncake.http_metadata_server import KVBootstrapServer, KVPoll

    s = KVBootstrapServer(port=0, host="127.0.0.1")
    assert s.poll() == KVPoll.Failed
    s.run()
    try:
        assert s.poll() == KVPoll.Success
        assert http("PUT", f"http://{s.addr}/metadata", "k", b"v")[0] == 200
    finally:
        s.close()
    assert s.poll() == KVPoll.Failed
    env = dict(os.environ, PYTHONPATH=PY + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "mooncake.http_metadata_server", "--port", "0", "--host", "127.0.0.1"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = p.stdout.readline()
        assert line.startswith("metadata server listening on http://127.0.0.1:"), line
        url = line.split(" on ", 1)[1].strip()
        assert http("PUT", url, "k", b"v")[0] == 200 and http("GET", url, "k")[1] == b"v"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
    # A port in use: the command says so and exits 1.
    with kvxfer.MetadataServer() as busy:
        port = busy.addr.rsplit(":", 1)[1]
        r = subprocess.run([sys.executable, "-m", "mooncake.http_metadata_server", "--port", port, "--host", "127.0.0.1"],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 1 and "address already in use" in r.stderr


def test_http_metadata_faults(peers):
    """Engines in HTTP metadata mode when the peer dies, the metadata server
    dies, and the server holds something that is not a descriptor."""
    srv = kvxfer.MetadataServer()
    target = peers("mooncake", "--target", "--name", "target-a", "--metadata", srv.url, "--protocol", "tcp")
    e = kvxfer.TransferEngine()
    try:
        assert e.initialize("initiator-a", srv.url, "tcp", "") == 0, e.last_error
        assert e.segment_name == "initiator-a"  # named as given, with a metadata server
        src = np.arange(4096, dtype=np.uint8)
        assert e.register_memory(src.ctypes.data, src.nbytes) == 0
        dst = target.ready["regions"]["a"]
        assert e.transfer_sync_write("target-a", src.ctypes.data, dst, 4096) == 0, e.last_error
        # A record that is not a kvxfer descriptor: refused, named.
        assert http("PUT", srv.url, "kvxfer/segments/junk", b"{not a descriptor")[0] == 200
        assert e.send_probe("junk") < 0
        assert "junk" in e.last_error
        # The metadata server dies: the open segment keeps working, a new
        # name cannot be resolved (-20, naming the server).
        srv.close()
        assert e.transfer_sync_write("target-a", src.ctypes.data, dst + 4096, 4096) == 0, e.last_error
        assert peer_bytes(target, dst + 4096, 4096) == src.tobytes()
        assert e.send_probe("target-b") == -kvxfer._lib.ERR_METADATA
        assert srv.url in e.last_error
        # The peer dies (SIGKILL): the next transfers fail, and do not hang.
        target.kill()
        t0 = time.monotonic()
        assert e.transfer_sync_write("target-a", src.ctypes.data, dst, 4096) < 0
        bid = e.transfer_submit_write("target-a", src.ctypes.data, dst, 4096)
        if bid:
            assert wait_until(lambda: e.transfer_check_status(bid) or None) in (-1, -2)
        else:
            assert e.transfer_check_status(0) == -1
        assert time.monotonic() - t0 < 40
    finally:
        e.close()
        srv.close()


def test_mooncake_shim_package():
    """`from mooncake.engine import TransferEngine` is kvxfer's (no edit to
    the caller); what kvxfer does not provide fails to import as on a
    Mooncake install without it."""
    import mooncake
    import mooncake.engine as me

    assert mooncake.KVXFER_SHIM is True
    assert me.TransferEngine is kvxfer.TransferEngine
    assert me.TransferOpcode.Read == 0 and me.TransferOpcode.Write == 1 and me.Write == me.TransferOpcode.Write
    assert me.TransferEngine.TransferOpcode is me.TransferOpcode
    assert me.SUPPORT_CUDA is False and me.SUPPORT_MUSA is False
    with pytest.raises(ModuleNotFoundError):
        import mooncake.store  # noqa: F401
    # Importing the shim loads nothing: a process without the library can import it.
    r = subprocess.run([sys.executable, "-c", "import mooncake.engine, kvxfer._lib as l; print(l._lib is None)"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=PY, KVXFER_LIBRARY="/nonexistent/libkvxfer.so"))
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr


def test_mooncake_env_in_peer(peers):
    """MC_TRANSFER_TIMEOUT and MC_METADATA_SERVER are read where Mooncake
    reads them (constructor; initialize with an empty metadata_server)."""
    with kvxfer.MetadataServer() as srv:
        target = peers("mooncake", "--target", "--name", "env-target", "--metadata", srv.url, "--protocol", "tcp")
        old = {k: os.environ.get(k) for k in ("MC_METADATA_SERVER", "MC_TRANSFER_TIMEOUT")}
        os.environ.update(MC_METADATA_SERVER=srv.url, MC_TRANSFER_TIMEOUT="7")
        try:
            e = kvxfer.TransferEngine()
            assert e.transfer_timeout_ns == 7 * 10**9
            assert e.initialize("env-initiator", "", "tcp", "") == 0, e.last_error
            assert e.get_first_buffer_address("env-target") == target.ready["regions"]["a"]
            e.close()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
