"""kvxfer.sglang: kvxfer as an SGLang KV transfer backend.

* ``kvxfer.sglang`` (this package, from ``kvxfer.sglang.conn``): KVArgs,
  KVPoll, KVManager, KVSender, KVReceiver, KVBootstrapServer, KVTransferMetric,
  KVTransferError, PrefillServerInfo, DisaggregationMode, with the shapes of
  SGLang's disaggregation classes and every attribute its prefill and decode
  schedulers use (python/README.md lists them).
* ``python -m kvxfer.sglang.launch <sglang.launch_server arguments>``
  (``kvxfer.sglang.launch``): runs SGLang's server with ``kvxfer`` registered
  as a ``--disaggregation-transfer-backend``.

Importing this package loads neither SGLang nor libkvxfer.so.
"""

from . import conn
from .conn import (
    DisaggregationMode,
    KVArgs,
    KVBootstrapServer,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTransferError,
    KVTransferMetric,
    LayerwiseSaver,
    PrefillServerInfo,
    layer_index,
    query_prefill_dp_ranks,
)

__all__ = conn.__all__
