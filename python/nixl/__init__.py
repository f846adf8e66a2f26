"""nixl: kvxfer's stand-in for NIXL's Python package, so that vLLM's
NixlConnector (and other callers of ``nixl._api.nixl_agent``) run on kvxfer
without an edit.

Installed only on request (python/README.md, "The nixl package"), and never
beside a real NIXL install: both are the top-level package ``nixl``. It
provides what vLLM's NixlConnector imports:

* ``nixl._api``: ``nixl_agent`` and ``nixl_agent_config`` (NIXL's calls,
  argument shapes and return conventions, on kvxfer.Agent);
* ``nixl._bindings``: ``nixlXferTelemetry``, the descriptor list types, the
  memory-segment constants and NIXL's exception classes.

Both ends of a transfer must run kvxfer (kvxfer's agent metadata is not
NIXL's). NIXL's UCX/GDS/... backends are names only here: every transfer
moves on the kvxfer transport the agent opened ($KVXFER_TRANSPORT, tcp by
default). Importing this package does not load libkvxfer.so.
"""

from kvxfer import __version__ as _kvxfer_version

#: This package is kvxfer's shim, not NIXL.
KVXFER_SHIM = True
__version__ = _kvxfer_version
__all__ = ["KVXFER_SHIM"]
