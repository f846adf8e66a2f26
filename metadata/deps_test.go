package metadata

import (
	"os/exec"
	"strings"
	"testing"
)

// TestEngineDoesNotLinkEtcd: the engine reaches the metadata store only
// through transport.SegmentDirectory; the etcd client (and gRPC) stay in this
// package and the programs that import it.
func TestEngineDoesNotLinkEtcd(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	out, err := exec.Command("go", "list", "-deps", "github.com/kvxfer/kvxfer/engine").CombinedOutput()
	if err != nil {
		t.Skipf("go list unavailable: %v: %s", err, out)
	}
	for _, dep := range strings.Fields(string(out)) {
		if strings.HasPrefix(dep, "go.etcd.io/") || strings.HasPrefix(dep, "google.golang.org/grpc") || dep == "github.com/kvxfer/kvxfer/metadata" {
			t.Errorf("engine depends on %s; the metadata backend must stay behind transport.SegmentDirectory", dep)
		}
	}
}
