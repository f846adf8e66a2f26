"""Where libkvxfer.so is found: KVXFER_LIBRARY, the package directory, the
linker path; and the error naming all three when it is nowhere. Each case
runs in a fresh interpreter (the library loads once per process)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import kvxfer

PKG = os.path.dirname(os.path.abspath(kvxfer.__file__))


def lib_file():
    path = os.environ.get("KVXFER_LIBRARY") or kvxfer.library_path()
    return os.path.realpath(path)


def run(code, env, cwd):
    e = {k: v for k, v in os.environ.items() if k not in ("KVXFER_LIBRARY", "LD_LIBRARY_PATH", "PYTHONPATH")}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], env=e, cwd=cwd, capture_output=True, text=True, timeout=120)


def copy_package(tmp_path):
    dst = tmp_path / "site" / "kvxfer"
    shutil.copytree(PKG, dst, ignore=shutil.ignore_patterns("libkvxfer.so*", "__pycache__"))
    return dst


def test_missing_library_names_all_three_places(tmp_path):
    pkg = copy_package(tmp_path)
    r = run("import kvxfer\ntry:\n kvxfer.TransferEngine()\nexcept kvxfer.LibraryNotFoundError as e:\n print(e)\n",
            {"PYTHONPATH": str(pkg.parent), "LD_LIBRARY_PATH": str(tmp_path)}, tmp_path)
    msg = r.stdout
    assert r.returncode == 0, r.stderr
    assert "KVXFER_LIBRARY is not set" in msg, msg
    assert f"package directory {pkg}" in msg, msg
    assert "linker path" in msg and "make python-lib" in msg, msg


def test_bad_kvxfer_library(tmp_path):
    pkg = copy_package(tmp_path)
    r = run("import kvxfer\ntry:\n kvxfer.TransferEngine()\nexcept ImportError as e:\n print(e)\n",
            {"PYTHONPATH": str(pkg.parent), "KVXFER_LIBRARY": str(tmp_path / "nope.so")}, tmp_path)
    assert f"KVXFER_LIBRARY={tmp_path / 'nope.so'} cannot be loaded" in r.stdout, r.stdout + r.stderr


def test_found_via_env(tmp_path):
    pkg = copy_package(tmp_path)
    r = run("import kvxfer; kvxfer.TransferEngine(); print(kvxfer.library_path())",
            {"PYTHONPATH": str(pkg.parent), "KVXFER_LIBRARY": lib_file()}, tmp_path)
    assert r.stdout.strip() == lib_file(), r.stderr


def test_found_in_package_directory(tmp_path):
    pkg = copy_package(tmp_path)
    shutil.copy(lib_file(), pkg / "libkvxfer.so")
    r = run("import kvxfer; kvxfer.TransferEngine(); print(kvxfer.library_path())", {"PYTHONPATH": str(pkg.parent)}, tmp_path)
    assert r.stdout.strip() == str(pkg / "libkvxfer.so"), r.stderr


def test_found_on_linker_path(tmp_path):
    pkg = copy_package(tmp_path)
    libdir = tmp_path / "lib"
    libdir.mkdir()
    shutil.copy(lib_file(), libdir / "libkvxfer.so.0")
    r = run("import kvxfer; kvxfer.TransferEngine(); print(kvxfer.library_path(), kvxfer.version())",
            {"PYTHONPATH": str(pkg.parent), "LD_LIBRARY_PATH": str(libdir)}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "libkvxfer.so.0"
    assert r.stdout.split()[1].startswith("0.")


@pytest.mark.skipif(shutil.which("pip3") is None and not os.path.exists("/usr/lib/python3/dist-packages/pip"), reason="pip is not installed")
def test_pip_install_offline(tmp_path):
    """`pip install ./python` in a venv, offline (Debian's setuptools, no
    build isolation, no index), bundles the library named by KVXFER_LIBRARY
    into the package directory, so the installed package needs no variable."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    src = tmp_path / "src"
    shutil.copytree(os.path.join(PKG, ".."), src, ignore=shutil.ignore_patterns("tests", "build", "*.egg-info", "__pycache__", "libkvxfer.so*"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(KVXFER_LIBRARY=lib_file(), PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-build-isolation", "--no-index", str(src)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([str(py), "-c", "import kvxfer, kvxfer.sglang; e = kvxfer.TransferEngine(); print(kvxfer.library_path())"],
                       env={k: v for k, v in os.environ.items() if k not in ("KVXFER_LIBRARY", "PYTHONPATH", "LD_LIBRARY_PATH")},
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(str(venv)) and "site-packages/kvxfer/libkvxfer.so" in r.stdout, r.stdout
