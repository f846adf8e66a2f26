package cuda_test

import (
	"fmt"
	"os"
	"runtime"
	"testing"

	"github.com/kvxfer/kvxfer/cuda"
)

// TestMain fails the run when a Stream or HostMem was reclaimed by the
// garbage collector instead of being closed (cuda.Leaked counts those).
func TestMain(m *testing.M) {
	code := m.Run()
	runtime.GC()
	runtime.GC()
	if n := cuda.Leaked(); n != 0 && code == 0 {
		fmt.Fprintf(os.Stderr, "cuda: %d Stream/HostMem values were never closed\n", n)
		code = 1
	}
	os.Exit(code)
}
