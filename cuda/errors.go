package cuda

import (
	"errors"
	"fmt"
)

// Sentinel errors. Errors returned by this package wrap one or more of them;
// test with errors.Is.
var (
	// ErrNoCgo: the binary was built with CGO_ENABLED=0, so CUDA cannot be
	// loaded. Rebuild with cgo to use GPUs.
	ErrNoCgo = errors.New("cuda: built without cgo (CGO_ENABLED=0); rebuild with cgo to use CUDA")
	// ErrNotSupported: CUDA or the feature asked for cannot work on this host;
	// the error text says why.
	ErrNotSupported = errors.New("cuda: not supported")
	// ErrLibraryNotFound: libcudart, libcuda or libnvrtc could not be opened.
	ErrLibraryNotFound = errors.New("cuda: library not found")
	// ErrSymbolMissing: the library lacks a function kvxfer needs (too old a
	// driver or toolkit).
	ErrSymbolMissing = errors.New("cuda: symbol missing from library")
	// ErrNoDevice: the libraries load but no CUDA device is visible (check
	// nvidia-smi and CUDA_VISIBLE_DEVICES).
	ErrNoDevice = errors.New("cuda: no CUDA device")
	// ErrNotLoaded: a call was made before Load succeeded (or after Close).
	ErrNotLoaded = errors.New("cuda: libraries not loaded (call cuda.Load first)")
	// ErrOutOfMemory: a device or pinned host allocation failed for lack of
	// memory.
	ErrOutOfMemory = errors.New("cuda: out of memory")
	// ErrInvalidValue: CUDA rejected an argument (bad pointer, size or
	// ordinal).
	ErrInvalidValue = errors.New("cuda: invalid value")
	// ErrNotReady: the work an event or stream waits for has not completed
	// yet (cudaErrorNotReady / CUDA_ERROR_NOT_READY, code 600). Event.Query
	// reports it as (false, nil); an *Error carrying it only comes from a
	// call that wanted the work done.
	ErrNotReady = errors.New("cuda: not ready")
)

// codeNotReady is cudaErrorNotReady and CUDA_ERROR_NOT_READY (same number).
const codeNotReady Code = 600

// API names the library a code came from; runtime and driver codes are
// different enumerations.
type API uint8

//go:generate go run golang.org/x/tools/cmd/stringer@v0.51.0 -type API -linecomment -output api_string.go

const (
	// Runtime is libcudart (cudaError_t codes).
	Runtime API = iota // runtime
	// Driver is libcuda (CUresult codes).
	Driver // driver
	// NVRTC is libnvrtc (nvrtcResult codes).
	NVRTC // nvrtc
)

// Code is a CUDA status code as returned by the C function (cudaError_t,
// CUresult or nvrtcResult, by API). The negative codes are kvxfer's own:
// CodeSymbolMissing when the function pointer is NULL.
type Code int32

// CodeSymbolMissing is returned by the C helpers when the function is not in
// the loaded library (or no library is loaded). It is never a CUDA code.
const CodeSymbolMissing Code = -1

// Error is a failed CUDA call: the function, the library it came from and
// its status code. Error matches the package sentinels with errors.Is
// (ErrOutOfMemory, ErrNoDevice, ErrNotSupported, ErrSymbolMissing,
// ErrInvalidValue, ErrLibraryNotFound) according to the code.
type Error struct {
	// Op is the C function that failed, e.g. "cudaMalloc" or
	// "cuMemGetHandleForAddressRange".
	Op string
	// API says which enumeration Code belongs to.
	API API
	// Code is the status the function returned.
	Code Code
	// msg is the library's own message (cudaGetErrorString /
	// cuGetErrorString / nvrtcGetErrorString) when it was loaded.
	msg string
}

// Error returns "cuda: OP: MESSAGE (API error N)".
func (e *Error) Error() string {
	msg := e.msg
	if msg == "" {
		msg = builtinMessage(e.API, e.Code)
	}
	return fmt.Sprintf("cuda: %s: %s (%s error %d)", e.Op, msg, e.API, int32(e.Code))
}

// Unwrap returns the sentinel the code maps to (nil when none does).
func (e *Error) Unwrap() error { return e.sentinel() }

// Is reports whether target is the sentinel for e's code; ErrNotSupported
// also matches missing symbols, missing devices and unsupported operations.
func (e *Error) Is(target error) bool {
	s := e.sentinel()
	if s != nil && target == s {
		return true
	}
	if target == ErrNotSupported {
		return s == ErrSymbolMissing || s == ErrNoDevice || s == ErrNotSupported
	}
	return false
}

