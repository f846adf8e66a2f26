"""The parts of NIXL's ``nixl._bindings`` extension module that callers
import, as plain Python over kvxfer: descriptor lists, memory-segment and
status constants, the telemetry record and the exception classes."""

from __future__ import annotations

from kvxfer._lib import KvxError

DRAM_SEG = 0
VRAM_SEG = 1
BLK_SEG = 2
OBJ_SEG = 3
FILE_SEG = 4

NIXL_WRITE = 0
NIXL_READ = 1

NIXL_INIT_AGENT = ""
DEFAULT_COMM_PORT = 8888

NIXL_IN_PROG = 1
NIXL_SUCCESS = 0

#: Memory-segment constant of each NIXL memory-type name.
MEM_TYPES = {"DRAM": DRAM_SEG, "cpu": DRAM_SEG, "VRAM": VRAM_SEG, "cuda": VRAM_SEG,
             "BLOCK": BLK_SEG, "OBJ": OBJ_SEG, "FILE": FILE_SEG}
_SEG_NAMES = {DRAM_SEG: "DRAM", VRAM_SEG: "VRAM", BLK_SEG: "BLOCK", OBJ_SEG: "OBJ", FILE_SEG: "FILE"}


def seg_name(seg: int) -> str:
    """"DRAM", "VRAM", ... for a *_SEG constant."""
    return _SEG_NAMES.get(seg, str(seg))


class nixlXferTelemetry:
    """One transfer's telemetry, NIXL's fields: startTime, postDuration and
    xferDuration in microseconds (startTime since the Unix epoch), totalBytes,
    descCount."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime=0, postDuration=0, xferDuration=0, totalBytes=0, descCount=0):
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self):
        return (f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
                f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, descCount={self.descCount})")


class _DList:
    """A descriptor list: a memory segment and (addr, len, dev_id[, meta])
    tuples."""

    width = 3

    def __init__(self, mem_type: int, descs=(), is_sorted: bool = False):
        self.mem_type = mem_type
        self.descs = [tuple(d) for d in descs]
        for i, d in enumerate(self.descs):
            if len(d) != self.width:
                raise nixlInvalidParamError(
                    f"{type(self).__name__}: descriptor {i} is {d!r}: want {self.width}-tuples "
                    + ("(addr, len, dev_id, meta)" if self.width == 4 else "(addr, len, dev_id)"))
        if is_sorted:
            self.descs.sort(key=lambda d: (d[2], d[0], d[1]))
        self.is_sorted = is_sorted

    def getType(self) -> int:
        return self.mem_type

    def descCount(self) -> int:
        return len(self.descs)

    def __len__(self):
        return len(self.descs)

    def __getitem__(self, i):
        return self.descs[i]

    def __iter__(self):
        return iter(self.descs)

    def __repr__(self):
        return f"{type(self).__name__}({seg_name(self.mem_type)}, {len(self.descs)} descriptors)"


class nixlRegDList(_DList):
    """A registration descriptor list: (addr, len, dev_id, meta) tuples."""

    width = 4


class nixlXferDList(_DList):
    """A transfer descriptor list: (addr, len, dev_id) tuples."""

    width = 3


class nixlError(KvxError):
    """Base of the NIXL exception classes; a kvxfer.KvxError (status, op and
    the library's message)."""

    def __init__(self, message: str, status: int = 1, op: str = "nixl"):
        super().__init__(status, op, message)


class nixlNotPostedError(nixlError):
    pass


class nixlInvalidParamError(nixlError):
    pass


class nixlBackendError(nixlError):
    pass


class nixlNotFoundError(nixlError):
    pass


class nixlMismatchError(nixlError):
    pass


class nixlNotAllowedError(nixlError):
    pass


class nixlRepostActiveError(nixlError):
    pass


class nixlUnknownError(nixlError):
    pass


class nixlNotSupportedError(nixlError):
    pass


class nixlRemoteDisconnectError(nixlError):
    pass


class nixlCancelledError(nixlError):
    pass


class nixlNoTelemetryError(nixlError):
    pass
