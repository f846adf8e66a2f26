#!/usr/bin/env bash
# gpu-check.sh — the one prepared run for a lent GPU machine (NVIDIA H200,
# CUDA 13, 16 cores, no Go toolchain, no internet). It runs the binaries that
# scripts/build-device-bundle.sh built here and carried in device-bundle/:
#
#   1. environment: nvidia-smi, driver, the CUDA libraries found, lib mode;
#   2. kvxfer topo (table and --json);
#   3. the cuda package tests with KVXFER_REQUIRE_GPU=1 (a skip is a failure):
#      devices, memory round trip, dma-buf, the GPU proof kernel; the staging
#      benchmark's tests (bench/gpustaging);
#   4. kvxfer gpucheck --require: GPU proof on the engine's metadata ring,
#      tcp and shm transfers with device-memory KV pools (bytes verified),
#      device<->host staging vs a plain cudaMemcpy of the same size;
#   5. the remaining test binaries (gputopo, engine incl. the ring GPU proof
#      and the stream-ordered layer-wise room: a CUDA stream held by a gate,
#      each layer's copies and its event handed to SendLayers, nothing sent
#      before the gate opens, every byte after; engine/tcp, engine/shm,
#      cmd/kvxfer, internal/pciaddr), and demo --layerwise with device KV;
#   6. a short table, printed last.
#
# It stays under GPU_CHECK_BUDGET_S (default 420 s): each step's timeout is cut
# to what is left, and steps past the budget are reported as skipped.
#
# Usage (device call, from the repository root, carry ["device-bundle"]):
#   bash scripts/gpu-check.sh
# Env: OUT (where logs go; the device tool sets it), KVXFER_BUNDLE (archive
# path), KVXFER_REQUIRE_GPU (default 1), GPU_CHECK_BUDGET_S.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=${KVXFER_BUNDLE:-$ROOT/device-bundle/bundle.tar.xz}
OUTDIR=${OUT:-/tmp/kvx-gpu-check}
BUDGET=${GPU_CHECK_BUDGET_S:-420}
export KVXFER_REQUIRE_GPU=${KVXFER_REQUIRE_GPU-1}
START=$(date +%s)
mkdir -p "$OUTDIR"
LOG=$OUTDIR/gpu-check.log
: >"$LOG"

say() { echo "$*" | tee -a "$LOG"; }
elapsed() { echo $(($(date +%s) - START)); }

STEPS=() STATUS=() SECS=() NOTES=()
record() { STEPS+=("$1"); STATUS+=("$2"); SECS+=("$3"); NOTES+=("$4"); }

# ---- unpack -----------------------------------------------------------------
if [ ! -f "$BUNDLE" ]; then
	say "gpu-check: bundle $BUNDLE not found: run scripts/build-device-bundle.sh and carry device-bundle/"
	exit 2
