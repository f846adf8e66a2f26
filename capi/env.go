//go:build cgo

package main

// Environment reads for the C ABI. Go's os.Getenv reads a copy of the
// environment taken when the Go runtime started, i.e. when libkvxfer.so was
// loaded; a host that sets a variable afterwards (Python's os.environ[...] =
// ..., a C++ setenv before creating an engine) changes the process's real
// environment, which only libc's getenv sees. So every variable the C ABI
// honours is read here, at the call that uses it.

/*
#include <stdlib.h>
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// getenv returns the process environment's current value of name ("" when
// unset), read with libc's getenv at call time.
func getenv(name string) string {
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	v := C.getenv(cs)
	if v == nil {
		return ""
	}
	return C.GoString(v)
}

// setenvC sets name=value in the process environment with libc's setenv,
// behind the Go runtime's back (as a host process does); for tests.
func setenvC(name, value string) {
	cn, cv := C.CString(name), C.CString(value)
	defer C.free(unsafe.Pointer(cn))
	defer C.free(unsafe.Pointer(cv))
	C.setenv(cn, cv, 1)
}

// unsetenvC removes name from the process environment with libc's unsetenv;
// for tests.
func unsetenvC(name string) {
	cn := C.CString(name)
	defer C.free(unsafe.Pointer(cn))
	C.unsetenv(cn)
}

// shmStreamMinEnv sets transport.SHMOptions.StreamMinBytes of every shm
// transport the C ABI opens: a byte count, or "off" (also 0) for no
// non-temporal stores; unset, the default (1 MiB).
const shmStreamMinEnv = "KVXFER_SHM_STREAM_MIN"

// transportOptions is transport.DefaultOptions with what the environment
// sets for the transports (shmStreamMinEnv, read with getenv); the error
// names the variable, its value and what it takes.
func transportOptions(getenv func(string) string) (transport.Options, error) {
	opts := transport.DefaultOptions()
	n, err := transport.ParseSHMStreamMin(getenv(shmStreamMinEnv))
	if err != nil {
		return opts, fmt.Errorf("env %s=%w; unset it for the default (1 MiB)", shmStreamMinEnv, err)
	}
	opts.SHM.StreamMinBytes = n
	return opts, nil
}
