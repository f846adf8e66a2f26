#!/usr/bin/env bash
# rxe-vm.sh — run a command inside a throwaway QEMU/TCG guest that has a
# Soft-RoCE device (rxe0), so real libibverbs code runs on hosts with no RDMA
# NIC, no KVM and a kernel without InfiniBand (CI, laptops, this project's
# build machines).
#
# Usage:  scripts/rxe-vm.sh [-f FILE]... GUEST-COMMAND...
#   -f FILE   copy FILE (binary or script) into the guest's /payload, together
#             with the shared libraries ldd reports for it; repeatable.
#   GUEST-COMMAND is run by the guest's busybox sh in /payload. Its stdout and
#   stderr come back on this script's stdout, and its exit status becomes this
#   script's exit status (124/137: guest timeout, 125: guest setup failed,
#   126: the VM died or QEMU timed out before reporting).
#
# In the guest the command sees RXE_DEV=rxe0, RXE_NETDEV, RXE_IP (the address
# of the netdev under rxe0) and RXE_GID_IDX (the RoCE v2 IPv4 GID index of
# rxe0 port 1). PATH has busybox, ibv_* (ibverbs-utils), ib_* (perftest) and
# rdma (iproute2). Loopback (127.0.0.1) is up for out-of-band sockets.
#
# Knobs (environment, all optional):
#   RXE_VM_CACHE   cache dir for the unpacked kernel (default scripts/.rxe-cache,
#                  git-ignored); delete it to refetch
#   RXE_NETDEV     dummy (default: dummy0 10.11.12.1/24, RoCE MTU 1024) or lo
#   GUEST_TIMEOUT  seconds the guest command may run (default 480)
#   QEMU_TIMEOUT   seconds for the whole VM (default GUEST_TIMEOUT+60)
#   SMP, MEM       guest vCPUs and MiB (default 2, 2048)
#   KEEP=1         keep the per-run directory (initramfs, console log)
#
# Host packages: scripts/install-deps.sh rdma-vm (qemu-system-x86,
# busybox-static, ibverbs-utils, perftest, cpio, kmod, xz-utils, iproute2).
# The kernel is Debian's linux-image-amd64 target, fetched with
# `apt-get download` and unpacked into the cache (nothing is installed on the
# host). Facts behind the recipe (hidden crc32 dependency of rdma_rxe, PVH boot,
# output over a second UART) were measured on Debian 12 with kernel 6.1.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
CACHE=${RXE_VM_CACHE:-$here/.rxe-cache}
RXE_NETDEV=${RXE_NETDEV:-dummy}
GUEST_TIMEOUT=${GUEST_TIMEOUT:-480}
QEMU_TIMEOUT=${QEMU_TIMEOUT:-$((GUEST_TIMEOUT + 60))}
SMP=${SMP:-2}
MEM=${MEM:-2048}
ARCH=x86_64-linux-gnu

