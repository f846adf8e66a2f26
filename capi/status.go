//go:build cgo

package main

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// status mirrors enum kvx_status in include/kvxfer.h. The values are part of
// the ABI: never renumber, only append (header_test.go checks they match).
type status int32

const (
	stOK              status = 0
	stInvalidArgument status = 1
	stBadHandle       status = 2
	stBufferTooSmall  status = 3
	stUnavailable     status = 4
	stUnsupportedMem  status = 5
	stNotRegistered   status = 6
	stUnknownRegion   status = 7
	stOutOfBounds     status = 8
	stBusy            status = 9
	stTimeout         status = 10
	stClosed          status = 11
	stPeerLost        status = 12
	stCanceled        status = 13
	stTransferFailed  status = 14
	stBootstrap       status = 15
	stRoomMismatch    status = 16
	stNotSupported    status = 17
	stInternal        status = 18
	stNotFound        status = 19
	stMetadata        status = 20
	stLast                   = stMetadata
	stFirstUnassigned        = stLast + 1
)

// statusNames are the enumerator names in the header, by value; the header
// test parses kvxfer.h and compares.
var statusNames = map[status]string{
	stOK: "KVX_OK", stInvalidArgument: "KVX_ERR_INVALID_ARGUMENT", stBadHandle: "KVX_ERR_BAD_HANDLE",
	stBufferTooSmall: "KVX_ERR_BUFFER_TOO_SMALL", stUnavailable: "KVX_ERR_UNAVAILABLE",
	stUnsupportedMem: "KVX_ERR_UNSUPPORTED_MEMORY", stNotRegistered: "KVX_ERR_NOT_REGISTERED",
	stUnknownRegion: "KVX_ERR_UNKNOWN_REGION", stOutOfBounds: "KVX_ERR_OUT_OF_BOUNDS", stBusy: "KVX_ERR_BUSY",
	stTimeout: "KVX_ERR_TIMEOUT", stClosed: "KVX_ERR_CLOSED", stPeerLost: "KVX_ERR_PEER_LOST",
	stCanceled: "KVX_ERR_CANCELED", stTransferFailed: "KVX_ERR_TRANSFER_FAILED", stBootstrap: "KVX_ERR_BOOTSTRAP",
	stRoomMismatch: "KVX_ERR_ROOM_MISMATCH", stNotSupported: "KVX_ERR_NOT_SUPPORTED", stInternal: "KVX_ERR_INTERNAL",
	stNotFound: "KVX_ERR_NOT_FOUND", stMetadata: "KVX_ERR_METADATA",
}

// apiError is an error with the status code the C caller gets.
type apiError struct {
	code status
	msg  string
	err  error
}

func (e *apiError) Error() string {
	if e.err != nil {
		return e.msg + ": " + e.err.Error()
	}
	return e.msg
}

func (e *apiError) Unwrap() error { return e.err }

// fail builds an apiError; format names what was wrong and what to do.
func fail(code status, format string, args ...any) error {
	return &apiError{code: code, msg: fmt.Sprintf(format, args...)}
}

// failWrap builds an apiError around a cause; code 0 means "derive the code
// from the cause".
func failWrap(code status, err error, format string, args ...any) error {
	if code == stOK {
		code = codeOf(err)
	}
	return &apiError{code: code, msg: fmt.Sprintf(format, args...), err: err}
}

// codeOf maps an error to its status: an apiError's own code, else the
// engine's shared sentinels.
func codeOf(err error) status {
	var ae *apiError
	switch {
	case err == nil:
		return stOK
	case errors.As(err, &ae) && ae.code != stOK:
		return ae.code
	}
	if c, ok := kvCode(err); ok {
		return c
	}
	if c, ok := agentCode(err); ok {
		return c
	}
	switch {
	case errors.Is(err, transport.ErrSegmentNotFound):
		return stNotFound
	case errors.Is(err, transport.ErrMetadataUnavailable):
		return stMetadata
	case errors.Is(err, transport.ErrReadUnsupported):
		return stNotSupported
	case errors.Is(err, segengine.ErrSegmentUnreachable) && (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded)):
		return stTimeout
	case errors.Is(err, segengine.ErrSegmentUnreachable):
		return stPeerLost
	case errors.Is(err, segengine.ErrBadEntry):
		return stInvalidArgument
	case errors.Is(err, segengine.ErrLocalNotRegistered):
		return stNotRegistered
	case errors.Is(err, transport.ErrOutOfBounds):
		return stOutOfBounds
	case errors.Is(err, transport.ErrUnknownRegion):
		return stUnknownRegion
	case errors.Is(err, transport.ErrClosed):
		return stClosed
	case errors.Is(err, transport.ErrPeerLost):
		return stPeerLost
	case errors.Is(err, transport.ErrCanceled), errors.Is(err, context.Canceled):
		return stCanceled
	case errors.Is(err, transport.ErrUnknownBatch):
		return stBadHandle
	case errors.Is(err, transport.ErrUnsupportedMemory):
		return stUnsupportedMem
	case errors.Is(err, transport.ErrUnavailable):
		return stUnavailable
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded):
		return stTimeout
	}
	return stTransferFailed
}
