"""A vLLM NixlConnector prefill worker, reduced to its nixl calls, in its own
process (tests/test_nixl.py): JSON lines on stdin (commands) and stdout
(answers); the first line is {"event": "ready", "handshake": ...}.

It registers its KV caches (one region per K or V buffer of a layer, each
NUM_BLOCKS blocks of BLOCK_LEN bytes, patterned), prepares its local block
list as register_local_xfer_handler does and answers with the handshake
payload vLLM sends (agent metadata, KV base addresses, block lengths).
Requests it is asked to hold ("hold") keep their blocks until a decode's
notification "<req>:<tp_size>" names them (get_new_notifs, as
_get_new_notifs does); then the blocks are freed: overwritten with 0xEE, as
a reused block would be.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402

NUM_LAYERS = 2
NUM_BLOCKS = 32
BLOCK_LEN = 16 << 10


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def pattern(region: int, block: int) -> int:
    return (region * NUM_BLOCKS + block) % 251 + 1


def make_caches(fill: bool):
    caches = []
    for r in range(2 * NUM_LAYERS):  # K and V of each layer
        c = np.zeros((NUM_BLOCKS, BLOCK_LEN), dtype=np.uint8)
        if fill:
            for b in range(NUM_BLOCKS):
                c[b, :] = pattern(r, b)
        caches.append(c)
    return caches


def register(agent, caches):
    """register_kv_caches: one registration list, then the local block list."""
    caches_data = [(c.ctypes.data, c.nbytes, 0, "") for c in caches]
    descs = agent.get_reg_descs(caches_data, "DRAM")
    agent.register_memory(descs, backends=["UCX"])
    blocks = [(c.ctypes.data + b * BLOCK_LEN, BLOCK_LEN, 0) for c in caches for b in range(NUM_BLOCKS)]
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(blocks, "DRAM"))
    return descs, local


def main():
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=["UCX"], capture_telemetry=True))
    caches = make_caches(True)
    descs, local = register(agent, caches)
    out({"event": "ready", "pid": os.getpid(), "agent": agent.name, "handshake": {
        "engine_id": "prefill-engine", "agent_metadata": agent.get_agent_metadata().hex(),
        "kv_caches_base_addr": [c.ctypes.data for c in caches], "num_blocks": NUM_BLOCKS,
        "block_lens": [BLOCK_LEN] * len(caches), "device_id": 0}})
    held: dict[str, list[int]] = {}
    freed: list[str] = []
    senders: dict[str, str] = {}

    def poll_notifs():
        for sender, msgs in agent.get_new_notifs().items():
            for m in msgs:
                req, _tp = m.decode().rsplit(":", 1)
                senders[req] = sender
                blocks = held.pop(req, None)
                if blocks is None:
                    continue  # vLLM logs "unrecognized request"
                for c in caches:
                    c[blocks, :] = 0xEE
                freed.append(req)

    stdin = sys.stdin
    while True:
        r, _, _ = select.select([stdin], [], [], 0.01)
        poll_notifs()
        if not r:
            continue
        line = stdin.readline()
        if not line:
            break
        c = json.loads(line)
        cmd = c["cmd"]
        if cmd == "exit":
            break
        if cmd == "hold":
            held[c["req"]] = list(c["blocks"])
            out({"held": c["req"]})
        elif cmd == "status":
            out({"held": sorted(held), "freed": list(freed)})
        elif cmd == "wait_freed":
            end = time.monotonic() + c.get("timeout", 30)
            while c["req"] not in freed and time.monotonic() < end:
                time.sleep(0.01)
                poll_notifs()
            out({"freed": c["req"] in freed, "sender": senders.get(c["req"])})
        elif cmd == "remove":
            try:
                agent.remove_remote_agent(c["agent"])
                out({"removed": c["agent"]})
            except Exception as e:
                out({"error": f"{type(e).__name__}: {e}"})
    agent.release_dlist_handle(local)
    agent.deregister_memory(descs)
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
