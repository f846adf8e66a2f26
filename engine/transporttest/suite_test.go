package transporttest_test

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/engine/faulty"
	"github.com/kvxfer/kvxfer/engine/tcp"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/engine/transporttest"
)

const brokenEnv = "KVXFER_TRANSPORTTEST_BROKEN"

func newTCP(t *testing.T) transport.Transport {
	t.Helper()
	tr, err := tcp.New(transport.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// TestBrokenChild runs the suite against a deliberately broken transport;
// it only runs as the child of TestSuiteCatchesBrokenTransports.
func TestBrokenChild(t *testing.T) {
	var opts []faulty.Option
	switch os.Getenv(brokenEnv) {
	case "":
		t.Skip("runs only as a child of TestSuiteCatchesBrokenTransports")
	case "corrupt": // one landed byte wrong in every batch
		var ks []int
		for i := 1; i <= 10000; i++ {
			ks = append(ks, i)
		}
		opts = append(opts, faulty.CorruptData(ks...))
	case "lying": // reports failures as successes (and successes as failures)
		var ks []int
		for i := 1; i <= 10000; i++ {
			ks = append(ks, i)
		}
		opts = append(opts, faulty.FlipStatus(ks...))
	case "nofence", "nofence-optout": // the receiver hides Fencer
		var suiteOpts []transporttest.Option
		if os.Getenv(brokenEnv) == "nofence-optout" {
			suiteOpts = append(suiteOpts, transporttest.WithoutFencing("test transport: fencing hidden on purpose"))
		}
		transporttest.Run(t, func(t *testing.T) (transport.Transport, transport.Transport) {
			return newTCP(t), noFence{newTCP(t)}
		}, append(suiteOpts, transporttest.WithLargeBytes(0))...)
		return
	}
	transporttest.Run(t, func(t *testing.T) (transport.Transport, transport.Transport) {
		return faulty.Wrap(newTCP(t), opts...), newTCP(t)
	}, transporttest.WithLargeBytes(0))
}

// The suite must fail a transport that corrupts data or lies about status:
// a conformance suite that cannot fail proves nothing.
func TestSuiteCatchesBrokenTransports(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns the suite twice in child processes")
	}
	for _, c := range []struct{ mode, want, run string }{
		{"corrupt", "receiver byte", ""},
		{"lying", "want completed", ""},
		{"nofence", "does not implement transport.Fencer", "/^FencedEpoch$"},
	} {
		t.Run(c.mode, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestBrokenChild$"+c.run, "-test.short")
			cmd.Env = append(os.Environ(), brokenEnv+"="+c.mode)
			out, err := cmd.CombinedOutput()
			if err == nil {
				t.Fatalf("the suite passed a %s transport:\n%s", c.mode, out)
			}
			if !strings.Contains(string(out), c.want) {
				t.Fatalf("suite failed the %s transport, but not with %q:\n%s", c.mode, c.want, out)
			}
		})
	}
}

// noFence is a transport whose Fencer methods are hidden: only the
// transport.Transport methods of the wrapped one are promoted.
type noFence struct{ transport.Transport }

// A transport that does not fence passes the fencing case only when it opts
// out, with its reason shown as the skip (TestSuiteCatchesBrokenTransports
// checks that it fails otherwise).
func TestSuiteFencingOptOut(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns the suite in a child process")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestBrokenChild$/^FencedEpoch$", "-test.short", "-test.v")
	cmd.Env = append(os.Environ(), brokenEnv+"=nofence-optout")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the suite failed a transport that opted out of fencing:\n%s", out)
	}
	if !strings.Contains(string(out), "SKIP: TestBrokenChild/FencedEpoch") || !strings.Contains(string(out), "fencing hidden on purpose") {
		t.Fatalf("the fencing case was not skipped with the opt-out reason:\n%s", out)
	}
}
