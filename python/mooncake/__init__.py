"""mooncake: kvxfer's stand-in for Mooncake's Python package, so that code
written for Mooncake's transfer engine runs on kvxfer without an edit.

Installed only on request (python/README.md, "The mooncake package"), and
never beside a real Mooncake install: both are the top-level package
``mooncake``. It provides what serving engines import from Mooncake's
transfer engine:

* ``mooncake.engine``: ``TransferEngine`` (kvxfer.engine.TransferEngine),
  ``TransferOpcode``, ``TransferNotify``, the ``SUPPORT_*`` flags;
* ``mooncake.http_metadata_server``: ``KVBootstrapServer`` and the
  ``mooncake_http_metadata_server`` command, on kvxfer's HTTP metadata server.

Mooncake Store, EP and the RPC tensor interface are not part of it: importing
them fails with ModuleNotFoundError, as on an install without them.
Importing this package does not load libkvxfer.so.
"""

from kvxfer import __version__ as _kvxfer_version

#: This package is kvxfer's shim, not Mooncake (check before relying on
#: Mooncake-only features).
KVXFER_SHIM = True
__version__ = _kvxfer_version
__all__ = ["KVXFER_SHIM"]
