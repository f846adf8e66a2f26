// Command capi is kvxfer's C ABI: built with `go build -buildmode=c-shared -o
// libkvxfer.so ./capi`, it exports the kvx_* functions declared in
// include/kvxfer.h (hand-written; that header is the contract, and
// header_test.go checks the two agree in both directions).
//
// Layout: exports.go holds every //export function and nothing else; its
// preamble only includes the header's types. trampoline.go and
// trampoline.c hold the C trampoline that calls a C notification callback
// from Go. abi.go checks at compile time that the header's record layout and
// KVPoll values match the engine's. lasterror.c holds
// the thread-local last-error buffer and the functions implemented in C
// (kvx_version, kvx_strerror, kvx_last_error). The rest is plain Go.
//
// Handles given to C are 64-bit IDs from typed tables (handles.go), never Go
// pointers and never reused, so a stale or doubly destroyed handle is
// reported as KVX_ERR_BAD_HANDLE instead of crashing (runtime/cgo.Handle
// panics on a deleted handle, which is why it is not used for these).
// Every export recovers panics and turns them into KVX_ERR_INTERNAL.
package main

// main is required by -buildmode=c-shared and never runs.
func main() {}
