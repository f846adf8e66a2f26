package cuda

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