files=()
while [ $# -gt 0 ]; do
  case "$1" in
    -f) [ $# -ge 2 ] || { echo "rxe-vm.sh: -f needs a file" >&2; exit 2; }
        [ -e "$2" ] || { echo "rxe-vm.sh: -f $2: no such file" >&2; exit 2; }
        files+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || { sed -n '2,34p' "$0" >&2; exit 2; }

t0=$(date +%s)
note() { echo "[rxe-vm $(( $(date +%s) - t0 ))s] $*" >&2; }

missing=()
for tool in qemu-system-x86_64 busybox ibv_devinfo ib_write_bw rdma cpio depmod xz; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "rxe-vm.sh: missing host tools: ${missing[*]}; run: bash scripts/install-deps.sh rdma-vm" >&2
  exit 2
fi
provider=$(ls /usr/lib/$ARCH/libibverbs/librxe-rdmav*.so 2>/dev/null | head -1 || true)
[ -n "$provider" ] || { echo "rxe-vm.sh: no rxe provider (librxe-rdmav*.so); run: bash scripts/install-deps.sh rdma-vm" >&2; exit 2; }

# ---- kernel: unpack the package linux-image-amd64 depends on, once.
mkdir -p "$CACHE"
if [ ! -s "$CACHE/kernel.version" ]; then
  pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
  [ -n "$pkg" ] || { echo "rxe-vm.sh: apt-cache cannot resolve linux-image-amd64 (run apt-get update)" >&2; exit 2; }
  note "fetching $pkg (about 70 MB, once)"
  rm -rf "$CACHE/kroot" "$CACHE"/*.deb
  (cd "$CACHE" && timeout 600 apt-get -q -o APT::Sandbox::User=root download "$pkg" >&2)
  timeout 300 dpkg-deb -x "$CACHE"/linux-image-*.deb "$CACHE/kroot"
  rm -f "$CACHE"/*.deb
  kv=$(ls "$CACHE/kroot/lib/modules")
  timeout 300 depmod -b "$CACHE/kroot" "$kv"
  # Boot the uncompressed ELF through its PVH entry: ~3.5 s less per boot
  # under TCG than the bzImage's xz decompressor.
  img=$CACHE/kroot/boot/vmlinuz-$kv
  off=$(LC_ALL=C grep -abo $'\xfd7zXZ\x00' "$img" | head -1 | cut -d: -f1 || true)
  if [ -n "$off" ]; then
    tail -c +$((off + 1)) "$img" | xz -dc > "$CACHE/vmlinux" 2>/dev/null || true
  fi
  echo "$kv" > "$CACHE/kernel.version"
fi
KV=$(cat "$CACHE/kernel.version")
KROOT=$CACHE/kroot
KERNEL=$KROOT/boot/vmlinuz-$KV
if [ -s "$CACHE/vmlinux" ] && head -c 4 "$CACHE/vmlinux" | grep -q ELF; then
  KERNEL=$CACHE/vmlinux
fi

# ---- initramfs
run=$(mktemp -d "${TMPDIR:-/tmp}/rxe-vm.XXXXXX")
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$run"' EXIT
R=$run/root
mkdir -p "$R"/{usr/bin,usr/lib/$ARCH,usr/lib64,proc,sys,dev,tmp,run,etc,payload}
ln -s usr/bin "$R/bin"; ln -s usr/bin "$R/sbin"; ln -s bin "$R/usr/sbin"
ln -s usr/lib "$R/lib"; ln -s usr/lib64 "$R/lib64"

libs_of() { # copy the libraries (and the dynamic loader) ldd names for $1
  { ldd "$1" 2>/dev/null || true; } |
    awk '/=> \//{print $3} /^[ \t]*\/[^ ]*ld-linux/{print $1}' |
    while read -r l; do [ -e "$R$l" ] || cp -L --parents "$l" "$R/"; done
}
for f in /usr/bin/ibv_* /usr/bin/ib_{write,read,send}_{bw,lat} /usr/bin/rdma "$provider"; do
  cp -L --parents "$f" "$R/"; libs_of "$f"
done
mkdir -p "$R/etc/libibverbs.d"
echo "driver rxe" > "$R/etc/libibverbs.d/rxe.driver"
echo "127.0.0.1 localhost" > "$R/etc/hosts"
echo "root:x:0:0:root:/tmp:/bin/sh" > "$R/etc/passwd"
echo "root:x:0:" > "$R/etc/group"
cp "$(command -v busybox)" "$R/usr/bin/busybox"
for a in $("$R/usr/bin/busybox" --list); do
  [ -e "$R/usr/bin/$a" ] || ln -s busybox "$R/usr/bin/$a"
done

# Modules in dependency order. rdma_rxe takes the crc32 shash from the crypto
# API at device creation, a dependency modules.dep does not list: load the
# crc32 modules first or `rdma link add` fails with ENOENT.
: > "$R/etc/modules.load"
for m in crc32_generic crc32-pclmul dummy rdma_rxe; do
  modprobe -d "$KROOT" -S "$KV" --show-depends "$m" | while read -r cmd ko args; do
    [ "$cmd" = insmod ] || continue
    rel=${ko#"$KROOT"/}
    grep -qF "insmod /$rel " "$R/etc/modules.load" && continue
    (cd "$KROOT" && cp --parents "$rel" "$R/")
    echo "insmod /$rel $args" >> "$R/etc/modules.load"
  done
done

for f in "${files[@]}"; do
  cp -L "$f" "$R/payload/"; chmod +x "$R/payload/$(basename "$f")"; libs_of "$f"
done
printf '%s\n' "$*" > "$R/etc/payload.sh"

{ echo '#!/bin/sh'
  echo "RXE_NETDEV=$RXE_NETDEV GUEST_TIMEOUT=$GUEST_TIMEOUT"
  cat <<'EOF'
export PATH=/usr/bin HOME=/tmp TMPDIR=/tmp
mount -t proc proc /proc; mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev; mount -t tmpfs tmpfs /tmp
mkdir -p /dev/shm /dev/pts; mount -t tmpfs tmpfs /dev/shm
OUT=/dev/ttyS1
stty -F $OUT raw -echo
say() { echo "[guest $(cut -d' ' -f1 /proc/uptime)s] $*" > /dev/console; }
finish() { say "exit $1"; echo "@@RXE_VM_EXIT=$1" > $OUT; sync
           poweroff -f; sleep 5; echo o > /proc/sysrq-trigger; }
fail() { say "setup failed: $*"; dmesg | tail -20 > /dev/console; finish 125; }
while read -r l; do $l || say "failed: $l"; done < /etc/modules.load
ulimit -l unlimited
ip link set lo up
if [ "$RXE_NETDEV" = lo ]; then NETDEV=lo IP=127.0.0.1
else NETDEV=dummy0 IP=10.11.12.1
  ip link add dummy0 type dummy || fail "ip link add dummy0"
  ip addr add $IP/24 dev dummy0 && ip link set dummy0 up || fail "dummy0 up"
fi
rdma link add rxe0 type rxe netdev $NETDEV || fail "rdma link add rxe0 netdev $NETDEV"
P=/sys/class/infiniband/rxe0/ports/1 GID=
for i in $(seq 100); do
  for t in $P/gid_attrs/types/*; do
    n=${t##*/}
    [ "$(cat $t 2>/dev/null)" = "RoCE v2" ] || continue
    case $(cat $P/gids/$n) in *:ffff:*) GID=$n; break ;; esac
  done
  [ -n "$GID" ] && [ -e /dev/infiniband/uverbs0 ] && break
  sleep 0.1
