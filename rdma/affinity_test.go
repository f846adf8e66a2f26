package rdma

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/internal/fakesys"
)

// pciTree writes PCI devices at their full hierarchy paths under
// root/devices and links root/bus/pci/devices/<addr> to them, as Linux does.
type pciTree struct {
	t    *testing.T
	root string
}

func (p pciTree) add(path string, numa int) {
	p.t.Helper()
	dir := filepath.Join(p.root, "devices", path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		p.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "numa_node"), []byte(itoa(numa)+"\n"), 0o644); err != nil {
		p.t.Fatal(err)
	}
	bus := filepath.Join(p.root, "bus/pci/devices")
	os.MkdirAll(bus, 0o755)
	rel, _ := filepath.Rel(bus, dir)
	if err := os.Symlink(rel, filepath.Join(bus, filepath.Base(path))); err != nil {
		p.t.Fatal(err)
	}
}

func (p pciTree) nic(name, addr string) {
	p.t.Helper()
	dir := filepath.Join(p.root, "class/infiniband", name)
	os.MkdirAll(dir, 0o755)
	if err := os.Symlink(filepath.Join("../../../bus/pci/devices", addr), filepath.Join(dir, "device")); err != nil {
		p.t.Fatal(err)
	}
}

func itoa(n int) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// A two-socket host: socket 0 has a PCIe switch with GPU0 and mlx5_0 below
// it, and GPU1 on another root port; socket 1 has GPU2 and mlx5_1 behind a
// second switch. rxe0 is a software NIC with no PCI device.
func TestComputeAffinity(t *testing.T) {
	root := t.TempDir()
	p := pciTree{t, root}
	p.add("pci0000:10/0000:10:01.0/0000:11:00.0/0000:12:00.0/0000:13:00.0", 0) // GPU0
	p.add("pci0000:10/0000:10:01.0/0000:11:00.0/0000:12:04.0/0000:14:00.0", 0) // mlx5_0
	p.add("pci0000:20/0000:20:01.0/0000:21:00.0", 0)                           // GPU1
	p.add("pci0000:90/0000:90:01.0/0000:91:00.0/0000:92:08.0/0000:9a:00.0", 1) // GPU2
	p.add("pci0000:90/0000:90:01.0/0000:91:00.0/0000:92:10.0/0000:9c:00.0", 1) // mlx5_1
	p.nic("mlx5_0", "0000:14:00.0")
	p.nic("mlx5_1", "0000:9c:00.0")

	nics := []NIC{
		{Name: "mlx5_0", PCIAddr: "0000:14:00.0", NUMANode: 0},
		{Name: "mlx5_1", PCIAddr: "0000:9c:00.0", NUMANode: 1},
		{Name: "rxe0", NUMANode: -1},
	}
	gpus := []GPU{
		{Index: 0, PCIAddr: "00000000:13:00.0", NUMANode: 0}, // NVML form
		{Index: 1, PCIAddr: "0000:21:00.0", NUMANode: 0},
		{Index: 2, PCIAddr: "00000000:9A:00.0", NUMANode: 1}, // upper-case hex
		{Index: 3, PCIAddr: "0000:c1:00.0", NUMANode: -1},    // not in sysfs, NUMA unknown
	}
	a, err := ComputeAffinity(gpus, nics, AffinitySysfsRoot(root))
	if err != nil {
		t.Fatal(err)
	}
	want := [][]Link{
		{LinkSwitch, LinkOther, LinkOther},
		{LinkNUMA, LinkOther, LinkOther},
		{LinkOther, LinkSwitch, LinkOther},
		{LinkOther, LinkOther, LinkOther},
	}
	if !reflect.DeepEqual(a.Links, want) {
		t.Fatalf("links = %v, want %v", a.Links, want)
	}
	if a.GPUs[0].PCIAddr != "0000:13:00.0" || a.GPUs[2].PCIAddr != "0000:9a:00.0" {
		t.Errorf("GPU addresses not normalised: %+v", a.GPUs)
	}
	for g, best := range [][]string{{"mlx5_0"}, {"mlx5_0"}, {"mlx5_1"}, {"mlx5_0", "mlx5_1", "rxe0"}} {
		if got := a.Best(g); !reflect.DeepEqual(got, best) {
			t.Errorf("Best(%d) = %v, want %v", g, got, best)
		}
	}
	if a.Best(9) != nil {
		t.Error("Best(out of range) != nil")
	}
	js, err := json.Marshal(a)
	if err != nil || !strings.Contains(string(js), `"pcie-switch"`) {
		t.Errorf("JSON = %s, %v", js, err)
	}
}

// With fakesys (flat PCI tree, as the RDMA discovery tests build it) and
// rdma.Discover, only NUMA decides.
func TestComputeAffinityDiscovered(t *testing.T) {
	fs := fakesys.New(t)
	fs.AddDevice(fakesys.Device{Name: "mlx5_0", PCIAddr: "0000:17:00.0", NUMANode: 0, Ports: []fakesys.Port{{Num: 1}}})
	fs.AddDevice(fakesys.Device{Name: "mlx5_1", PCIAddr: "0000:b8:00.0", NUMANode: 1, Ports: []fakesys.Port{{Num: 1}}})
	nics, err := Discover(WithSysfsRoot(fs.Root))
	if err != nil {
		t.Fatal(err)
	}
	a, err := ComputeAffinity([]GPU{{Index: 0, PCIAddr: "00000000:B9:00.0", NUMANode: 1}}, nics, AffinitySysfsRoot(fs.Root))
	if err != nil {
		t.Fatal(err)
	}
	if got := a.Best(0); !reflect.DeepEqual(got, []string{"mlx5_1"}) {
		t.Fatalf("Best(0) = %v (links %v), want [mlx5_1]", got, a.Links)
	}
}

func TestComputeAffinityErrors(t *testing.T) {
	if _, err := ComputeAffinity([]GPU{{Index: 4, PCIAddr: "GPU-1234"}}, nil, AffinitySysfsRoot(t.TempDir())); err == nil || !strings.Contains(err.Error(), "GPU 4") {
		t.Fatalf("bad GPU address: err = %v, want one naming GPU 4", err)
	}
	a, err := ComputeAffinity(nil, nil, AffinitySysfsRoot(t.TempDir()))
	if err != nil || len(a.Links) != 0 || a.Best(0) != nil {
		t.Fatalf("empty inputs: %+v, %v", a, err)
	}
}

func TestLinkString(t *testing.T) {
	for l, s := range map[Link]string{LinkSwitch: "pcie-switch", LinkNUMA: "numa", LinkOther: "other", 9: "link(9)"} {
		if l.String() != s {
			t.Errorf("%d.String() = %q, want %q", l, l.String(), s)
		}
	}
}
