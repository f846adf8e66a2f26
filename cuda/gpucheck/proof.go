// Package gpucheck holds the GPU proof kernel built on the cuda binding: a
// metadata-ring slot read by device code (CheckRoom), which `kvxfer
// gpucheck`, the engine's ring tests and scripts/gpu-check.sh use to prove
// the ring is GPU-visible. The binding (package cuda) only wraps the CUDA
// libraries; the staging benchmark is bench/gpustaging.
package gpucheck

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvxfer/kvxfer/cuda"
)

// ErrRoomMismatch: the GPU proof kernel read a bootstrap_room different
// from the one expected.
var ErrRoomMismatch = errors.New("gpucheck: bootstrap_room mismatch read by the GPU")

// The GPU proof kernel. It reads the 8-byte little-endian bootstrap_room at
// offset 0 of a metadata-ring slot through the slot's device pointer and
// writes {room read, 1 if equal to expected else 0} to out[0..1]. It proves
// that the ring is GPU-visible and that the device sees the record layout
// the host wrote (engine/ring.go: 64-byte records, room at offset 0).

// ProofKernelName is the kernel's (unmangled) entry name.
const ProofKernelName = "kvx_check_room"

// ProofSource is the kernel in CUDA C, compiled at run time by NVRTC.
const ProofSource = `
extern "C" __global__ void kvx_check_room(const volatile unsigned long long *slot,
                                          unsigned long long expected,
                                          unsigned long long *out)
{
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned long long room = slot[0];
    out[0] = room;
    out[1] = (room == expected) ? 1ULL : 0ULL;
}
`

// ProofPTX is the same kernel written directly in PTX (ISA 7.0, sm_80 and
// newer: Ampere, Hopper, Blackwell), loaded with cuModuleLoadData when NVRTC
// is not installed; the driver JIT-compiles it for the device.
const ProofPTX = `
.version 7.0
.target sm_80
.address_size 64

.visible .entry kvx_check_room(
	.param .u64 kvx_check_room_param_0,
	.param .u64 kvx_check_room_param_1,
	.param .u64 kvx_check_room_param_2
)
{
	.reg .pred 	%p<2>;
	.reg .b64 	%rd<8>;

	ld.param.u64 	%rd1, [kvx_check_room_param_0];
	ld.param.u64 	%rd2, [kvx_check_room_param_1];
	ld.param.u64 	%rd3, [kvx_check_room_param_2];
	cvta.to.global.u64 	%rd4, %rd1;
	cvta.to.global.u64 	%rd5, %rd3;
	ld.volatile.global.u64 	%rd6, [%rd4];
	st.global.u64 	[%rd5], %rd6;
	setp.eq.s64 	%p1, %rd6, %rd2;
	selp.u64 	%rd7, 1, 0, %p1;
	st.global.u64 	[%rd5+8], %rd7;
	ret;
}
`

// ProofMode says how the proof kernel was built.
type ProofMode string

const (
	// ProofAuto tries NVRTC and falls back to the built-in PTX.
	ProofAuto ProofMode = "auto"
	// ProofNVRTC compiles ProofSource with NVRTC (fails if NVRTC is absent).
	ProofNVRTC ProofMode = "nvrtc"
	// ProofBuiltinPTX loads ProofPTX with the driver's JIT.
	ProofBuiltinPTX ProofMode = "ptx"
)

// CheckRoom runs the GPU proof kernel on dev: it reads the 8-byte
// little-endian bootstrap_room at device address slot (a ring slot's device
// pointer, e.g. HostMem.DevicePtr()+slot*64) and compares it with expected.
// mode picks NVRTC, the built-in PTX or auto (NVRTC, then PTX). It returns
// the room the GPU read and the mode actually used; the error wraps
// ErrRoomMismatch when the GPU read a different room, cuda.ErrInvalidValue
// for an unknown mode, cuda.ErrLibraryNotFound for ProofNVRTC without NVRTC.
func CheckRoom(dev int, slot cuda.DevicePtr, expected uint64, mode ProofMode) (got uint64, used ProofMode, err error) {
	image, used, err := proofImage(dev, mode)
	if err != nil {
		return 0, used, err
	}
	mod, err := cuda.LoadModule(dev, image)
	if err != nil {
		return 0, used, fmt.Errorf("gpucheck: proof kernel (%s): load module: %w", used, err)
	}
	defer mod.Close()
	out, err := cuda.Malloc(dev, 16)
	if err != nil {
		return 0, used, fmt.Errorf("gpucheck: proof kernel: result buffer: %w", err)
	}
	defer cuda.Free(dev, out)
	if err := cuda.Memset(dev, out, 0xff, 16); err != nil {
		return 0, used, err
	}
	if err := mod.Launch3(ProofKernelName, uint64(slot), expected, uint64(out)); err != nil {
		return 0, used, fmt.Errorf("gpucheck: proof kernel (%s) on device %d: %w", used, dev, err)
	}
	var res [16]byte
	if err := cuda.CopyFromDevice(dev, res[:], out); err != nil {
		return 0, used, fmt.Errorf("gpucheck: proof kernel: read result: %w", err)
	}
	got = binary.LittleEndian.Uint64(res[0:8])
	if ok := binary.LittleEndian.Uint64(res[8:16]); ok != 1 {
		return got, used, fmt.Errorf("gpucheck: proof kernel on device %d: slot %#x holds room %d, want %d: %w", dev, uint64(slot), got, expected, ErrRoomMismatch)
	}
	return got, used, nil
}

// proofImage returns PTX for the proof kernel according to mode.
func proofImage(dev int, mode ProofMode) (string, ProofMode, error) {
	if mode == "" {
		mode = ProofAuto
	}
	switch mode {
	case ProofBuiltinPTX:
		return ProofPTX, ProofBuiltinPTX, nil
	case ProofNVRTC, ProofAuto:
		ptx, err := cuda.CompileNVRTC(dev, ProofSource, "kvx_check_room.cu")
		if err == nil {
			return ptx, ProofNVRTC, nil
		}
		if mode == ProofAuto && errors.Is(err, cuda.ErrLibraryNotFound) {
			return ProofPTX, ProofBuiltinPTX, nil
		}
		return "", ProofNVRTC, err
	}
	return "", mode, fmt.Errorf("gpucheck: proof kernel: unknown mode %q (want auto, nvrtc or ptx): %w", mode, cuda.ErrInvalidValue)
}
