package engine_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/kvargs"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// TestFailureReason: each sentinel, wrapped as the engine wraps it, maps to
// its fixed failure class (the reason label of rooms metrics and timelines).
func TestFailureReason(t *testing.T) {
	wrap := func(err error) error { return fmt.Errorf("engine: room 7: %w", err) }
	for _, c := range []struct {
		err  error
		want string
	}{
		{nil, engine.ReasonNone},
		{wrap(engine.ErrTimeout), engine.ReasonTimeout},
		{wrap(transport.ErrPeerLost), engine.ReasonPeerLost},
		{wrap(engine.ErrAborted), engine.ReasonAborted},
		{wrap(engine.ErrRoomMismatch), engine.ReasonRoomMismatch},
		{wrap(engine.ErrChecksum), engine.ReasonChecksum},
		{wrap(engine.ErrManagerClosed), engine.ReasonClosed},
		{wrap(engine.ErrTokenMismatch), engine.ReasonMismatch},
		{wrap(kvargs.ErrBadKVArgs), engine.ReasonMismatch},
		{wrap(bootstrap.ErrMismatch), engine.ReasonMismatch},
		{errors.New("something else"), engine.ReasonOther},
	} {
		if got := engine.FailureReason(c.err); got != c.want {
			t.Errorf("FailureReason(%v) = %q, want %q", c.err, got, c.want)
		}
	}
}
