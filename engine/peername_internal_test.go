package engine

import (
	"errors"
	"fmt"
	"testing"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// TestOnePrefix: an error wrapped at several layers keeps one "engine: "
// (at its start when it had one there), and its chain.
func TestOnePrefix(t *testing.T) {
	inner := fmt.Errorf("engine: prefill 10.0.0.7:5000 refused this decode's registration: engine: kv args: %w", transport.ErrPeerLost)
	cases := []struct {
		in   error
		want string
	}{
		{nil, ""},
		{errors.New("peer lost: prefill tp1/pp0 at h:1 disconnected"), "peer lost: prefill tp1/pp0 at h:1 disconnected"},
		{errors.New("engine: room 5: timeout"), "engine: room 5: timeout"},
		{fmt.Errorf("engine: room 5: register with prefill h:1: %w", inner),
			"engine: room 5: register with prefill h:1: prefill 10.0.0.7:5000 refused this decode's registration: kv args: peer lost"},
		{fmt.Errorf("%w: engine: room 5", ErrTimeout), "engine: timeout: room 5"},
	}
	for _, c := range cases {
		got := onePrefix(c.in)
		if c.in == nil {
			if got != nil {
				t.Errorf("onePrefix(nil) = %v", got)
			}
			continue
		}
		if got.Error() != c.want {
			t.Errorf("onePrefix(%q)\n = %q\nwant %q", c.in, got, c.want)
		}
		if errors.Is(c.in, transport.ErrPeerLost) != errors.Is(got, transport.ErrPeerLost) || errors.Is(c.in, ErrTimeout) != errors.Is(got, ErrTimeout) {
			t.Errorf("onePrefix(%q) lost the error chain", c.in)
		}
	}
}
