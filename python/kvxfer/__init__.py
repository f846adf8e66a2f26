"""kvxfer: KV-cache transfer for prefill/decode disaggregated serving, over
libkvxfer.so (ctypes; standard library only, numpy optional).

* ``kvxfer.TransferEngine`` (also ``kvxfer.engine.TransferEngine``): a drop-in
  for Mooncake's ``from mooncake.engine import TransferEngine``.
* ``kvxfer.sglang``: KVArgs, KVPoll, KVManager, KVSender, KVReceiver,
  KVBootstrapServer with SGLang's disaggregation interface shapes.
* ``kvxfer.Agent`` (kvxfer.agent): the NIXL-shaped agent; the optional
  ``nixl`` package (python/nixl) wraps it in NIXL's Python API so vLLM's
  NixlConnector runs on kvxfer.
* ``kvxfer.MetadataServer``: Mooncake's HTTP metadata server
  (http://host:port/metadata) in this process.
* the optional ``mooncake`` package (python/mooncake, installed separately)
  makes ``from mooncake.engine import TransferEngine`` kvxfer's.

The library is found through the KVXFER_LIBRARY environment variable, the
package directory, or the linker path (in that order); importing this package
does not load it, the first engine does (LibraryNotFoundError names all three
places when it is missing). Do not fork a process after the library is loaded
(the Go runtime does not survive fork): use subprocess or multiprocessing's
"spawn" start method.
"""

from .agent import Agent
from ._lib import KvxError, LibraryNotFoundError, last_error, library_path, metrics_text, version
from ._memory import HostBuffer, address_of
from .engine import TransferEngine, TransferNotify, TransferOpcode
from .metadata_server import MetadataServer

__all__ = [
    "Agent",
    "TransferEngine",
    "TransferOpcode",
    "TransferNotify",
    "MetadataServer",
    "HostBuffer",
    "KvxError",
    "LibraryNotFoundError",
    "address_of",
    "last_error",
    "metrics_text",
    "library_path",
    "version",
]

__version__ = "0.1.0"