done
[ -n "$GID" ] || fail "no RoCE v2 IPv4 GID on rxe0"
[ -e /dev/infiniband/uverbs0 ] || fail "/dev/infiniband/uverbs0 missing"
export RXE_DEV=rxe0 RXE_NETDEV=$NETDEV RXE_IP=$IP RXE_GID_IDX=$GID
say "rxe0 up on $NETDEV ($IP, GID index $GID)"
cd /payload
timeout -s KILL $GUEST_TIMEOUT sh /etc/payload.sh > $OUT 2>&1 < /dev/null
finish $?
EOF
} > "$R/init"
chmod +x "$R/init"

(cd "$R" && find . -print0 | cpio --null -o -H newc --quiet) | gzip -1 > "$run/initrd"
note "initramfs $(du -h "$run/initrd" | cut -f1), kernel $KV; booting ($SMP vCPU, ${MEM} MiB, TCG)"

set +e
timeout -k 10 "$QEMU_TIMEOUT" qemu-system-x86_64 \
  -accel tcg,thread=multi -machine pc -cpu max -smp "$SMP" -m "$MEM" \
  -nodefaults -nic none -no-reboot -display none -monitor none \
  -kernel "$KERNEL" -initrd "$run/initrd" \
  -append "console=ttyS0 panic=-1 mitigations=off quiet loglevel=4" \
  -serial "file:$run/console.log" -serial "file:$run/output.log" \
  </dev/null >"$run/qemu.log" 2>&1
qrc=$?
set -e

tr -d '\r' < "$run/output.log" > "$run/output.txt"
rc=$(grep -a '^@@RXE_VM_EXIT=' "$run/output.txt" | tail -1 | cut -d= -f2 || true)
grep -av '^@@RXE_VM_EXIT=' "$run/output.txt" || true
if [ -z "$rc" ] || [ "$rc" = 125 ]; then
  echo "---- guest console (tail), qemu rc $qrc ----" >&2
  tr -d '\r' < "$run/console.log" | tail -40 >&2
  cat "$run/qemu.log" >&2
  rc=${rc:-126}
fi
grep -a '^\[guest' "$run/console.log" | tr -d '\r' >&2 || true
note "guest exit status $rc"
[ "${KEEP:-0}" = 1 ] && note "kept $run"
exit "$rc"
