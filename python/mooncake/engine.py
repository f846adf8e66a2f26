"""mooncake.engine on kvxfer: ``from mooncake.engine import TransferEngine``
gives kvxfer.engine.TransferEngine, with Mooncake's method names, arguments,
return conventions and environment variables (python/README.md lists each
method and every difference)."""

from kvxfer.engine import (  # noqa: F401
    SUPPORT_CUDA,
    SUPPORT_EFA,
    SUPPORT_HIP,
    SUPPORT_INTRA_NVLINK,
    SUPPORT_MNNVL,
    SUPPORT_MUSA,
    InnerTransferEngine,
    Read,
    TransferEngine,
    TransferNotify,
    TransferOpcode,
    Write,
)

__all__ = [
    "TransferEngine",
    "TransferOpcode",
    "TransferNotify",
    "InnerTransferEngine",
    "Read",
    "Write",
    "SUPPORT_CUDA",
    "SUPPORT_EFA",
    "SUPPORT_HIP",
    "SUPPORT_INTRA_NVLINK",
    "SUPPORT_MNNVL",
    "SUPPORT_MUSA",
]
