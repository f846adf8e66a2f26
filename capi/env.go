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

import "unsafe"

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
