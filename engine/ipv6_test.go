package engine_test

import (
	"context"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/bootstrap/server"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/internal/hostaddr"
)

// bootstrapOn starts a directory listening on host (IPv6 allowed).
func bootstrapOn(t *testing.T, host string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	srv := server.New(server.Options{Host: host, Logger: slog.New(slog.DiscardHandler)})
	done := make(chan error, 1)
	go func() { done <- srv.Start(ctx) }()
	select {
	case <-srv.Ready():
	case err := <-done:
		cancel()
		t.Skipf("no directory on %s: %v", host, err)
	case <-time.After(10 * time.Second):
		cancel()
		t.Fatal("bootstrap server did not start")
	}
	t.Cleanup(func() { cancel(); <-done })
	return srv.Addr()
}

// globalIPv6 returns a global-scope IPv6 address of an up interface, or "".
func globalIPv6() string {
	ifs, _ := net.Interfaces()
	for _, ifc := range ifs {
		if ifc.Flags&net.FlagUp == 0 || ifc.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, _ := ifc.Addrs()
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok {
				if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Is6() && !ip.Is4In6() && ip.IsGlobalUnicast() {
					return ip.String()
				}
			}
		}
	}
	return ""
}

// TestIPv6EndToEnd: directory, control sockets and tcp data listeners on an
// IPv6 address (::1, and a global address when the host has one): the
// prefill registers the unbracketed address, endpoints are bracketed, and a
// room is transferred and verified byte for byte.
func TestIPv6EndToEnd(t *testing.T) {
	hosts := []string{"::1"}
	if g := globalIPv6(); g != "" {
		hosts = append(hosts, g)
	}
	for _, h := range hosts {
		t.Run(h, func(t *testing.T) {
			addr := bootstrapOn(t, h)
			if !strings.HasPrefix(addr, "[") {
				t.Fatalf("directory address %q: want a bracketed IPv6 host:port", addr)
			}
			pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, host: h})
			dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, host: h, peerTmo: 5 * time.Second})
			for _, r := range []*rank{pre, dec} {
				if want := "tcp://[" + h + "]:"; !strings.HasPrefix(r.m.Endpoint(), want) {
					t.Fatalf("control endpoint %q, want %s…", r.m.Endpoint(), want)
				}
			}
			c, err := bootstrap.NewClient(addr)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			ri, err := c.RankInfo(ctx, 0, 0, 0, 0)
			if err != nil || ri.RankIP != h {
				t.Fatalf("registered rank %+v %v, want rank_ip %s", ri, err, h)
			}
			for room := uint64(1); room <= 2; room++ {
				for _, r := range transferOne(t, addr, []*rank{pre}, []*rank{dec}, room, 3) {
					if r.Poll() != engine.KVSuccess {
						t.Fatalf("room %d over %s: %s %v", room, h, r.Poll(), r.Failure())
					}
				}
			}
		})
	}
}

// TestWildcardAdvertisesReachableAddress: ranks bound to 0.0.0.0 register
// and advertise the address hostaddr picks (the default-route interface's),
// never 127.0.0.1 while the host has another address, and the tcp data
// listener does the same; a room still transfers (the address is local).
func TestWildcardAdvertisesReachableAddress(t *testing.T) {
	choice := hostaddr.Pick("0.0.0.0")
	if choice.Loopback {
		t.Skip("this host has no non-loopback IPv4 address")
	}
	addr := startBootstrap(t)
	pre := newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 1, pp: 1, addr: addr, host: "0.0.0.0"})
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, host: "0.0.0.0"})
	c, _ := bootstrap.NewClient(addr)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ri, err := c.RankInfo(ctx, 0, 0, 0, 0)
	if err != nil || ri.RankIP != choice.Host {
		t.Fatalf("registered %+v %v, want rank_ip %s (%s)", ri, err, choice.Host, choice.How)
	}
	if !strings.Contains(dec.m.Endpoint(), choice.Host) {
		t.Fatalf("decode endpoint %s, want host %s", dec.m.Endpoint(), choice.Host)
	}
	for _, r := range transferOne(t, addr, []*rank{pre}, []*rank{dec}, 3, 2) {
		if r.Poll() != engine.KVSuccess {
			t.Fatalf("room over the advertised address: %s %v", r.Poll(), r.Failure())
		}
	}
	// An explicit advertise host wins.
	p2 := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, host: "0.0.0.0", advertise: "127.0.0.1"})
	if !strings.HasPrefix(p2.m.Endpoint(), "tcp://127.0.0.1:") {
		t.Fatalf("endpoint with advertise host 127.0.0.1: %s", p2.m.Endpoint())
	}
}
