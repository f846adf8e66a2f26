"""`python -m kvxfer.sglang.launch`, and the sglang.srt.plugins entry point,
against a small `sglang` package tree written here: SGLang is not
installable on this machine, so the tree has the module paths and the
binding pattern of SGLang's own (the TransferBackend enum and the if/elif
get_kv_class of disaggregation/utils.py, imported with `from ... import`
by prefill.py, decode.py and the server entry point; the
--disaggregation-transfer-backend choices list; the scheduler started
with multiprocessing "spawn"). Three layouts: the newest (the list in
arg_groups/choices.py with its adder, the plugin framework, the entry
point imported before plugins load), an older one (the list in
server_args.py) and one with a literal choices list.

In the spawned scheduler the fake gets kvxfer's classes from both
modules' bindings and starts a real prefill KVManager, which registers
with the kvxfer KVBootstrapServer the fake's entry point started as
SGLang does (host=, port=)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

PYDIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

UTILS = '''
from enum import Enum


class DisaggregationMode(Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class TransferBackend(Enum):
    MOONCAKE = "mooncake"
    NIXL = "nixl"
    ASCEND = "ascend"
    FAKE = "fake"


class KVClassType(Enum):
    KVARGS = "kvargs"
    MANAGER = "manager"
    SENDER = "sender"
    RECEIVER = "receiver"
    BOOTSTRAP_SERVER = "bootstrap_server"


def get_kv_class(transfer_backend, class_type):
    if transfer_backend == TransferBackend.MOONCAKE:
        from sglang.srt.disaggregation.mooncake import MooncakeKVManager  # not in this tree
        return MooncakeKVManager
    elif transfer_backend == TransferBackend.FAKE:
        from sglang.srt.disaggregation.base import KVArgs

        return {KVClassType.KVARGS: KVArgs}.get(class_type)
    raise ValueError(f"Unsupported transfer backend: {transfer_backend}")
'''

BASE_CONN = '''
from typing import List, Optional


class KVArgs:
    engine_rank: int
    kv_data_ptrs: List[int]
    kv_data_lens: List[int]
    kv_item_lens: List[int]
    aux_data_ptrs: List[int]
    aux_data_lens: List[int]
    aux_item_lens: List[int]
    kv_head_num: int
    total_kv_head_num: int
    page_size: int
    swa_page_size: Optional[int] = None
    dcp_size: int = 1
    dcp_rank: int = 0


class KVPoll:
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4
'''

PREFILL = '''
import ctypes

from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

_keep = []


def init_kv_manager(server_args):
    backend = TransferBackend(server_args.disaggregation_transfer_backend)
    kv_args = get_kv_class(backend, KVClassType.KVARGS)()
    bufs = [ctypes.create_string_buffer(2048) for _ in range(2)]  # K and V of one layer: 8 pages of 256 bytes
    aux = ctypes.create_string_buffer(4 * 64)
    _keep.extend(bufs + [aux])
    kv_args.engine_rank = 0
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    kv_args.prefill_start_layer = 0
    kv_args.kv_data_ptrs = [ctypes.addressof(b) for b in bufs]
    kv_args.kv_data_lens = [2048, 2048]
    kv_args.kv_item_lens = [256, 256]
    kv_args.kv_head_num = 2
    kv_args.total_kv_head_num = 2
    kv_args.page_size = 4
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = [ctypes.addressof(aux)], [256], [64]
    kv_args.ib_device = server_args.disaggregation_ib_device
    kv_args.gpu_id = 0
    return get_kv_class(backend, KVClassType.MANAGER)(kv_args, DisaggregationMode.PREFILL, server_args, False)
'''

DECODE = '''
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
'''

SCHEDULER = '''
import json
import urllib.request

from sglang.srt.disaggregation import decode, prefill
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend


def _name(c):
    return None if c is None else f"{c.__module__}.{c.__qualname__}"


def run_scheduler_process(server_args, result_path):
    try:
        from sglang.srt.plugins import load_plugins
    except ImportError:
        pass
    else:
        load_plugins()
    backend = TransferBackend(server_args.disaggregation_transfer_backend)
    res = {k.value: [_name(prefill.get_kv_class(backend, k)), _name(decode.get_kv_class(backend, k))] for k in KVClassType}
    mgr = prefill.init_kv_manager(server_args)
    url = (f"http://{server_args.host}:{server_args.disaggregation_bootstrap_port}"
           "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
    with urllib.request.urlopen(url, timeout=10) as r:
        res["topology"] = json.loads(r.read())
    res["transport"] = mgr.transport
    mgr.close()
    with open(result_path, "w") as f:
        json.dump(res, f)
'''

HTTP_SERVER = '''
import multiprocessing as mp
import os

from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class


def launch_server(server_args):
    backend = TransferBackend(server_args.disaggregation_transfer_backend)
    bootstrap = None
    if DisaggregationMode(server_args.disaggregation_mode) == DisaggregationMode.PREFILL:
        cls = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)
        bootstrap = cls(host=server_args.host, port=server_args.disaggregation_bootstrap_port)
    from sglang.srt.managers.scheduler import run_scheduler_process

    out = os.environ["FAKE_SGLANG_RESULT"]
    p = mp.get_context("spawn").Process(target=run_scheduler_process, args=(server_args, out))
    p.start()
    p.join(120)
    with open(out + ".parent", "w") as f:
        f.write(f"{type(bootstrap).__module__}.{type(bootstrap).__qualname__} {bootstrap.thread.is_alive()}")
    bootstrap.close()
    if p.exitcode != 0:
        raise SystemExit(f"scheduler exited with {p.exitcode}")
'''

SERVER_ARGS = '''
import argparse
import dataclasses
{choices_import}


@dataclasses.dataclass
class ServerArgs:
    model_path: str
    host: str = "127.0.0.1"
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_ib_device: str = None
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    enable_dp_attention: bool = False
    kv_cache_dtype: str = "auto"
    dist_init_addr: str = None

    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--model-path", required=True)
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--disaggregation-mode", default="null", choices=["null", "prefill", "decode"])
        parser.add_argument("--disaggregation-transfer-backend", type=str, default="mooncake", choices={choices})
        parser.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)


def prepare_server_args(argv):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs(**vars(parser.parse_args(argv)))
'''

PLUGINS = '''
import logging
from importlib.metadata import entry_points

_loaded = False


def load_plugins():
    global _loaded
    if _loaded:
        return
    _loaded = True
    for ep in entry_points(group="sglang.srt.plugins"):
        try:
            ep.load()()
        except Exception:
            logging.exception("plugin %s failed", ep.name)
'''

LAUNCH_NEWEST = '''
import sys

from sglang.srt.entrypoints.http_server import launch_server
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args

if __name__ == "__main__":
    load_plugins()
    launch_server(prepare_server_args(sys.argv[1:]))
'''

LAUNCH_OLDER = '''
import sys

from sglang.srt.server_args import prepare_server_args

if __name__ == "__main__":
    server_args = prepare_server_args(sys.argv[1:])
    from sglang.srt.entrypoints.http_server import launch_server

    launch_server(server_args)
'''

CHOICES = '["mooncake", "nixl", "ascend", "fake"]'


def fake_sglang(root, layout):
    """Write the fake `sglang` tree for layout newest|older|literal under root."""
    files = {
        "sglang/__init__.py": "",
        "sglang/srt/__init__.py": "",
        "sglang/srt/disaggregation/__init__.py": "",
        "sglang/srt/disaggregation/base/__init__.py": "from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll\n",
        "sglang/srt/disaggregation/base/conn.py": BASE_CONN,
        "sglang/srt/disaggregation/utils.py": UTILS,
        "sglang/srt/disaggregation/prefill.py": PREFILL,
        "sglang/srt/disaggregation/decode.py": DECODE,
        "sglang/srt/managers/__init__.py": "",
        "sglang/srt/managers/scheduler.py": SCHEDULER,
        "sglang/srt/entrypoints/__init__.py": "",
        "sglang/srt/entrypoints/http_server.py": HTTP_SERVER,
    }
    if layout == "newest":
        files["sglang/srt/arg_groups/__init__.py"] = ""
        files["sglang/srt/arg_groups/choices.py"] = (
            f"DISAGG_TRANSFER_BACKEND_CHOICES = {CHOICES}\n"
            "add_disagg_transfer_backend_choices = DISAGG_TRANSFER_BACKEND_CHOICES.extend\n")
        files["sglang/srt/server_args.py"] = SERVER_ARGS.format(
            choices_import="from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES",
            choices="DISAGG_TRANSFER_BACKEND_CHOICES")
        files["sglang/srt/plugins/__init__.py"] = PLUGINS
        files["sglang/launch_server.py"] = LAUNCH_NEWEST
    elif layout == "older":
        files["sglang/srt/server_args.py"] = SERVER_ARGS.format(
            choices_import=f"DISAGG_TRANSFER_BACKEND_CHOICES = {CHOICES}", choices="DISAGG_TRANSFER_BACKEND_CHOICES")
        files["sglang/launch_server.py"] = LAUNCH_OLDER
    else:
        files["sglang/srt/server_args.py"] = SERVER_ARGS.format(choices_import="", choices=CHOICES)
        files["sglang/launch_server.py"] = LAUNCH_OLDER
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text).lstrip("\n"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp_path, module, backend, pythonpath, port=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    env["FAKE_SGLANG_RESULT"] = str(tmp_path / "result.json")
    env["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] = "20"
    args = [sys.executable, "-m", module, "--model-path", "/models/none", "--host", "127.0.0.1",
            "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", backend,
            "--disaggregation-bootstrap-port", str(port or free_port())]
    return subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)


def check_served(tmp_path, r):
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "result.json").read_text())
    for kind, cls in (("kvargs", "KVArgs"), ("manager", "KVManager"), ("sender", "KVSender"), ("receiver", "KVReceiver"),
                      ("bootstrap_server", "KVBootstrapServer")):
        assert res[kind] == [f"kvxfer.sglang.conn.{cls}"] * 2, (kind, res[kind])
    assert res["topology"]["attn_tp_size"] == 1 and res["topology"]["page_size"] == 4, res["topology"]
    assert res["transport"], res
    assert (tmp_path / "result.json.parent").read_text() == "kvxfer.sglang.conn.KVBootstrapServer True"


@pytest.mark.parametrize("layout", ["newest", "older", "literal"])
def test_launcher_registers_kvxfer(tmp_path, layout):
    """python -m kvxfer.sglang.launch <launch_server args> ... kvxfer: the
    parent's bootstrap server and the spawned scheduler's classes are
    kvxfer's, through the prefill and decode modules' import-time bindings."""
    fake = tmp_path / "fake"
    fake_sglang(fake, layout)
    check_served(tmp_path, run(tmp_path, "kvxfer.sglang.launch", "kvxfer", [str(fake), PYDIR]))


def test_plain_sglang_refuses_kvxfer_and_launcher_keeps_other_choices(tmp_path):
    """Without the launcher (and without the plugin) SGLang's parser refuses
    kvxfer; with it, an unknown backend is still refused, now listing
    kvxfer among the choices."""
    fake = tmp_path / "fake"
    fake_sglang(fake, "older")
    r = run(tmp_path, "sglang.launch_server", "kvxfer", [str(fake), PYDIR])
    assert r.returncode == 2 and "invalid choice: 'kvxfer'" in r.stderr, r.stderr
    r = run(tmp_path, "kvxfer.sglang.launch", "bogus", [str(fake), PYDIR])
    assert r.returncode == 2 and "invalid choice: 'bogus'" in r.stderr and "'kvxfer'" in r.stderr, r.stderr


def test_launcher_without_sglang(tmp_path):
    r = run(tmp_path, "kvxfer.sglang.launch", "kvxfer", [PYDIR])
    assert r.returncode == 1 and "SGLang is not importable" in r.stderr, r.stderr


def test_plugin_entry_point_of_the_installed_package(tmp_path):
    """pip install ./python (offline, as python/README.md says) registers
    kvxfer.sglang.launch:install under sglang.srt.plugins: the newest
    layout, whose entry point and scheduler both call load_plugins(), then
    serves kvxfer with plain `python -m sglang.launch_server`."""
    pytest.importorskip("pip", reason="pip is not installed for this Python (Debian: python3-pip, scripts/install-deps.sh)")
    src = tmp_path / "src"
    shutil.copytree(PYDIR, src, ignore=shutil.ignore_patterns("build", "tests", "__pycache__", "*.egg-info", "libkvxfer.so*"))
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--no-index",
                          "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert (site / "kvxfer" / "sglang" / "launch.py").is_file()
    fake = tmp_path / "fake"
    fake_sglang(fake, "newest")
    check_served(tmp_path, run(tmp_path, "sglang.launch_server", "kvxfer", [str(fake), str(site)]))