func (e *Error) sentinel() error {
	if e.Code == CodeSymbolMissing {
		return ErrSymbolMissing
	}
	switch e.API {
	case Runtime:
		switch e.Code {
		case 2:
			return ErrOutOfMemory
		case 1, 17, 101, 400:
			return ErrInvalidValue
		case 100:
			return ErrNoDevice
		case 34, 35, 801:
			return ErrNotSupported
		case codeNotReady:
			return ErrNotReady
		}
	case Driver:
		switch e.Code {
		case 2:
			return ErrOutOfMemory
		case 1, 101, 400:
			return ErrInvalidValue
		case 100:
			return ErrNoDevice
		case 34, 801:
			return ErrNotSupported
		case codeNotReady:
			return ErrNotReady
		}
	case NVRTC:
		if e.Code == 1 {
			return ErrOutOfMemory
		}
	}
	return nil
}

// builtinMessage is used when the library is not loaded (or did not give a
// message). Texts paraphrase the CUDA documentation of each code.
func builtinMessage(api API, c Code) string {
	if c == CodeSymbolMissing {
		return "function not found in the loaded library (library missing or too old)"
	}
	var m map[Code]string
	switch api {
	case Runtime:
		m = runtimeMessages
	case Driver:
		m = driverMessages
	case NVRTC:
		m = nvrtcMessages
	}
	if s, ok := m[c]; ok {
		return s
	}
	return "unrecognised error code"
}

// Code values from the CUDA runtime and driver API references (cudaError_t
// and CUresult share most numbers).
var runtimeMessages = map[Code]string{
	0:   "no error",
	1:   "invalid argument",
	2:   "out of memory",
	3:   "initialization error",
	4:   "driver shutting down",
	17:  "invalid device pointer",
	21:  "invalid copy direction",
	34:  "CUDA driver is a stub library",
	35:  "CUDA driver version is insufficient for CUDA runtime version",
	36:  "API call requires a newer CUDA driver",
	46:  "all CUDA-capable devices are busy or unavailable",
	100: "no CUDA-capable device is detected",
	101: "invalid device ordinal",
	200: "device kernel image is invalid",
	209: "no kernel image is available for execution on the device",
	218: "a PTX JIT compilation failed",
	222: "the provided PTX was compiled with an unsupported toolchain",
	304: "OS call failed or operation not supported on this OS",
	400: "invalid resource handle",
	600: "device not ready",
	700: "an illegal memory access was encountered",
	712: "part or all of the requested memory range is already mapped",
	719: "unspecified launch failure",
	800: "operation not permitted",
	801: "operation not supported",
	802: "system not yet initialized",
	803: "system has unsupported display driver / cuda driver combination",
	999: "unknown error",
}

var driverMessages = map[Code]string{
	0:   "no error",
	1:   "invalid argument",
	2:   "out of memory",
	3:   "initialization error (cuInit not called or failed)",
	4:   "driver shutting down",
	34:  "CUDA driver is a stub library",
	100: "no CUDA-capable device is detected",
	101: "invalid device ordinal",
	200: "device kernel image is invalid",
	201: "invalid device context",
	209: "no kernel image is available for execution on the device",
	218: "a PTX JIT compilation failed",
	222: "the provided PTX was compiled with an unsupported toolchain",
	300: "device kernel source is invalid",
	301: "file not found",
	304: "OS call failed or operation not supported on this OS",
	400: "invalid resource handle",
	500: "named symbol not found",
	600: "device not ready",
	700: "an illegal memory access was encountered",
	719: "unspecified launch failure",
	800: "operation not permitted",
	801: "operation not supported",
	802: "system not yet initialized",
	803: "system has unsupported display driver / cuda driver combination",
	999: "unknown error",
}

var nvrtcMessages = map[Code]string{
	0: "NVRTC_SUCCESS",
	1: "NVRTC_ERROR_OUT_OF_MEMORY",
	2: "NVRTC_ERROR_PROGRAM_CREATION_FAILURE",
	3: "NVRTC_ERROR_INVALID_INPUT",
	4: "NVRTC_ERROR_INVALID_PROGRAM",
	5: "NVRTC_ERROR_INVALID_OPTION",
	6: "NVRTC_ERROR_COMPILATION",
	7: "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE",
}

// notSupported builds the "not supported" outcome of Load: it matches
// ErrNotSupported and reason, and carries the detail text.
func notSupported(reason error, format string, args ...any) error {
	return &notSupportedError{reason: reason, detail: fmt.Sprintf(format, args...)}
}

type notSupportedError struct {
	reason error
	detail string
}

func (e *notSupportedError) Error() string        { return e.reason.Error() + ": " + e.detail }
func (e *notSupportedError) Unwrap() error        { return e.reason }
func (e *notSupportedError) Is(target error) bool { return target == ErrNotSupported }
