# python/examples/mooncake_target.py
# The target of a two-process Mooncake-style write: registers a 1 MiB buffer,
# prints the two numbers the initiator needs, and waits until the bytes land.
#   python3 mooncake_target.py            (then, in another shell, the command it prints)
import argparse
import logging
import os
import sys
import time

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
    p = ArgumentParser(prog="mooncake_target.py", description="receive 1 MiB from mooncake_initiator.py")
    p.parse_args()
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        sys.exit(f"target: initialize: {engine.last_error}")
    buf = np.zeros(1 << 20, dtype=np.uint8)
    if engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        sys.exit(f"target: register_memory: {engine.last_error}")
    print(f"python3 mooncake_initiator.py {engine.get_rpc_port()} {buf.ctypes.data}", flush=True)

    want = np.arange(buf.nbytes, dtype=np.uint8)  # what the initiator writes
    deadline = time.monotonic() + 120
    while not np.array_equal(buf, want):
        if time.monotonic() > deadline:
            sys.exit("target: nothing arrived within 120 s")
        time.sleep(0.05)
    print(f"target: {buf.nbytes} bytes received and checked", flush=True)
    engine.unregister_memory(buf.ctypes.data)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, KvxError, LibraryNotFoundError, OSError) as e:  # bad arguments, the engine's errors
        sys.exit(f"mooncake_target.py: {e}")
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's 128 + SIGINT
        print(f"mooncake_target.py: interrupted", file=sys.stderr)
        sys.exit(130)
