package rdma

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/kvxfer/kvxfer/internal/pciaddr"
)

// GPU is a GPU's placement for the affinity matrix (plain data; fill it from
// cuda/gputopo or by hand).
type GPU struct {
	// Index is the GPU's index (NVML order).
	Index int `json:"index"`
	// Name is the product name (informational).
	Name string `json:"name,omitempty"`
	// PCIAddr is the GPU's PCI address in any form NVML, CUDA or sysfs use
	// ("00000000:18:00.0" or "0000:18:00.0").
	PCIAddr string `json:"pci_addr"`
	// NUMANode is the GPU's NUMA node, -1 when unknown.
	NUMANode int `json:"numa_node"`
}

// Link is how close a GPU and a NIC are; a larger value is closer. The order
// follows the GPUDirect RDMA guidance: a shared PCIe switch keeps peer
// traffic off the CPU's root complex; the same NUMA node keeps it off the
// inter-socket link.
type Link uint8

const (
	// LinkOther: different NUMA nodes, or a placement that is unknown.
	LinkOther Link = 0
	// LinkNUMA: same NUMA node, no shared PCIe switch.
	LinkNUMA Link = 1
	// LinkSwitch: behind the same PCIe switch (a shared bridge below the
	// root complex), nvidia-smi topo's PIX/PXB.
	LinkSwitch Link = 2
)

// String returns "pcie-switch", "numa" or "other".
func (l Link) String() string {
	switch l {
	case LinkSwitch:
		return "pcie-switch"
	case LinkNUMA:
		return "numa"
	case LinkOther:
		return "other"
	}
	return fmt.Sprintf("link(%d)", uint8(l))
}

// MarshalText encodes the link as its String form (for JSON).
func (l Link) MarshalText() ([]byte, error) { return []byte(l.String()), nil }

// Affinity is the GPU×NIC matrix: Links[g][n] relates GPUs[g] and NICs[n].
type Affinity struct {
	GPUs  []GPU    `json:"gpus"`
	NICs  []string `json:"nics"`
	Links [][]Link `json:"links"`
}

// Best returns the NICs closest to GPU row g (all NICs that share the best
// link, in NIC order); nil when there are no NICs or g is out of range.
func (a *Affinity) Best(g int) []string {
	if g < 0 || g >= len(a.Links) || len(a.NICs) == 0 {
		return nil
	}
	best := LinkOther
	for _, l := range a.Links[g] {
		best = max(best, l)
	}
	var out []string
	for n, l := range a.Links[g] {
		if l == best {
			out = append(out, a.NICs[n])
		}
	}
	return out
}

// AffinityOption configures ComputeAffinity.
type AffinityOption func(*affinityConfig)

type affinityConfig struct{ root string }

// AffinitySysfsRoot reads PCI device paths from dir instead of /sys.
func AffinitySysfsRoot(dir string) AffinityOption {
	return func(c *affinityConfig) { c.root = dir }
}

// ComputeAffinity builds the GPU↔NIC matrix. A PCIe switch is detected from
// the sysfs device paths (<sysfs>/bus/pci/devices/<addr>, and for NICs
// <sysfs>/class/infiniband/<name>/device): two devices whose resolved paths
// share a PCI bridge below the root complex sit behind the same switch. When
// a path cannot be resolved (software NICs such as rxe, containers without
// /sys/bus/pci) the NUMA nodes decide. Errors: a GPU PCI address that does
// not parse, naming the GPU.
func ComputeAffinity(gpus []GPU, nics []NIC, opts ...AffinityOption) (*Affinity, error) {
	c := affinityConfig{root: "/sys"}
	for _, o := range opts {
		o(&c)
	}
	a := &Affinity{GPUs: make([]GPU, len(gpus)), NICs: make([]string, len(nics)), Links: make([][]Link, len(gpus))}
	nicChains := make([][]string, len(nics))
	for n, nic := range nics {
		a.NICs[n] = nic.Name
		nicChains[n] = pciChain(filepath.Join(c.root, "class/infiniband", nic.Name, "device"))
		if nicChains[n] == nil && nic.PCIAddr != "" {
			if addr, err := pciaddr.Normalize(nic.PCIAddr); err == nil {
				nicChains[n] = pciChain(filepath.Join(c.root, "bus/pci/devices", addr))
			}
		}
	}
	for g, gpu := range gpus {
		addr, err := pciaddr.Normalize(gpu.PCIAddr)
		if err != nil {
			return nil, fmt.Errorf("rdma: affinity: GPU %d: %w", gpu.Index, err)
		}
		gpu.PCIAddr = addr
		a.GPUs[g] = gpu
		chain := pciChain(filepath.Join(c.root, "bus/pci/devices", addr))
		a.Links[g] = make([]Link, len(nics))
		for n, nic := range nics {
			switch {
			case sharesBridge(chain, nicChains[n]):
				a.Links[g][n] = LinkSwitch
			case gpu.NUMANode >= 0 && gpu.NUMANode == nic.NUMANode:
				a.Links[g][n] = LinkNUMA
			default:
				a.Links[g][n] = LinkOther
			}
		}
	}
	return a, nil
}

var pciComponentRE = regexp.MustCompile(`^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`)

// pciChain resolves a sysfs device link and returns the PCI functions on
// its path from the root port down to the device itself
// (/sys/devices/pci0000:10/0000:10:01.0/0000:11:00.0/... ->
// [0000:10:01.0 0000:11:00.0 ...]); nil when the link does not resolve.
func pciChain(link string) []string {
	target, err := filepath.EvalSymlinks(link)
	if err != nil {
		return nil
	}
	fi, err := os.Stat(target)
	if err != nil || !fi.IsDir() {
		return nil
	}
	var chain []string
	for _, part := range strings.Split(filepath.ToSlash(target), "/") {
		if pciComponentRE.MatchString(strings.ToLower(part)) {
			chain = append(chain, strings.ToLower(part))
		} else if strings.HasPrefix(part, "pci") {
			chain = chain[:0] // restart at each root complex ("pci0000:10")
		}
	}
	return chain
}

// sharesBridge reports whether two device chains have a common ancestor
// function (a bridge) — i.e. they meet below the root complex.
func sharesBridge(a, b []string) bool {
	if len(a) < 2 || len(b) < 2 {
		return false
	}
	anc := map[string]bool{}
	for _, p := range a[:len(a)-1] {
		anc[p] = true
	}
	for _, p := range b[:len(b)-1] {
		if anc[p] {
			return true
		}
	}
	return false
}
