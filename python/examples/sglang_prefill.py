# python/examples/sglang_prefill.py
# The prefill side of a two-process kvxfer.sglang room: starts the bootstrap
# directory, registers this rank, and sends room 42's KV (4 pages) and aux row
# once the decode asks for it. Run it first, then sglang_decode.py.
#   python3 sglang_prefill.py [BOOTSTRAP_PORT]      (default 8998; 0 = a free one)
import argparse
import logging
import os
import sys
import time
import types

import numpy as np

from kvxfer import KvxError, LibraryNotFoundError
from kvxfer.sglang import KVArgs, KVBootstrapServer, KVManager, KVPoll, KVSender, KVTransferError

# This script prints each engine error itself, in one line: the library's own
# log of the same error (the "kvxfer" logger, libkvxfer's stderr log) stays
# quiet unless KVXFER_LOG_LEVEL asks for it (read when the library loads).
if "KVXFER_LOG_LEVEL" not in os.environ:
    os.environ["KVXFER_LOG_LEVEL"] = "error"
    logging.getLogger("kvxfer").setLevel(logging.CRITICAL)

LAYERS, HEADS, HEAD_DIM, PAGE_SIZE, PAGES = 4, 8, 128, 16, 64  # a small bf16 model
ITEM = PAGE_SIZE * HEADS * HEAD_DIM * 2  # bytes of one page of one buffer
ROOM = 42


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr (main's caller), not a usage block
        raise ValueError(f"{message} (usage: {self.format_usage().removeprefix('usage: ').strip()})")


def main():
    p = ArgumentParser(prog="sglang_prefill.py", description="send room 42 to sglang_decode.py")
    p.add_argument("port", metavar="BOOTSTRAP_PORT", type=int, nargs="?", default=8998,
                   help="the bootstrap directory's port (default 8998; 0 = a free one)")
    args = p.parse_args()
    if not 0 <= args.port <= 65535:
        raise ValueError(f"BOOTSTRAP_PORT {args.port}: want 1-65535, or 0 for a free one")
    try:
        server = KVBootstrapServer("127.0.0.1", args.port)  # the prefill instance's directory
    except KvxError as e:  # the port is taken or privileged
        sys.exit(f"sglang_prefill.py: {e}; the port is this script's BOOTSTRAP_PORT argument")
    kv = [np.zeros(PAGES * ITEM, dtype=np.uint8) for _ in range(2 * LAYERS)]  # K of every layer, then V
    aux = np.zeros((16, 64), dtype=np.uint8)
    kv_args = KVArgs(engine_rank=0, kv_data_ptrs=[b.ctypes.data for b in kv], kv_data_lens=[b.nbytes for b in kv],
                     kv_item_lens=[ITEM] * len(kv), aux_data_ptrs=[aux.ctypes.data], aux_data_lens=[aux.nbytes],
                     aux_item_lens=[64], kv_head_num=HEADS, total_kv_head_num=HEADS, page_size=PAGE_SIZE)
    server_args = types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=server.port, tp_size=1, dp_size=1,
                                        pp_size=1, enable_dp_attention=False, kv_cache_dtype="auto", dist_init_addr=None)
    prefill = KVManager(kv_args, "prefill", server_args)  # registers this rank in the directory

    pages = np.arange(4, dtype=np.int32)  # the request's KV is in pages 0-3
    for b, buf in enumerate(kv):
        buf[: 4 * ITEM] = b + 1  # stands for the forward pass's output
    aux[0] = 7
    sender = KVSender(prefill, server.addr, ROOM, [0], 0)
    print(f"prefill: room {ROOM} waiting for its decode (python3 sglang_decode.py {server.port})", flush=True)
    while sender.poll() == KVPoll.Bootstrapping:  # until the decode sent its destination pages
        time.sleep(0.01)
    sender.init(len(pages), aux_index=0)
    sender.send(pages)  # several calls = chunked prefill; the one reaching 4 pages is the last
    while sender.poll() not in (KVPoll.Success, KVPoll.Failed):
        time.sleep(0.01)
    if sender.poll() == KVPoll.Failed:
        sender.failure_exception()  # raises KVTransferError naming the room, the peer and the step
    print(f"prefill: room {ROOM} sent; the decode verified it", flush=True)
    prefill.close()
    server.close()


if __name__ == "__main__":
    try:
        main()
    except (ValueError, KvxError, KVTransferError, LibraryNotFoundError, OSError) as e:  # bad arguments, the engine's errors
        sys.exit(f"sglang_prefill.py: {e}")
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's 128 + SIGINT
        print(f"sglang_prefill.py: interrupted", file=sys.stderr)
        sys.exit(130)
