#!/usr/bin/env bash
# install-deps.sh — install the Debian packages kvxfer needs, only when missing.
# Idempotent; safe to run on every `make`. Usage:
#   scripts/install-deps.sh            # build + test deps
#   scripts/install-deps.sh bench      # + peer tools for `kvxfer bench --peers`
#   scripts/install-deps.sh rdma-vm    # + QEMU/soft-RoCE VM harness packages
#   scripts/install-deps.sh all        # everything
set -euo pipefail

# etcd-server: the metadata tests start real etcd processes (metadata/,
# internal/etcdtest); Debian's package also enables an etcd service on
# 127.0.0.1:2379, which the tests do not use (they pick free ports).
# python3-*: the Python package's tests (make test-python) run on Debian's
# interpreter with pytest and numpy; `make python-wheel` builds the wheels
# offline with setuptools + wheel (without python3-wheel pip says "invalid
# command 'bdist_wheel'"), `make python-install` installs them into a venv
# (python3-venv) because Debian's own pip refuses the system interpreter
# ("externally-managed-environment").
base=(pkg-config libzmq3-dev libibverbs-dev ibverbs-providers cmake g++ make etcd-server
      python3 python3-pytest python3-numpy python3-setuptools python3-wheel python3-pip python3-venv)
bench=(iperf3 ucx-utils wrk)
rdmavm=(qemu-system-x86 busybox-static ibverbs-utils perftest cpio kmod xz-utils iproute2)

want=("${base[@]}")
for extra in "$@"; do
  case "$extra" in
    bench) want+=("${bench[@]}") ;;
    rdma-vm) want+=("${rdmavm[@]}") ;;
    all) want+=("${bench[@]}" "${rdmavm[@]}") ;;
    *) echo "install-deps.sh: unknown extra '$extra' (want: bench, rdma-vm, all)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if ! command -v go >/dev/null 2>&1 && [ ! -x /usr/local/go/bin/go ]; then
  echo "install-deps.sh: Go is not installed; install Go >= 1.26 from go.dev/dl first" >&2
fi
SUDO=
[ "$(id -u)" = 0 ] || SUDO=sudo
echo "install-deps.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
