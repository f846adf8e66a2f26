package bootstrap

import (
	"os/exec"
	"strings"
	"testing"
)

// TestRanksDoNotLinkServer: the client side of the directory (this package)
// and the engine that prefill/decode ranks run must not pull in the server's
// HTTP framework; they live in bootstrap/server. The directory client links
// no metrics library either; the engine links the Prometheus client for its
// own metrics (issue #17: ManagerConfig.Metrics), nothing of the server.
func TestRanksDoNotLinkServer(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	for _, pkg := range []string{"github.com/kvxfer/kvxfer/bootstrap", "github.com/kvxfer/kvxfer/engine"} {
		out, err := exec.Command("go", "list", "-deps", pkg).CombinedOutput()
		if err != nil {
			t.Skipf("go list unavailable: %v: %s", err, out)
		}
		for _, dep := range strings.Fields(string(out)) {
			prom := strings.HasPrefix(dep, "github.com/prometheus/") && pkg != "github.com/kvxfer/kvxfer/engine"
			if strings.HasPrefix(dep, "github.com/labstack/echo") || prom ||
				dep == "github.com/kvxfer/kvxfer/bootstrap/server" {
				t.Errorf("%s depends on %s; ranks must not link the bootstrap server (move the import to bootstrap/server or cmd/)", pkg, dep)
			}
		}
	}
}
