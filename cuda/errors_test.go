package cuda

import (
	"errors"
	"strings"
	"testing"
)

func TestErrorMapping(t *testing.T) {
	tests := []struct {
		err      *Error
		is       []error
		isNot    []error
		contains string
	}{
		{&Error{Op: "cudaMalloc", API: Runtime, Code: 2}, []error{ErrOutOfMemory}, []error{ErrNotSupported}, "out of memory (runtime error 2)"},
		{&Error{Op: "cudaGetDeviceCount", API: Runtime, Code: 100}, []error{ErrNoDevice, ErrNotSupported}, []error{ErrOutOfMemory}, "no CUDA-capable device"},
		{&Error{Op: "cuMemGetHandleForAddressRange", API: Driver, Code: 801}, []error{ErrNotSupported}, []error{ErrNoDevice}, "operation not supported"},
		{&Error{Op: "cuInit", API: Driver, Code: 999}, nil, []error{ErrNotSupported, ErrInvalidValue}, "unknown error"},
		{&Error{Op: "cudaIpcGetMemHandle", API: Runtime, Code: CodeSymbolMissing}, []error{ErrSymbolMissing, ErrNotSupported}, nil, "not found in the loaded library"},
		{&Error{Op: "nvrtcCompileProgram", API: NVRTC, Code: 6}, nil, []error{ErrNotSupported}, "NVRTC_ERROR_COMPILATION"},
		{&Error{Op: "cudaSetDevice", API: Runtime, Code: 101, msg: "from the library"}, []error{ErrInvalidValue}, nil, "cuda: cudaSetDevice: from the library"},
		{&Error{Op: "cuX", API: Driver, Code: 12345}, nil, []error{ErrNotSupported}, "unrecognised error code"},
		{&Error{Op: "cudaEventSynchronize", API: Runtime, Code: 600}, []error{ErrNotReady}, []error{ErrNotSupported, ErrInvalidValue}, "device not ready (runtime error 600)"},
		{&Error{Op: "cuEventQuery", API: Driver, Code: 600}, []error{ErrNotReady}, []error{ErrNotSupported}, "device not ready (driver error 600)"},
		{&Error{Op: "cudaEventQuery", API: Runtime, Code: 400}, []error{ErrInvalidValue}, []error{ErrNotReady}, "runtime error 400"},
	}
	for _, tc := range tests {
		t.Run(tc.err.Op, func(t *testing.T) {
			for _, s := range tc.is {
				if !errors.Is(tc.err, s) {
					t.Errorf("%v: errors.Is(%v) = false", tc.err, s)
				}
			}
			for _, s := range tc.isNot {
				if errors.Is(tc.err, s) {
					t.Errorf("%v: errors.Is(%v) = true", tc.err, s)
				}
			}
			if !strings.Contains(tc.err.Error(), tc.contains) {
				t.Errorf("%q lacks %q", tc.err.Error(), tc.contains)
			}
		})
	}
}

func TestNotSupportedWrapsReason(t *testing.T) {
	err := notSupported(ErrNoDevice, "0 devices")
	if !errors.Is(err, ErrNotSupported) || !errors.Is(err, ErrNoDevice) || errors.Is(err, ErrLibraryNotFound) {
		t.Fatalf("notSupported wraps wrongly: %v", err)
	}
}
