# python/examples/mooncake_target.py
# The target of a two-process Mooncake-style write: registers a 1 MiB buffer,
# prints the two numbers the initiator needs, and waits until the bytes land.
#   python3 mooncake_target.py            (then, in another shell, the command it prints)
import sys
import time

import numpy as np

from kvxfer.engine import TransferEngine  # was: from mooncake.engine import TransferEngine

engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = np.zeros(1 << 20, dtype=np.uint8)
assert engine.register_memory(buf.ctypes.data, buf.nbytes) == 0
print(f"python3 mooncake_initiator.py {engine.get_rpc_port()} {buf.ctypes.data}", flush=True)

want = np.arange(buf.nbytes, dtype=np.uint8)  # what the initiator writes
deadline = time.monotonic() + 120
while not np.array_equal(buf, want):
    if time.monotonic() > deadline:
        sys.exit("target: nothing arrived within 120 s")
    time.sleep(0.05)
print(f"target: {buf.nbytes} bytes received and checked", flush=True)
engine.unregister_memory(buf.ctypes.data)
