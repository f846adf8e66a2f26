"""mooncake.http_metadata_server on kvxfer: Mooncake's HTTP metadata server
class and command (``mooncake_http_metadata_server --port 8080``), served by
kvxfer's Go server (kvxfer.MetadataServer) with the same routes and rules:
GET/PUT/DELETE /metadata?key=... and GET /health."""

from __future__ import annotations

import argparse
import enum
import logging
import signal
import sys
import threading

from kvxfer.metadata_server import MetadataServer

log = logging.getLogger("kvxfer")


class KVPoll(enum.Enum):
    """The server's state as Mooncake's poll() reports it."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class KVBootstrapServer:
    """Mooncake's HTTP metadata server object: construct with the port (and
    host, default every interface), run() starts it, poll() is Success while
    it serves and Failed otherwise, close() stops it. run() raises
    kvxfer.KvxError when the port cannot be bound (Mooncake logs and its
    poll() reads Failed; here the reason comes with the exception)."""

    def __init__(self, port: int, host: str = "0.0.0.0"):
        self.port = int(port)
        self.host = host
        self._srv: MetadataServer | None = None

    def run(self):
        """Start serving (returns at once; the server runs in the library)."""
        if self._srv is None:
            self._srv = MetadataServer(self.host, self.port)
            log.info("HTTP metadata server started on %s", self._srv.addr)
        return None

    @property
    def addr(self) -> str:
        """kvxfer extension: the bound "host:port" ("" before run())."""
        return self._srv.addr if self._srv else ""

    def poll(self) -> KVPoll:
        """Success while serving, Failed before run() and after close()."""
        return KVPoll.Success if self._srv is not None and self._srv.running else KVPoll.Failed

    def close(self):
        """Stop serving (what it stored is lost). Idempotent."""
        if self._srv is not None:
            self._srv.close()


def parse_args(argv=None):
    """The command's flags, as Mooncake's: --port, --host, --log-level."""
    p = argparse.ArgumentParser(description="HTTP metadata server (Mooncake's routes, served by kvxfer)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--port", type=int, default=8080, help="port to listen on (0: a free one)")
    p.add_argument("--host", type=str, default="0.0.0.0", help="host to bind to")
    p.add_argument("--log-level", type=str, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], default="INFO",
                   help="logging level")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """mooncake_http_metadata_server: serve until SIGINT/SIGTERM. Prints
    "metadata server listening on http://ADDR/metadata" once it listens."""
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    server = KVBootstrapServer(port=args.port, host=args.host)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the ready line: a stop right after it is clean
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.run()
    except Exception as e:  # KvxError: port in use, foreign host
        print(f"mooncake_http_metadata_server: {e}", file=sys.stderr)
        return 1
    print(f"metadata server listening on http://{server.addr}/metadata", flush=True)
    stop.wait()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
