"""The ctypes structs in kvxfer._lib match include/kvxfer.h: a C program
compiled against the header prints every struct's size and every field's
offset, and each must equal ctypes' layout (catches a field appended to the
header but not here, or a reordered one)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from kvxfer import _lib

HEADER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "include")


def test_structs_match_the_header(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc/gcc) to compile the header check; scripts/install-deps.sh installs g++")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "kvxfer.h"', "int main(void) {"]
    for cname, st in _lib.C_STRUCTS.items():
        lines.append(f'printf("{cname} %zu\\n", sizeof({cname}));')
        for field, _ in st._fields_:
            lines.append(f'printf("{cname}.{field} %zu\\n", offsetof({cname}, {field}));')
    lines += ["return 0;", "}"]
    src = tmp_path / "abi.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "abi"
    subprocess.run([cc, "-I", HEADER_DIR, "-o", str(exe), str(src)], check=True)
    got = dict(line.split() for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines())
    for cname, st in _lib.C_STRUCTS.items():
        assert int(got[cname]) == ctypes.sizeof(st), f"sizeof({cname}): C {got[cname]}, ctypes {ctypes.sizeof(st)}"
        for field, _ in st._fields_:
            off = getattr(st, field).offset
            assert int(got[f"{cname}.{field}"]) == off, f"offsetof({cname}, {field}): C {got[cname + '.' + field]}, ctypes {off}"


def test_every_struct_field_of_the_header_is_bound():
    """Fields are only ever appended to the header's config structs: the
    ctypes struct must end where the C struct ends (its size equals
    sizeof), which test_structs_match_the_header checks; here the versioned
    sizes are pinned as the header states them."""
    assert _lib.KV_CONFIG_SIZE_V1 == _lib.KVConfig.reserved1.offset + 4
    assert _lib.KV_CONFIG_SIZE_V2 == _lib.KVConfig.ib_device.offset + 8
    assert _lib.KV_CONFIG_SIZE_V3 == _lib.KVConfig.advertise_host.offset + 8 == _lib.KVConfig.control_auth.offset
    assert _lib.KV_CONFIG_SIZE_V4 == _lib.KVConfig.max_peers.offset + 4 == _lib.KVConfig.decode_allocation_policy.offset
    assert _lib.KV_CONFIG_SIZE_V5 == _lib.KVConfig.dsv41_spec_layout.offset + 8 == _lib.KVConfig.prefill_http_port.offset
    assert _lib.ENGINE_CONFIG_SIZE_V1 == _lib.EngineConfig.streams.offset + 4
    assert ctypes.sizeof(_lib.WriteRequest) == 48


def test_status_codes_match_the_header():
    text = open(os.path.join(HEADER_DIR, "kvxfer.h")).read()
    import re

    header = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s*(KVX_(?:OK|ERR_[A-Z_]+))\s*=\s*(\d+)", text, re.M)}
    assert header == {name: code for code, name in _lib.STATUS_NAMES.items()}
    for code, name in _lib.STATUS_NAMES.items():
        assert _lib.strerror(code)  # the library knows every code
