# python/examples/mooncake_initiator.py
# The initiator: writes 1 MiB into the target's registered buffer.
#   python3 mooncake_initiator.py RPC_PORT BUFFER_ADDRESS   (as mooncake_target.py printed them)
import argparse
import logging
import os
import sys

import numpy as np

from kvxfer import KvxError, LibraryNotFoundError
from kvxfer.engine import TransferEngine  # was: from mooncake.engine import TransferEngine

# This script prints each engine error itself, in one line: the library's own
# log of the same error (the "kvxfer" logger, libkvxfer's stderr log) stays
# quiet unless KVXFER_LOG_LEVEL asks for it (read when the library loads).
if "KVXFER_LOG_LEVEL" not in os.environ:
    os.environ["KVXFER_LOG_LEVEL"] = "error"
    logging.getLogger("kvxfer").setLevel(logging.CRITICAL)


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr (main's caller), not a usage block
        raise ValueError(f"{message} (usage: {self.format_usage().removeprefix('usage: ').strip()})")


def main():
    p = ArgumentParser(prog="mooncake_initiator.py", description="write 1 MiB into mooncake_target.py's buffer")
    p.add_argument("rpc_port", metavar="RPC_PORT", type=int, help="the target's RPC port, as it printed it")
    p.add_argument("buffer_address", metavar="BUFFER_ADDRESS", type=int, help="the target's buffer address, as it printed it")
    args = p.parse_args()
    if not 1 <= args.rpc_port <= 65535:
        raise ValueError(f"RPC_PORT {args.rpc_port}: want the port mooncake_target.py printed, 1-65535")
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        sys.exit(f"initiator: initialize: {engine.last_error}")
    src = np.arange(1 << 20, dtype=np.uint8)
    if engine.register_memory(src.ctypes.data, src.nbytes) != 0:
        sys.exit(f"initiator: register_memory: {engine.last_error}")
    peer = f"127.0.0.1:{args.rpc_port}"  # the target's session id: host and engine.get_rpc_port()
    ret = engine.transfer_sync_write(peer, src.ctypes.data, args.buffer_address, src.nbytes)
    if ret != 0:
        sys.exit(f"initiator: transfer_sync_write returned {ret}: {engine.last_error}")
    print(f"initiator: wrote {src.nbytes} bytes", flush=True)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, KvxError, LibraryNotFoundError, OSError) as e:  # bad arguments, the engine's errors
        sys.exit(f"mooncake_initiator.py: {e}")
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's 128 + SIGINT
        print(f"mooncake_initiator.py: interrupted", file=sys.stderr)
        sys.exit(130)
