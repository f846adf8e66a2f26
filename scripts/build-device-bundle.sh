#!/usr/bin/env bash
# build-device-bundle.sh — build, on this machine, everything the lent GPU
# machine needs to run scripts/gpu-check.sh: that machine has CUDA and an
# NVIDIA driver but no Go toolchain and no internet.
#
# Output (git-ignored): device-bundle/
#   bundle.tar.xz   bin/kvxfer, tests/<pkg>.test (go test -c), lib/ (the
#                   shared libraries ldd names: libzmq and its deps,
#                   libibverbs, ...; lib/fallback: libstdc++/libgcc_s, used
#                   only if the host's are too old; lib/glibc: this host's
#                   glibc and loader, a last resort), COMMIT, BUILD-INFO
#   gpu-check.sh    a copy of the check script
#
# Usage: scripts/build-device-bundle.sh
# Then, on the device: carry ["device-bundle"], command
#   bash scripts/gpu-check.sh        (it finds device-bundle/bundle.tar.xz)
# The whole folder must stay under the device call's 64 MiB carry limit;
# binaries are stripped (-s -w) and the archive is xz-compressed.
set -euo pipefail
cd "$(dirname "$0")/.."

B=device-bundle
S=$B/stage
rm -rf "$B"
mkdir -p "$S/bin" "$S/tests" "$S/lib/fallback" "$S/lib/glibc"
export CGO_ENABLED=1
LDF="-s -w"
# Packages whose test binaries run on the device. The cuda tests and the
# engine ring proof turn GPU skips into failures under KVXFER_REQUIRE_GPU=1.
PKGS=(cuda cuda/gputopo bench/gpustaging engine engine/tcp engine/shm engine/agent cmd/kvxfer internal/pciaddr)

quiet() { # go-nvml's cgo prints deprecation warnings; keep real errors
	"$@" 2> >(grep -v -e 'warning:' -e 'note:' -e '^ *[0-9]* |' -e '^ *|' -e 'cgo-gcc-prolog' \
		-e 'In file included' -e '^# github.com/NVIDIA' >&2)
}

echo "build: kvxfer"
quiet go build -ldflags "$LDF" -o "$S/bin/kvxfer" ./cmd/kvxfer
for p in "${PKGS[@]}"; do
	name=$(echo "$p" | tr / _)
	echo "build: $p -> tests/$name.test"
	quiet go test -c -ldflags "$LDF" -o "$S/tests/$name.test" "./$p"
done

echo "libs: collecting from ldd"
for f in "$S"/bin/* "$S"/tests/*; do ldd "$f" 2>/dev/null || true; done |
	awk '/=> \// {print $3}' | sort -u | while read -r lib; do
	base=$(basename "$lib")
	case "$base" in
	libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.* | libresolv.so.* | ld-linux*)
		cp -L "$lib" "$S/lib/glibc/" ;;
	libstdc++.so.* | libgcc_s.so.*)
		cp -L "$lib" "$S/lib/fallback/" ;;
	*)
		cp -L "$lib" "$S/lib/" ;;
	esac
done
cp -L /lib64/ld-linux-x86-64.so.2 "$S/lib/glibc/"
cp scripts/gpu-check.sh "$S/"
git rev-parse HEAD >"$S/COMMIT" 2>/dev/null || echo unknown >"$S/COMMIT"
{
	echo "built: $(date -u +%FT%TZ) on $(uname -srm)"
	go version
	echo "glibc: $(ldd --version | head -1)"
	echo "dirty files: $(git status --porcelain 2>/dev/null | wc -l)"
	ls -la "$S/bin" "$S/tests" "$S/lib"
} >"$S/BUILD-INFO"

tar -C "$S" -cf - . | xz -T2 -6 >"$B/bundle.tar.xz"
cp scripts/gpu-check.sh "$B/"
rm -rf "$S"
size=$(du -sm "$B" | cut -f1)
echo "bundle: $B ($(du -sh "$B/bundle.tar.xz" | cut -f1) compressed, ${size} MiB on disk)"
if [ "$size" -ge 64 ]; then
	echo "bundle: ${size} MiB exceeds the 64 MiB carry limit; drop test packages from PKGS" >&2
	exit 1
fi
