# python/examples/mooncake_initiator.py
# The initiator: writes 1 MiB into the target's registered buffer.
#   python3 mooncake_initiator.py RPC_PORT BUFFER_ADDRESS   (as mooncake_target.py printed them)
import sys

import numpy as np

from kvxfer.engine import TransferEngine  # was: from mooncake.engine import TransferEngine

rpc_port, peer_buffer_address = int(sys.argv[1]), int(sys.argv[2])
engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
src = np.arange(1 << 20, dtype=np.uint8)
assert engine.register_memory(src.ctypes.data, src.nbytes) == 0
peer = f"127.0.0.1:{rpc_port}"  # the target's session id: host and engine.get_rpc_port()
ret = engine.transfer_sync_write(peer, src.ctypes.data, peer_buffer_address, src.nbytes)
if ret != 0:
    sys.exit(f"initiator: transfer_sync_write returned {ret}: {engine.last_error}")
print(f"initiator: wrote {src.nbytes} bytes", flush=True)
