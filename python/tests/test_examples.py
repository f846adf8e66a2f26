"""The two Python examples of python/README.md, both sides of each, run as
two processes exactly as the README shows them (issue 26): the README's
blocks are the files in python/examples/, and each pair transfers and checks
its bytes."""

from __future__ import annotations

import os
import http.server
import socket
import subprocess
import sys
import threading

from conftest import DEADLINE

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)
EXAMPLES = os.path.join(PYDIR, "examples")
PAIRS = [("mooncake_target.py", "mooncake_initiator.py"), ("sglang_prefill.py", "sglang_decode.py")]


def _env():
    e = dict(os.environ)
    e.pop("KVXFER_LOG_LEVEL", None)  # the examples' own default: only their line on an error
    e["PYTHONPATH"] = PYDIR + os.pathsep + e.get("PYTHONPATH", "")
    return e


def _start(script, *args):
    return subprocess.Popen([sys.executable, script, *args], cwd=EXAMPLES, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(p, name):
    try:
        out, _ = p.communicate(timeout=2 * DEADLINE)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"{name} did not finish within {2 * DEADLINE} s:\n{out}") from None
    assert p.returncode == 0, f"{name} exited {p.returncode}:\n{out}"
    return out


def _line(p, want):
    """The first line of p's output that contains want (log lines before it
    are skipped); fails at its end of output."""
    seen = []
    for line in p.stdout:
        if want in line:
            return line
        seen.append(line)
    raise AssertionError(f"no line with {want!r} (exit {p.wait()}):\n{''.join(seen)}")


def test_readme_shows_the_examples():
    readme = open(os.path.join(PYDIR, "README.md")).read()
    for pair in PAIRS:
        for name in pair:
            text = open(os.path.join(EXAMPLES, name)).read()
            assert "```python\n" + text + "```\n" in readme, f"python/README.md does not show {name} as it is"


def test_mooncake_pair():
    target = _start("mooncake_target.py")
    try:
        cmd = _line(target, "python3 mooncake_initiator.py ").split()  # "python3 mooncake_initiator.py PORT ADDR"
        assert cmd[:2] == ["python3", "mooncake_initiator.py"] and len(cmd) == 4, cmd
        out = _finish(_start(*cmd[1:]), "mooncake_initiator.py")
        assert "initiator: wrote 1048576 bytes" in out, out
        out = _finish(target, "mooncake_target.py")
        assert "target: 1048576 bytes received and checked" in out, out
    finally:
        target.kill()


def test_sglang_pair():
    with socket.socket() as s:  # a free port for the bootstrap directory
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    prefill = _start("sglang_prefill.py", port)
    try:
        _line(prefill, "prefill: room 42 waiting for its decode")
        out = _finish(_start("sglang_decode.py", port), "sglang_decode.py")
        assert "decode: room 42 received into pages [10, 11, 12, 13] and checked" in out, out
        out = _finish(prefill, "sglang_prefill.py")
        assert "prefill: room 42 sent; the decode verified it" in out, out
    finally:
        prefill.kill()


def _port_in_use():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_bad_arguments_one_line():
    """A bad argument, or a bootstrap port another process holds, ends an
    example with exit status != 0 and one line on stderr naming what was
    wrong (and, for the port, the argument that sets it: the examples have
    no --port), not a traceback."""
    busy = _port_in_use()
    with busy:
        port = str(busy.getsockname()[1])
        cases = [
            (["mooncake_initiator.py"], ["required: RPC_PORT, BUFFER_ADDRESS", "usage: mooncake_initiator.py"]),
            (["mooncake_initiator.py", "x", "1"], ["argument RPC_PORT: invalid int value: 'x'"]),
            (["mooncake_initiator.py", "99999", "1"], ["RPC_PORT 99999", "1-65535"]),
            (["mooncake_initiator.py", "-5", "1"], ["RPC_PORT -5", "1-65535"]),
            (["mooncake_target.py", "extra"], ["unrecognized arguments: extra"]),
            (["sglang_decode.py", "abc"], ["argument BOOTSTRAP_PORT: invalid int value: 'abc'"]),
            (["sglang_decode.py", "0"], ["BOOTSTRAP_PORT 0", "1-65535"]),
            (["sglang_prefill.py", "70000"], ["BOOTSTRAP_PORT 70000", "1-65535"]),
            (["sglang_prefill.py", port], [f"port {port}", "address already in use", "BOOTSTRAP_PORT argument"]),
        ]
        for argv, want in cases:
            line = _one_error_line(argv, argv[0] + ": ", want)
            assert "--port" not in line, line


def _one_error_line(argv, prefix, want):
    """Runs the example argv (script and arguments) and checks it failed
    with exactly one non-empty stderr line, no traceback, starting with
    prefix and holding every string of want; returns that line."""
    p = subprocess.run([sys.executable, *argv], cwd=EXAMPLES, env=_env(), capture_output=True, text=True,
                       timeout=DEADLINE)
    what = f"{' '.join(argv)}: exit {p.returncode}, stderr:\n{p.stderr}"
    assert p.returncode != 0, what
    assert "Traceback" not in p.stderr, what
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, what
    assert lines[0].startswith(prefix), what
    for w in want:
        assert w in lines[0], f"{what}\nwant {w!r}"
    return lines[0]


class _NotADirectory(http.server.BaseHTTPRequestHandler):
    """Some other HTTP service: a 200 HTML page for every GET."""

    def do_GET(self):
        body = b"<html><body>not a bootstrap directory</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_engine_error_one_line():
    """An error of the engine ends an example with exit status != 0 and one
    line on stderr that names the cause, not the library's own log line of
    the same error before the example's (a `kvxfer: ...` line of the
    "kvxfer" logger, libkvxfer's level=WARN lines)."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    free = str(closed.getsockname()[1])
    closed.close()  # nothing listens there: the initiator's segment RPC is refused
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotADirectory)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        cases = [
            (["mooncake_initiator.py", free, "4096"], "initiator: ", ["segment RPC unreachable", "connection refused"]),
            (["sglang_decode.py", str(srv.server_address[1])], "sglang_decode.py: ",
             [f"http://127.0.0.1:{srv.server_address[1]} is not a bootstrap directory", "not another HTTP service"]),
        ]
        for argv, prefix, want in cases:
            _one_error_line(argv, prefix, want)
    finally:
        srv.shutdown()
        srv.server_close()


def test_ctrl_c_one_line():
    """Ctrl-C (SIGINT) of an example waiting for its peer ends it with exit
    status 130 and one line on stderr, not a KeyboardInterrupt traceback."""
    import signal
    # A job started in the background by a non-interactive shell (nohup, CI)
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
    # handler: the example gets SIGINT as a terminal would deliver it.
    p = subprocess.Popen([sys.executable, "sglang_prefill.py", "0"], cwd=EXAMPLES, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _line(p, "waiting for its decode")
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=DEADLINE)
    finally:
        p.kill()
    what = f"exit {p.returncode}, stderr:\n{err}"
    assert p.returncode == 130, what
    assert "Traceback" not in err, what
    lines = [line for line in err.splitlines() if line.strip() and "level=" not in line]
    assert lines == ["sglang_prefill.py: interrupted"], what
