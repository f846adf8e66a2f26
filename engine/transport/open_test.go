package transport_test

import (
	"errors"
	"slices"
	"testing"

	_ "github.com/kvxfer/kvxfer/engine/shm"
	_ "github.com/kvxfer/kvxfer/engine/tcp"
	"github.com/kvxfer/kvxfer/engine/transport"
)

func names(ts []transport.Transport) []string {
	var out []string
	for _, t := range ts {
		out = append(out, t.Name())
	}
	return out
}

func TestOpenTransports(t *testing.T) {
	shmOK := transport.ProbeTransport("shm") == nil
	var usable []string // what auto must open: every registered transport whose probe passes, priority order
	for _, n := range transport.Transports() {
		if transport.ProbeTransport(n) == nil {
			usable = append(usable, n)
		}
	}
	type tcase struct {
		spec    string
		want    []string // nil: don't compare (auto)
		wantErr error
	}
	tests := []tcase{
		{spec: "tcp", want: []string{"tcp"}},
		{spec: " tcp ", want: []string{"tcp"}},
		{spec: "tcp,tcp", want: []string{"tcp"}},
		{spec: "tcp,foo", wantErr: transport.ErrUnknownTransport},
		{spec: "carrier-pigeon", wantErr: transport.ErrUnknownTransport},
		{spec: "tcp,,shm", wantErr: nil /* any error */},
		{spec: "auto"},
		{spec: ""},
	}
	if shmOK {
		tests = append(tests, tcase{spec: "tcp,shm", want: []string{"shm", "tcp"}})
	}
	if shmOK && transport.ProbeTransport("cma") == nil {
		tests = append(tests, tcase{spec: "tcp,cma,shm", want: []string{"shm", "cma", "tcp"}})
	}
	for _, tc := range tests {
		t.Run(tc.spec, func(t *testing.T) {
			opts := transport.DefaultOptions()
			ts, err := transport.OpenTransports(tc.spec, opts)
			defer func() {
				for _, tr := range ts {
					_ = tr.Close()
				}
			}()
			if tc.spec == "tcp,,shm" {
				if err == nil {
					t.Fatalf("an empty name in the list was accepted: %v", names(ts))
				}
				return
			}
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("err = %v, want %v", err, tc.wantErr)
				}
				if ts != nil {
					t.Fatalf("failed open returned transports %v", names(ts))
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := names(ts)
			if tc.want != nil && !slices.Equal(got, tc.want) {
				t.Fatalf("opened %v, want %v", got, tc.want)
			}
			if tc.want == nil { // auto: every usable registered transport, priority order
				noRDMA := slices.DeleteFunc(slices.Clone(usable), func(n string) bool { return n == "rdma" }) // a probe can pass where no device opens
				if !slices.Contains(got, "tcp") || (!slices.Equal(got, usable) && !slices.Equal(got, noRDMA)) {
					t.Fatalf("auto opened %v, want every usable transport in priority order %v", got, usable)
				}
				if c := transport.FirstCrossHost(ts); c == nil || !c.Capabilities().Has(transport.CapCrossHost) {
					t.Fatalf("FirstCrossHost(%v) = %v", got, c)
				}
			}
		})
	}
}

func TestUnknownTransportSentinel(t *testing.T) {
	if err := transport.ProbeTransport("nope"); !errors.Is(err, transport.ErrUnknownTransport) {
		t.Fatalf("ProbeTransport: %v", err)
	}
	if _, err := transport.OpenTransport("nope", transport.DefaultOptions()); !errors.Is(err, transport.ErrUnknownTransport) {
		t.Fatalf("OpenTransport: %v", err)
	}
}
