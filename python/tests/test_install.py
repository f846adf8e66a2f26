"""The documented install, run as written: `make python-install VENV=...
MOONCAKE=1 NIXL=1` builds the wheels offline with Debian's setuptools and wheel,
creates a fresh venv (--system-site-packages) and installs them; a process
outside the source tree, with no KVXFER_LIBRARY and no PYTHONPATH, imports
kvxfer from the venv, finds the library inside the installed package and
runs a transfer, imports TransferEngine from the mooncake shim and makes a
nixl_agent from the nixl shim."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import HERE

ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))

CHECK = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import kvxfer
    from mooncake.engine import TransferEngine
    from nixl._api import nixl_agent, nixl_agent_config
    from nixl._bindings import nixlXferTelemetry
    venv = sys.argv[1]
    assert kvxfer.__file__.startswith(venv), kvxfer.__file__
    assert kvxfer.library_path().startswith(os.path.dirname(kvxfer.__file__)), kvxfer.library_path()
    assert TransferEngine is kvxfer.TransferEngine
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, a.last_error
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, b.last_error
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    assert a.register_memory(src.ctypes.data, src.nbytes) == 0 and b.register_memory(dst.ctypes.data, dst.nbytes) == 0
    assert a.transfer_sync_write(b.segment_name, src.ctypes.data, dst.ctypes.data, src.nbytes) == 0, a.last_error
    assert (dst == src).all()
    a.close(); b.close()
    import nixl
    assert nixl.KVXFER_SHIM and nixl.__file__.startswith(venv), nixl.__file__
    n = nixl_agent("install-check", nixl_agent_config(backends=["UCX"]))
    assert len(n.get_agent_metadata()) > 20
    n.close()
    print("ok", kvxfer.version())
    """
)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed (scripts/install-deps.sh installs it)")
def test_make_python_install_in_fresh_venv(tmp_path):
    venv = str(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("KVXFER_LIBRARY", "PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run(["make", "--no-print-directory", "-C", ROOT, "python-install", f"VENV={venv}", "MOONCAKE=1", "NIXL=1",
                        f"PYTHON={sys.executable}"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, f"make python-install failed:\n{r.stdout}\n{r.stderr}"
    wheels = sorted(os.path.basename(w) for w in glob.glob(os.path.join(ROOT, "build", "python", "dist", "*.whl")))
    assert len(wheels) == 3, wheels
    assert wheels[0].startswith("kvxfer-") and "-py3-none-linux_" in wheels[0], wheels  # carries libkvxfer.so
    assert wheels[1].startswith("kvxfer_mooncake_shim-") and wheels[1].endswith("-py3-none-any.whl"), wheels
    assert wheels[2].startswith("kvxfer_nixl_shim-") and wheels[2].endswith("-py3-none-any.whl"), wheels
    r = subprocess.run([os.path.join(venv, "bin", "python"), "-c", CHECK, venv], capture_output=True, text=True,
                       env=env, cwd=str(tmp_path), timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok "), f"{r.stdout}\n{r.stderr}"
    assert os.access(os.path.join(venv, "bin", "mooncake_http_metadata_server"), os.X_OK)
    # Installing again over the same venv (an upgrade) works too.
    r = subprocess.run(["make", "--no-print-directory", "-C", ROOT, "python-install", f"VENV={venv}", f"PYTHON={sys.executable}"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, f"second make python-install failed:\n{r.stdout}\n{r.stderr}"
