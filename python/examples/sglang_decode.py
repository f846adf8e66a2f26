# python/examples/sglang_decode.py
# The decode side: resolves room 42's prefill rank through the bootstrap
# directory, gives it 4 destination pages and an aux row, waits for Success
# and checks what landed.
#   python3 sglang_decode.py [BOOTSTRAP_PORT]       (default 8998)
import argparse
import logging
import os
import sys
import time
import types

import numpy as np

from kvxfer import KvxError, LibraryNotFoundError
from kvxfer.sglang import KVArgs, KVManager, KVPoll, KVReceiver, KVTransferError

# This script prints each engine error itself, in one line: the library's own
# log of the same error (the "kvxfer" logger, libkvxfer's stderr log) stays
# quiet unless KVXFER_LOG_LEVEL asks for it (read when the library loads).
if "KVXFER_LOG_LEVEL" not in os.environ:
    os.environ["KVXFER_LOG_LEVEL"] = "error"
    logging.getLogger("kvxfer").setLevel(logging.CRITICAL)

LAYERS, HEADS, HEAD_DIM, PAGE_SIZE, PAGES = 4, 8, 128, 16, 64  # the prefill's model
ITEM = PAGE_SIZE * HEADS * HEAD_DIM * 2
ROOM = 42


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr (main's caller), not a usage block
        raise ValueError(f"{message} (usage: {self.format_usage().removeprefix('usage: ').strip()})")


def main():
    p = ArgumentParser(prog="sglang_decode.py", description="receive room 42 from sglang_prefill.py")
    p.add_argument("port", metavar="BOOTSTRAP_PORT", type=int, nargs="?", default=8998,
                   help="the prefill's bootstrap port, as sglang_prefill.py printed it (default 8998)")
    args = p.parse_args()
    if not 1 <= args.port <= 65535:
        raise ValueError(f"BOOTSTRAP_PORT {args.port}: want the port sglang_prefill.py printed, 1-65535")
    kv = [np.zeros(PAGES * ITEM, dtype=np.uint8) for _ in range(2 * LAYERS)]
    aux = np.zeros((16, 64), dtype=np.uint8)
    kv_args = KVArgs(engine_rank=0, kv_data_ptrs=[b.ctypes.data for b in kv], kv_data_lens=[b.nbytes for b in kv],
                     kv_item_lens=[ITEM] * len(kv), aux_data_ptrs=[aux.ctypes.data], aux_data_lens=[aux.nbytes],
                     aux_item_lens=[64], kv_head_num=HEADS, total_kv_head_num=HEADS, page_size=PAGE_SIZE)
    server_args = types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=args.port, tp_size=1, dp_size=1,
                                        pp_size=1, enable_dp_attention=False, kv_cache_dtype="auto", dist_init_addr=None)
    decode = KVManager(kv_args, "decode", server_args)

    receiver = KVReceiver(decode, f"127.0.0.1:{args.port}", ROOM)  # the prefill's bootstrap address and the room
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
        if not (buf[10 * ITEM : 14 * ITEM] == b + 1).all() or buf[: 10 * ITEM].any():
            sys.exit(f"decode: room {ROOM}: buffer {b} does not hold what the prefill sent")
    if not (aux[3] == 7).all():
        sys.exit(f"decode: room {ROOM}: aux row 3 does not hold what the prefill sent")
    print(f"decode: room {ROOM} received into pages {dst.tolist()} and checked", flush=True)
    decode.close()


if __name__ == "__main__":
    try:
        main()
    except (ValueError, KvxError, KVTransferError, LibraryNotFoundError, OSError) as e:  # bad arguments, the engine's errors
        sys.exit(f"sglang_decode.py: {e}")
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's 128 + SIGINT
        print(f"sglang_decode.py: interrupted", file=sys.stderr)
        sys.exit(130)
