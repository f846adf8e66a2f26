# python/examples/sglang_decode.py
# The decode side: resolves room 42's prefill rank through the bootstrap
# directory, gives it 4 destination pages and an aux row, waits for Success
# and checks what landed.
#   python3 sglang_decode.py [BOOTSTRAP_PORT]       (default 8998)
import sys
import time
import types

import numpy as np

from kvxfer.sglang import KVArgs, KVManager, KVPoll, KVReceiver

PORT = int(sys.argv[1]) if len(sys.argv) > 1 else 8998
LAYERS, HEADS, HEAD_DIM, PAGE_SIZE, PAGES = 4, 8, 128, 16, 64  # the prefill's model
ITEM = PAGE_SIZE * HEADS * HEAD_DIM * 2
ROOM = 42

kv = [np.zeros(PAGES * ITEM, dtype=np.uint8) for _ in range(2 * LAYERS)]
aux = np.zeros((16, 64), dtype=np.uint8)
args = KVArgs(engine_rank=0, kv_data_ptrs=[b.ctypes.data for b in kv], kv_data_lens=[b.nbytes for b in kv],
              kv_item_lens=[ITEM] * len(kv), aux_data_ptrs=[aux.ctypes.data], aux_data_lens=[aux.nbytes],
              aux_item_lens=[64], kv_head_num=HEADS, total_kv_head_num=HEADS, page_size=PAGE_SIZE)
server_args = types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=PORT, tp_size=1, dp_size=1, pp_size=1,
                                    enable_dp_attention=False, kv_cache_dtype="auto", dist_init_addr=None)
decode = KVManager(args, "decode", server_args)

receiver = KVReceiver(decode, f"127.0.0.1:{PORT}", ROOM)  # the prefill's bootstrap address and the room
receiver.init(prefill_dp_rank=0)
while receiver.poll() == KVPoll.Bootstrapping:  # resolving and registering with the prefill rank
    time.sleep(0.01)
dst = np.array([10, 11, 12, 13], dtype=np.int32)  # this decode's free pages for the request
receiver.send_metadata(dst, aux_index=3)
while receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
    time.sleep(0.01)
if receiver.poll() == KVPoll.Failed:
    receiver.failure_exception()  # raises KVTransferError naming the room, the peer and the step
for b, buf in enumerate(kv):
    assert (buf[10 * ITEM : 14 * ITEM] == b + 1).all() and not buf[: 10 * ITEM].any(), f"buffer {b}"
assert (aux[3] == 7).all(), "aux row"
print(f"decode: room {ROOM} received into pages {dst.tolist()} and checked", flush=True)
decode.close()
