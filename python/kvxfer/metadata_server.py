"""kvxfer.MetadataServer: an HTTP metadata server in this process, with the
routes of Mooncake's mooncake_http_metadata_server (GET/PUT/DELETE
/metadata?key=..., GET /health), served by libkvxfer
(kvx_metadata_server_start). Engines use it with
``initialize(name, server.url, protocol, "")``; Mooncake's own engines can
share it. `kvxfer metadata-server --port 8080` is the same server as a
process."""

from __future__ import annotations

import ctypes

from . import _lib
from ._lib import Closable


class MetadataServer(Closable):
    """An in-memory HTTP metadata server listening on host:port (port 0 = a
    free one). ``addr`` is "host:port", ``url`` the metadata_server string
    for TransferEngine.initialize ("http://host:port/metadata"). close() stops
    it (what it stored is lost); idempotent. Raises KvxError when it cannot
    listen (port in use, host not of this machine: the message says which)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        out = ctypes.c_uint64(0)
        _lib.call("kvx_metadata_server_start", _lib.encode(host), int(port), ctypes.byref(out))
        self._h = out.value
        self.addr = _lib.get_string("kvx_metadata_server_addr", self._h)
        self.url = f"http://{self.addr}/metadata"

    @property
    def running(self) -> bool:
        """True until close()."""
        return self._h != 0

    def close(self) -> None:
        """Stop serving. Idempotent."""
        h, self._h = getattr(self, "_h", 0), 0
        if h:
            _lib.try_call("kvx_metadata_server_stop", h)

    def __repr__(self):
        return f"MetadataServer({self.url}{'' if self._h else ', closed'})"
