package transport

import (
	"errors"
	"fmt"
	"slices"
	"strings"
)

// ErrUnknownTransport: a transport name that no registered transport has
// (its package is not linked in, or the name is misspelled). Returned,
// wrapped, by ProbeTransport, OpenTransport and OpenTransports.
var ErrUnknownTransport = errors.New("unknown transport")

// OpenTransports opens the transports a spec names; it is the one meaning
// of a --transport flag or a C ABI transport string.
//
//   - "auto" or "": every registered transport whose probe passes, highest
//     priority first (rdma > shm > cma > tcp). A transport that fails to open is
//     skipped (its reason is kept for the error); it fails only when none
//     opens, with an error wrapping ErrUnavailable that gives each one's reason.
//   - "a,b,...": exactly those transports, in priority order; a name that is
//     not registered fails with ErrUnknownTransport and one that cannot open
//     fails with its own error (the ones opened already are closed).
//
// Which of the opened transports carries a given peer's bytes is decided
// per peer: a KV manager offers them all and the two sides agree on the
// highest priority both have; a caller that needs exactly one transport for
// peers it does not know yet uses FirstCrossHost. The caller closes what it
// gets.
func OpenTransports(spec string, opts Options) ([]Transport, error) {
	spec = strings.TrimSpace(spec)
	if spec == "" || spec == "auto" {
		var ts []Transport
		var reasons []string
		for _, n := range Transports() {
			if err := ProbeTransport(n); err != nil {
				reasons = append(reasons, fmt.Sprintf("%s: %v", n, err))
				continue
			}
			t, err := OpenTransport(n, opts)
			if err != nil {
				reasons = append(reasons, fmt.Sprintf("%s: %v", n, err))
				continue
			}
			ts = append(ts, t)
		}
		if len(ts) == 0 {
			return nil, fmt.Errorf("engine: transport auto: %w: no registered transport opens here (%s)", ErrUnavailable, strings.Join(reasons, "; "))
		}
		return ts, nil
	}
	names, err := ParseTransportList(spec)
	if err != nil {
		return nil, err
	}
	var ts []Transport
	for _, n := range names {
		t, err := OpenTransport(n, opts)
		if err != nil {
			for _, o := range ts {
				_ = o.Close()
			}
			return nil, err
		}
		ts = append(ts, t)
	}
	return ts, nil
}

// ParseTransportList splits a comma list of transport names ("tcp,shm"),
// checks each is registered (ErrUnknownTransport otherwise, naming the
// registered ones) and returns them highest priority first, without
// duplicates. "auto" is not a list: callers handle it first.
func ParseTransportList(spec string) ([]string, error) {
	var names []string
	for _, n := range strings.Split(spec, ",") {
		n = strings.TrimSpace(n)
		if n == "" {
			return nil, fmt.Errorf("engine: transport list %q: an empty name (want auto or a comma list of %s)", spec, strings.Join(Transports(), ", "))
		}
		if !isRegistered(n) {
			return nil, fmt.Errorf("engine: transport list %q: %w %q (want auto or a comma list of %s)", spec, ErrUnknownTransport, n, strings.Join(Transports(), ", "))
		}
		if !slices.Contains(names, n) {
			names = append(names, n)
		}
	}
	return orderByPriority(names), nil
}

// FirstCrossHost returns the highest-priority transport of ts that can reach
// a peer on another host (CapCrossHost), or nil when none can. ts is in
// priority order, as OpenTransports returns it.
func FirstCrossHost(ts []Transport) Transport {
	for _, t := range ts {
		if t.Capabilities().Has(CapCrossHost) {
			return t
		}
	}
	return nil
}

func isRegistered(name string) bool {
	driversMu.RLock()
	defer driversMu.RUnlock()
	_, ok := drivers[name]
	return ok
}
