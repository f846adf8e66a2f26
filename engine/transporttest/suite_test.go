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
	for _, c := range []struct{ mode, want string }{
		{"corrupt", "receiver byte"},
		{"lying", "want completed"},
	} {
		t.Run(c.mode, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestBrokenChild$", "-test.short")
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
