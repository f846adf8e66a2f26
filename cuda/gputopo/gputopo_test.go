package gputopo_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/kvxfer/kvxfer/cuda/gputopo"
)

func busID(s string) [32]int8 {
	var b [32]int8
	for i := 0; i < len(s); i++ {
		b[i] = int8(s[i])
	}
	return b
}

// dgx returns go-nvml's DGX H200 mock with NVML-style bus ids
// ("00000000:1A:00.0") and NUMA answers: GPUs 0-3 on node 0, 4-7 on node 1;
// GPU 5 has no NVML NUMA answer (sysfs fallback) and GPU 7 none at all.
func dgx(t *testing.T, root string) *server.Server {
	s := dgxh200.New()
	buses := []int{0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb}
	for i, d := range s.Devices {
		dev := d.(*server.Device)
		id := fmt.Sprintf("00000000:%02X:00.0", buses[i])
		dev.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
			return nvml.PciInfo{BusId: busID(id), Bus: uint32(buses[i]), PciDeviceId: 0x233510de}, nvml.SUCCESS
		}
		node := i / 4
		switch i {
		case 5:
			p := filepath.Join(root, "bus/pci/devices", fmt.Sprintf("0000:%02x:00.0", buses[i]))
			os.MkdirAll(p, 0o755)
			os.WriteFile(filepath.Join(p, "numa_node"), []byte("1\n"), 0o644)
			dev.GetNumaNodeIdFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
		case 7:
			dev.GetNumaNodeIdFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
		default:
			dev.GetNumaNodeIdFunc = func() (int, nvml.Return) { return node, nvml.SUCCESS }
		}
	}
	return s
}

func TestEnumerateDGXH200(t *testing.T) {
	root := t.TempDir()
	gpus, err := gputopo.Enumerate(gputopo.WithNVML(dgx(t, root)), gputopo.WithSysfsRoot(root))
	if err != nil {
		t.Fatal(err)
	}
	if len(gpus) != 8 {
		t.Fatalf("got %d GPUs, want 8", len(gpus))
	}
	want := []struct {
		addr string
		node int
	}{
		{"0000:18:00.0", 0}, {"0000:2a:00.0", 0}, {"0000:3a:00.0", 0}, {"0000:5d:00.0", 0},
		{"0000:9a:00.0", 1}, {"0000:ab:00.0", 1}, {"0000:ba:00.0", 1}, {"0000:db:00.0", -1},
	}
	for i, g := range gpus {
		if g.Index != i || g.PCIAddr != want[i].addr || g.NUMANode != want[i].node {
			t.Errorf("GPU %d = %+v; want addr %s numa %d", i, g, want[i].addr, want[i].node)
		}
		if g.Name != "NVIDIA H200 141GB HBM3e" && g.Name == "" || g.MemoryBytes == 0 || g.UUID == "" {
			t.Errorf("GPU %d incomplete: %+v", i, g)
		}
	}
}

func TestEnumerateDegrades(t *testing.T) {
	tests := []struct {
		name string
		lib  nvml.Interface
		is   []error
		not  []error
	}{
		{"no libnvidia-ml (real loader)", nvml.New(nvml.WithLibraryPath(filepath.Join(t.TempDir(), "libnvidia-ml.so.1"))),
			[]error{gputopo.ErrNotSupported, gputopo.ErrNVMLNotFound}, nil},
		{"no GPU", &mock.Interface{
			InitFunc:           func() nvml.Return { return nvml.SUCCESS },
			ShutdownFunc:       func() nvml.Return { return nvml.SUCCESS },
			DeviceGetCountFunc: func() (int, nvml.Return) { return 0, nvml.SUCCESS },
		}, []error{gputopo.ErrNotSupported, gputopo.ErrNoGPU}, nil},
		{"probe failed", &mock.Interface{
			InitFunc: func() nvml.Return { return nvml.ERROR_UNKNOWN },
		}, nil, []error{gputopo.ErrNotSupported}},
		{"count failed", &mock.Interface{
			InitFunc:           func() nvml.Return { return nvml.SUCCESS },
			ShutdownFunc:       func() nvml.Return { return nvml.SUCCESS },
			DeviceGetCountFunc: func() (int, nvml.Return) { return 0, nvml.ERROR_GPU_IS_LOST },
		}, nil, []error{gputopo.ErrNotSupported}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			gpus, err := gputopo.Enumerate(gputopo.WithNVML(tc.lib))
			if err == nil || gpus != nil {
				t.Fatalf("Enumerate = %v, %v; want an error", gpus, err)
			}
			for _, s := range tc.is {
				if !errors.Is(err, s) {
					t.Errorf("%v: not %v", err, s)
				}
			}
			for _, s := range tc.not {
				if errors.Is(err, s) {
					t.Errorf("%v: unexpectedly %v", err, s)
				}
			}
		})
	}
}

func TestBusID(t *testing.T) {
	tests := []struct {
		name string
		in   nvml.PciInfo
		want string
		err  bool
	}{
		{"busId", nvml.PciInfo{BusId: busID("00000000:B8:00.0")}, "0000:b8:00.0", false},
		{"legacy", nvml.PciInfo{BusIdLegacy: [16]int8{'0', '0', '0', '0', ':', '1', 'A', ':', '0', '0', '.', '0'}}, "0000:1a:00.0", false},
		{"numbers", nvml.PciInfo{Domain: 1, Bus: 0xc1, Device: 0}, "0001:c1:00.0", false},
		{"empty", nvml.PciInfo{}, "", true},
		{"garbage", nvml.PciInfo{BusId: busID("GPU-0")}, "", true},
	}
	for _, tc := range tests {
		got, err := gputopo.BusID(tc.in)
		if (err != nil) != tc.err || got != tc.want {
			t.Errorf("%s: BusID = %q, %v; want %q (error %v)", tc.name, got, err, tc.want, tc.err)
		}
	}
}
