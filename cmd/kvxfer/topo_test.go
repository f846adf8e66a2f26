package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/internal/fakesys"
)

// TestTopoCommand runs `kvxfer topo` over a fake sysfs with two NICs. On a
// host without an NVIDIA driver it must say "no GPU" and still list the NICs.
func TestTopoCommand(t *testing.T) {
	fs := fakesys.New(t)
	fs.AddDevice(fakesys.Device{Name: "mlx5_0", PCIAddr: "0000:17:00.0", NUMANode: 0, NetDevs: []string{"eth2"}, Ports: []fakesys.Port{{Num: 1}}})
	fs.AddDevice(fakesys.Device{Name: "rxe0", Ports: []fakesys.Port{{Num: 1}}})

	var out bytes.Buffer
	rootCmd.SetOut(&out)
	rootCmd.SetArgs([]string{"topo", "--sysfs", fs.Root})
	if err := rootCmd.Execute(); err != nil {
		t.Fatalf("topo: %v\n%s", err, out.String())
	}
	text := out.String()
	for _, want := range []string{"mlx5_0", "0000:17:00.0", "rxe0", "(software)"} {
		if !strings.Contains(text, want) {
			t.Errorf("topo output lacks %q:\n%s", want, text)
		}
	}
	noGPU := strings.HasPrefix(text, "no GPU (")
	if !noGPU && !strings.Contains(text, "NEAREST NIC") {
		t.Errorf("topo output has neither a GPU table nor \"no GPU\":\n%s", text)
	}

	out.Reset()
	rootCmd.SetArgs([]string{"topo", "--sysfs", fs.Root, "--json"})
	if err := rootCmd.Execute(); err != nil {
		t.Fatalf("topo --json: %v", err)
	}
	var rep topoReport
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatalf("topo --json is not JSON: %v\n%s", err, out.String())
	}
	if len(rep.NICs) != 2 || (noGPU && rep.GPUError == "") {
		t.Fatalf("topo --json = %+v", rep)
	}

	out.Reset()
	rootCmd.SetArgs([]string{"topo", "--sysfs", t.TempDir(), "--json=false"}) // flags persist between Execute calls
	if err := rootCmd.Execute(); err != nil {
		t.Fatalf("topo on an empty sysfs: %v", err)
	}
	if !strings.Contains(out.String(), "no RDMA NIC") {
		t.Errorf("empty sysfs: output lacks \"no RDMA NIC\":\n%s", out.String())
	}
}
