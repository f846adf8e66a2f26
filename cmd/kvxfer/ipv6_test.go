package main

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/internal/hostaddr"
)

// TestCLIIPv6: bootstrap, prefill and decode processes on ::1 (bracketed
// --bootstrap) transfer a room; with --host :: the ranks advertise the
// address of the default-route interface (not loopback) and still transfer;
// an unbracketed "::1:PORT" --bootstrap is refused at once with the form to
// use (issue 13 items 3–4, issue 18 item 9).
func TestCLIIPv6(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	if ln, err := net.Listen("tcp", "[::1]:0"); err != nil {
		t.Skipf("no IPv6 loopback: %v", err)
	} else {
		ln.Close()
	}
	_, addr := startBootstrapProc(t, "::1", 0)
	if !strings.HasPrefix(addr, "[::1]:") {
		t.Fatalf("bootstrap address %q", addr)
	}
	for _, host := range []string{"::1", "::"} {
		want := host
		if host == "::" {
			c := hostaddr.Pick("::")
			if c.Loopback {
				t.Logf("--host ::: no non-loopback address here; skipped")
				continue
			}
			want = c.Host
		}
		t.Run("host "+host, func(t *testing.T) {
			pre := startProc(t, "prefill", nil, roleArgs("prefill", addr, host)...)
			rp := pre.ready()
			dec := startProc(t, "decode", nil, roleArgs("decode", addr, host)...)
			rd := dec.ready()
			for _, ep := range []string{rp.Endpoint, rd.Endpoint} {
				if !strings.HasPrefix(ep, "tcp://["+want+"]:") {
					t.Fatalf("endpoint %s, want tcp://[%s]:…", ep, want)
				}
			}
			pollTable(t, addr, 10*time.Second, "the prefill registered its IPv6 address", func(tab *bootstrap.TableSnapshot) bool {
				return len(tab.Ranks) == 1 && tab.Ranks[0].RankIP == want && tab.Ranks[0].InstanceID == rp.Instance
			})
			transferRoom(t, 11, pre, dec)
			for _, p := range []*proc{pre, dec} {
				if err := p.exit(30 * time.Second); err != nil {
					t.Fatalf("%s exit: %v\n%s", p.name, err, p.stderr.String())
				}
			}
		})
	}
	port := addr[strings.LastIndexByte(addr, ':')+1:]
	bad := startProc(t, "prefill with an unbracketed address", nil, roleArgs("prefill", "::1:"+port, "::1")...)
	start := time.Now()
	if err := bad.wait(30 * time.Second); exitCode(err) != 1 {
		t.Fatalf("prefill --bootstrap ::1:%s: exit %v, want 1", port, err)
	}
	if msg := bad.stderr.String(); !strings.Contains(msg, "[::1]:"+port) || !strings.Contains(msg, "bracket") {
		t.Fatalf("prefill --bootstrap ::1:%s: stderr lacks the bracketed form:\n%s", port, msg)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("the unbracketed address was refused after %s, want at once", d)
	}
}