fi
WORK=$(mktemp -d /tmp/kvx-bundle.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
if command -v xz >/dev/null; then
	xz -dc "$BUNDLE" | tar -C "$WORK" -xf -
else
	python3 -c 'import lzma,tarfile,sys; tarfile.open(fileobj=lzma.open(sys.argv[1])).extractall(sys.argv[2])' "$BUNDLE" "$WORK"
fi || { say "gpu-check: cannot unpack $BUNDLE"; exit 2; }
say "gpu-check: bundle commit $(cat "$WORK/COMMIT"), unpacked in $(elapsed) s"

# ---- libraries: bundle first; fall back to our libstdc++, then our glibc ----
RUN=()
export LD_LIBRARY_PATH="$WORK/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
LIBMODE=bundle
if ! "$WORK/bin/kvxfer" --help >/dev/null 2>"$OUTDIR/probe.err"; then
	export LD_LIBRARY_PATH="$WORK/lib:$WORK/lib/fallback${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
	LIBMODE=bundle+libstdc++
	if ! "$WORK/bin/kvxfer" --help >/dev/null 2>>"$OUTDIR/probe.err"; then
		RUN=("$WORK/lib/glibc/ld-linux-x86-64.so.2" --library-path "$WORK/lib/glibc:$WORK/lib/fallback:$WORK/lib")
		LIBMODE="bundled glibc loader (children that re-exec themselves may fail)"
	fi
fi

# ---- CUDA libraries the dynamic loader may not know --------------------------
find_cuda_lib() { # name-glob env-var
	local glob=$1 var=$2 hit
	[ -n "${!var:-}" ] && return
	if ldconfig -p 2>/dev/null | grep -q "${glob%\*}"; then return; fi
	hit=$(ls -1 /usr/local/cuda/lib64/$glob /usr/local/cuda-1[23]*/lib64/$glob \
		/usr/local/cuda*/targets/x86_64-linux/lib/$glob 2>/dev/null | head -1)
	if [ -z "$hit" ]; then
		hit=$(timeout 20 find / -xdev \( -path /proc -o -path /sys \) -prune -o -name "$glob" -print 2>/dev/null | head -1)
	fi
	if [ -n "$hit" ]; then
		export "$var=$hit"
		export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(dirname "$hit")"
	fi
}
find_cuda_lib 'libcudart.so.1[23]*' KVXFER_CUDART
find_cuda_lib 'libnvrtc.so.1[23]*' KVXFER_NVRTC

{
	echo "== environment"
	echo "host: $(uname -srm); $(nproc) cpus; glibc $(ldd --version 2>/dev/null | head -1 | awk '{print $NF}')"
	echo "lib mode: $LIBMODE"
	echo "KVXFER_CUDART=${KVXFER_CUDART:-<loader default>} KVXFER_NVRTC=${KVXFER_NVRTC:-<loader default>}"
	ldconfig -p 2>/dev/null | grep -E 'libcuda\.so|libcudart|libnvrtc\.so|libnvidia-ml' | head -8
	if command -v nvidia-smi >/dev/null; then
		nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version,memory.total --format=csv
		nvidia-smi topo -m 2>/dev/null | head -12
	else
		echo "nvidia-smi: not found"
	fi
	lsmod 2>/dev/null | grep -E '^(nvidia_peermem|nvidia) ' || true
	echo "memlock: $(ulimit -l)"
} >"$OUTDIR/env.log" 2>&1
cat "$OUTDIR/env.log" | tee -a "$LOG"

# step NAME TIMEOUT CWD CMD... — run with the remaining budget, log to
# $OUTDIR/NAME.log, record PASS/FAIL/SKIP.
step() {
	local name=$1 tmo=$2 cwd=$3
	shift 3
	local left=$((BUDGET - $(elapsed) - 15))
	if [ "$left" -lt 20 ]; then
		record "$name" SKIP 0 "budget of ${BUDGET}s used up"
		say "-- $name: skipped (budget)"
		return
	fi
	[ "$tmo" -gt "$left" ] && tmo=$left
	local t0 rc note
	t0=$(date +%s)
	say "-- $name (timeout ${tmo}s)"
	(cd "$cwd" && timeout -k 5 "$tmo" "${RUN[@]}" "$@") >"$OUTDIR/$name.log" 2>&1
	rc=$?
	local dt=$(($(date +%s) - t0))
	local pass fail skip
	pass=$(grep -c -- '^--- PASS\|^    --- PASS' "$OUTDIR/$name.log")
	fail=$(grep -c -- '--- FAIL' "$OUTDIR/$name.log")
	skip=$(grep -c -- '--- SKIP' "$OUTDIR/$name.log")
	note="tests: $pass pass, $fail fail, $skip skip"
	[ $((pass + fail + skip)) -eq 0 ] && note="exit $rc"
	[ "$rc" -eq 124 ] && note="TIMEOUT after ${tmo}s; $note"
	if [ "$rc" -eq 0 ]; then
		record "$name" PASS "$dt" "$note"
	else
		record "$name" FAIL "$dt" "$note"
		if [ "$fail" -gt 0 ]; then
			grep -h -A6 -- '^--- FAIL\|^    --- FAIL' "$OUTDIR/$name.log" | head -40 | sed 's/^/   | /' | tee -a "$LOG"
		else
			tail -n 15 "$OUTDIR/$name.log" | sed 's/^/   | /' | tee -a "$LOG"
		fi
	fi
	grep -h -- '--- SKIP' "$OUTDIR/$name.log" | head -10 | sed 's/^/   /' | tee -a "$LOG"
}

K="$WORK/bin/kvxfer"
T="$WORK/tests"
step topo 30 "$ROOT" "$K" topo
cat "$OUTDIR/topo.log" >>"$LOG"
step topo-json 30 "$ROOT" "$K" topo --json
step cuda-tests 150 "$ROOT/cuda" "$T/cuda.test" -test.v -test.count=1 -test.timeout 140s
step staging-tests 60 "$ROOT/bench/gpustaging" "$T/bench_gpustaging.test" -test.v -test.count=1 -test.timeout 50s
step gpucheck 150 "$ROOT" "$K" gpucheck --require --size-mib 256 --staging-mib 512 --timeout 60s
# The real prefill/decode processes with their KV pools in device memory
# (filled and verified through host copies, CRC32C checked; tcp bounce).
step demo-device 90 "$ROOT" "$K" demo --device cuda:0 --requests 8 --pool-mb 512 --checksum --no-progress --seed 7
step gputopo-tests 30 "$ROOT/cuda/gputopo" "$T/cuda_gputopo.test" -test.v -test.count=1
step engine-ring-gpu 60 "$ROOT/engine" "$T/engine.test" -test.v -test.count=1 -test.run 'Ring'
# Layer-wise sending waiting for CUDA events (issue 24): TestLayerwiseCUDAEventGPU
# (device-memory KV, gate + copies + an event per layer), TestGPUEventGate in cuda-tests.
step engine-layerwise-gpu 60 "$ROOT/engine" "$T/engine.test" -test.v -test.count=1 -test.run 'LayerwiseCUDAEventGPU|EventPoller'
step demo-layerwise-device 90 "$ROOT" "$K" demo --device cuda:0 --layerwise --requests 3 --prompt-tokens 2048 --pool-mb 512 --concurrency 1 --prefill-tflops 200 --no-progress --bench=false --seed 7
# The NIXL-shaped agent's VRAM path (vLLM's NixlConnector with
# kv_buffer_device cuda): device blocks READ between two agents over tcp.
step agent-vram-gpu 60 "$ROOT/engine/agent" "$T/engine_agent.test" -test.v -test.count=1 -test.run 'VRAMGPU'
step tcp-tests 120 "$ROOT/engine/tcp" "$T/engine_tcp.test" -test.v -test.count=1 -test.timeout 110s
step shm-tests 120 "$ROOT/engine/shm" "$T/engine_shm.test" -test.v -test.count=1 -test.timeout 110s
step cmd-tests 60 "$ROOT/cmd/kvxfer" "$T/cmd_kvxfer.test" -test.v -test.count=1 -test.run 'Topo|GPUCheck'
step pciaddr-tests 20 "$ROOT/internal/pciaddr" "$T/internal_pciaddr.test" -test.count=1
step engine-tests 150 "$ROOT/engine" "$T/engine.test" -test.count=1 -test.v -test.timeout 140s

# ---- the table, last ----------------------------------------------------------
{
	echo
	echo "== kvxfer gpucheck (device-memory KV pools over tcp/shm, ring proof, staging)"
	grep -A 40 '^CHECK' "$OUTDIR/gpucheck.log" || echo "(no gpucheck table: see gpucheck.log)"
	grep -h '^STAGING' "$OUTDIR/staging-tests.log" 2>/dev/null | head -1
	grep -h 'GPU read bootstrap_room' "$OUTDIR/engine-ring-gpu.log" 2>/dev/null | head -3 | sed 's/^ *//'
	echo "== kvxfer demo --device cuda:0 (device-memory KV pools, real sender/receiver)"
	grep -E '^(transport|requests|bytes|GB/s|transfer latency|failures) ' "$OUTDIR/demo-device.log" 2>/dev/null || echo "(no demo summary: see demo-device.log)"
	echo "== kvxfer demo --device cuda:0 --layerwise (whole-room vs layer-wise, device-memory KV)"
	grep -E '^(whole-room:|layer-wise:|one layer|target |rooms:)' "$OUTDIR/demo-layerwise-device.log" 2>/dev/null || echo "(no layer-wise summary: see demo-layerwise-device.log)"
	echo
	echo "== gpu-check summary (commit $(cat "$WORK/COMMIT"), lib mode: $LIBMODE, $(elapsed) s of ${BUDGET} s)"
	printf '%-16s %-5s %5s  %s\n' STEP RESULT SECS NOTE
	for i in "${!STEPS[@]}"; do
		printf '%-16s %-5s %5s  %s\n' "${STEPS[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${NOTES[$i]}"
	done
} | tee -a "$LOG"

for s in "${STATUS[@]}"; do
	[ "$s" = FAIL ] && exit 1
done
exit 0
