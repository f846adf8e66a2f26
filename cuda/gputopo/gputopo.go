// Package gputopo enumerates NVIDIA GPUs through NVML (NVIDIA/go-nvml) with
// the facts kvxfer's topology needs: index, name, UUID, memory, PCI address
// (normalised to the sysfs form) and NUMA node. It degrades cleanly: with no
// libnvidia-ml, Enumerate returns an error wrapping ErrNotSupported and
// ErrNVMLNotFound instead of failing.
//
// It is a subpackage of cuda/ so that only programs that want topology link
// go-nvml (whose cgo flags leave NVML symbols unresolved until dlopen).
// Tests inject an nvml.Interface (go-nvml's mock/dgxh100 or dgxh200 servers)
// and a sysfs root.
package gputopo

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/kvxfer/kvxfer/internal/pciaddr"
)

var (
	// ErrNotSupported: GPU enumeration cannot work on this host; the error
	// says why (ErrNVMLNotFound or ErrNoGPU, which both match it).
	ErrNotSupported = errors.New("not supported")
	// ErrNVMLNotFound: libnvidia-ml.so.1 could not be loaded (no NVIDIA
	// driver installed). It matches ErrNotSupported.
	ErrNVMLNotFound error = reason("libnvidia-ml not found (no NVIDIA driver on this host)")
	// ErrNoGPU: NVML loads but reports no GPU. It matches ErrNotSupported.
	ErrNoGPU error = reason("NVML reports no GPU")
)

// reason is a "not supported" cause: it matches ErrNotSupported too.
type reason string

func (r reason) Error() string        { return string(r) }
func (r reason) Is(target error) bool { return target == ErrNotSupported }

// GPU is one GPU as NVML reports it (plain data).
type GPU struct {
	// Index is NVML's device index (the order of nvidia-smi; CUDA's order
	// matches it with CUDA_DEVICE_ORDER=PCI_BUS_ID).
	Index int `json:"index"`
	// Name is the product name, e.g. "NVIDIA H200".
	Name string `json:"name"`
	// UUID is the GPU UUID ("GPU-...").
	UUID string `json:"uuid,omitempty"`
	// PCIAddr is the PCI address in sysfs form ("0000:18:00.0").
	PCIAddr string `json:"pci_addr"`
	// NUMANode is the GPU's NUMA node (from NVML, else sysfs), -1 if unknown.
	NUMANode int `json:"numa_node"`
	// MemoryBytes is the total device memory in bytes (0 if unknown).
	MemoryBytes uint64 `json:"memory_bytes"`
}

// Option configures Enumerate.
type Option func(*config)

type config struct {
	lib  nvml.Interface
	root string
}

// WithNVML makes Enumerate query lib instead of the system's libnvidia-ml
// (tests pass a go-nvml mock server).
func WithNVML(lib nvml.Interface) Option { return func(c *config) { c.lib = lib } }

// WithSysfsRoot reads the NUMA-node fallback from dir instead of /sys.
func WithSysfsRoot(dir string) Option { return func(c *config) { c.root = dir } }

// Enumerate lists the GPUs. Outcomes: the list and nil; an error wrapping
// ErrNotSupported and ErrNVMLNotFound or ErrNoGPU when there is nothing to
// list here; any other error when NVML itself failed (it names the call and
// the device index).
func Enumerate(opts ...Option) ([]GPU, error) {
	c := config{root: "/sys"}
	for _, o := range opts {
		o(&c)
	}
	if c.lib == nil {
		c.lib = nvml.New()
	}
	if ret := c.lib.Init(); ret != nvml.SUCCESS {
		if ret == nvml.ERROR_LIBRARY_NOT_FOUND || ret == nvml.ERROR_DRIVER_NOT_LOADED {
			return nil, fmt.Errorf("gputopo: %w: nvmlInit: %s", ErrNVMLNotFound, ret.Error())
		}
		return nil, fmt.Errorf("gputopo: nvmlInit: %s", ret.Error())
	}
	defer c.lib.Shutdown()
	n, ret := c.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("gputopo: nvmlDeviceGetCount: %s", ret.Error())
	}
	if n == 0 {
		return nil, fmt.Errorf("gputopo: %w (device count 0)", ErrNoGPU)
	}
	out := make([]GPU, 0, n)
	for i := 0; i < n; i++ {
		g, err := describe(c, i)
		if err != nil {
			return nil, err
		}
		out = append(out, g)
	}
	return out, nil
}

func describe(c config, i int) (GPU, error) {
	d, ret := c.lib.DeviceGetHandleByIndex(i)
	if ret != nvml.SUCCESS {
		return GPU{}, fmt.Errorf("gputopo: nvmlDeviceGetHandleByIndex(%d): %s", i, ret.Error())
	}
	g := GPU{Index: i, NUMANode: -1}
	if g.Name, ret = d.GetName(); ret != nvml.SUCCESS {
		return GPU{}, fmt.Errorf("gputopo: GPU %d: nvmlDeviceGetName: %s", i, ret.Error())
	}
	if uuid, ret := d.GetUUID(); ret == nvml.SUCCESS {
		g.UUID = uuid
	}
	if mem, ret := d.GetMemoryInfo(); ret == nvml.SUCCESS {
		g.MemoryBytes = mem.Total
	}
	pci, ret := d.GetPciInfo()
	if ret != nvml.SUCCESS {
		return GPU{}, fmt.Errorf("gputopo: GPU %d: nvmlDeviceGetPciInfo: %s", i, ret.Error())
	}
	addr, err := BusID(pci)
	if err != nil {
		return GPU{}, fmt.Errorf("gputopo: GPU %d: %w", i, err)
	}
	g.PCIAddr = addr
	if node, ret := d.GetNumaNodeId(); ret == nvml.SUCCESS && node >= 0 {
		g.NUMANode = node
	} else if v, err := strconv.Atoi(readTrim(filepath.Join(c.root, "bus/pci/devices", addr, "numa_node"))); err == nil && v >= 0 {
		g.NUMANode = v
	}
	return g, nil
}

// BusID returns the PCI address of an nvmlPciInfo_t in sysfs form: from its
// busId text ("00000000:18:00.0"), else busIdLegacy, else built from the
// domain/bus/device numbers (function 0, as NVML reports GPUs).
func BusID(p nvml.PciInfo) (string, error) {
	for _, raw := range [][]int8{p.BusId[:], p.BusIdLegacy[:]} {
		if s := cString(raw); s != "" {
			return pciaddr.Normalize(s)
		}
	}
	if p.Domain == 0 && p.Bus == 0 && p.Device == 0 {
		return "", errors.New("NVML gave no PCI bus id")
	}
	return pciaddr.Normalize(fmt.Sprintf("%08x:%02x:%02x.0", p.Domain, p.Bus, p.Device))
}

func cString(b []int8) string {
	var sb strings.Builder
	for _, c := range b {
		if c == 0 {
			break
		}
		sb.WriteByte(byte(c))
	}
	return sb.String()
}

func readTrim(p string) string {
	b, err := os.ReadFile(p)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}
