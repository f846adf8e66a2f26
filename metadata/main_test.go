package metadata_test

import (
	"fmt"
	"os"
	"testing"
)

// TestMain stops the package's shared etcd after the tests and lets the
// test binary act as a helper process (KVX_META_HELPER) that tests kill.
func TestMain(m *testing.M) {
	if h := os.Getenv("KVX_META_HELPER"); h != "" {
		run := helpers[h]
		if run == nil {
			fmt.Fprintln(os.Stderr, "helper: unknown KVX_META_HELPER", h)
			os.Exit(2)
		}
		if err := run(); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			os.Exit(2)
		}
		os.Exit(0)
	}
	code := m.Run()
	if shared != nil {
		shared.Stop()
	}
	os.Exit(code)
}

// helpers are the helper process modes.
var helpers = map[string]func() error{}
