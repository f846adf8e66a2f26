package rdma

import (
	"fmt"
	"os"
	"testing"

	"github.com/kvxfer/kvxfer/ibverbs"
)

// TestMain fails the run when a test leaves a verbs object (context, PD, MR,
// CQ, QP) open: Transport.Close and Segment.Close must release everything.
func TestMain(m *testing.M) {
	ibverbs.TrackStacks = true
	code := m.Run()
	if live := ibverbs.LiveObjects(); len(live) > 0 && code == 0 {
		fmt.Fprintf(os.Stderr, "rdma: %d verbs objects leaked:\n", len(live))
		for _, l := range live {
			fmt.Fprintln(os.Stderr, l)
		}
		code = 1
	}
	os.Exit(code)
}
