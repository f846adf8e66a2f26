package main

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// transferRoom sends one room to every rank and fails the test unless each
// reports ok.
func transferRoom(t *testing.T, room uint64, ranks ...*proc) {
	t.Helper()
	q := requestLine{Room: room, Tokens: 100}
	for _, p := range ranks {
		p.send(q)
	}
	for _, p := range ranks {
		if r := p.result(time.Minute); !r.OK {
			t.Fatalf("%s: room %d failed: %s\n%s", p.name, room, r.Error, p.stderr.String())
		}
	}
}

// TestDirectoryRestartReregisters: kill -9 the bootstrap directory and start
// it again on the same port: the prefill rank (default check interval)
// registers again within seconds and new rooms succeed, with no restart of
// the prefill or decode (issue 18 item 2).
func TestDirectoryRestartReregisters(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	port := freePort(t, "127.0.0.1")
	bs, addr := startBootstrapProc(t, "127.0.0.1", port)
	pre := startProc(t, "prefill", nil, roleArgs("prefill", addr, "127.0.0.1")...)
	ready := pre.ready()
	dec := startProc(t, "decode", nil, roleArgs("decode", addr, "127.0.0.1")...)
	dec.ready()
	transferRoom(t, 1, pre, dec)

	bs.kill9()
	startBootstrapProc(t, "127.0.0.1", port)
	took := pollTable(t, addr, 30*time.Second, "the prefill registered again", func(tab *bootstrap.TableSnapshot) bool {
		return tab.Ready && len(tab.Ranks) == 1 && tab.Ranks[0].InstanceID == ready.Instance
	})
	t.Logf("prefill registered again %s after the directory restarted (check interval %s)", took.Round(time.Millisecond), "2s")
	if took > 10*time.Second {
		t.Errorf("re-registration took %s, want within seconds", took)
	}
	for room := uint64(2); room <= 4; room++ {
		transferRoom(t, room, pre, dec)
	}
	for _, p := range []*proc{pre, dec} {
		if err := p.exit(30 * time.Second); err != nil {
			t.Fatalf("%s exit: %v\n%s", p.name, err, p.stderr.String())
		}
	}
}

// TestRollingRestartKeepsNewPrefill: P2 registers the coordinates of P1
// (its replacement), then P1 exits cleanly: P2's entry survives (P1's
// deregistration is conditional on its instance id) and the next room is
// served by P2 (issue 18 item 3).
func TestRollingRestartKeepsNewPrefill(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	_, addr := startBootstrapProc(t, "127.0.0.1", 0)
	fast := "--directory-check-interval=200ms"
	p1 := startProc(t, "prefill P1", nil, roleArgs("prefill", addr, "127.0.0.1", fast)...)
	r1 := p1.ready()
	p2 := startProc(t, "prefill P2", nil, roleArgs("prefill", addr, "127.0.0.1", fast)...)
	r2 := p2.ready()
	isP2 := func(tab *bootstrap.TableSnapshot) bool {
		return len(tab.Ranks) == 1 && tab.Ranks[0].InstanceID == r2.Instance && tab.Ranks[0].PrefillRankInfo.Endpoint() == r2.Endpoint
	}
	pollTable(t, addr, 10*time.Second, "P2 holds the entry", isP2)
	time.Sleep(time.Second) // P1 checks ~5 times meanwhile: it must not take the entry back
	pollTable(t, addr, time.Second, "P2 still holds the entry while P1 runs", isP2)
	if err := p1.exit(30 * time.Second); err != nil {
		t.Fatalf("P1 exit: %v\n%s", err, p1.stderr.String())
	}
	pollTable(t, addr, time.Second, "P2's entry after P1 ("+r1.Instance+") exited", isP2)
	dec := startProc(t, "decode", nil, roleArgs("decode", addr, "127.0.0.1")...)
	dec.ready()
	transferRoom(t, 9, p2, dec)
	for _, p := range []*proc{p2, dec} {
		if err := p.exit(30 * time.Second); err != nil {
			t.Fatalf("%s exit: %v\n%s", p.name, err, p.stderr.String())
		}
	}
}
