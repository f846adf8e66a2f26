package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/kvxfer/kvxfer/rdma"
)

// nvidiaGPUDir lists one directory per NVIDIA GPU (by PCI address) when the
// kernel driver is loaded; read without NVML so bench needs no cgo.
const nvidiaGPUDir = "/proc/driver/nvidia/gpus"

// DiscoverHardware lists RDMA NICs (rdma.Discover) and NVIDIA GPUs and the
// (NIC, GPU) pairs a per-pair run would cover. measurable says whether an
// engine transport that can move GPU memory over a NIC is registered; when
// not, or when either side is missing, Note says why no pair is measured.
func DiscoverHardware(measurable bool) Hardware {
	var h Hardware
	nics, err := rdma.Discover()
	if err != nil {
		h.Note = fmt.Sprintf("RDMA discovery failed: %v", err)
	}
	for _, n := range nics {
		h.NICs = append(h.NICs, n.Name)
	}
	if ents, err := os.ReadDir(nvidiaGPUDir); err == nil {
		for _, e := range ents {
			h.GPUs = append(h.GPUs, "gpu@"+filepath.Base(e.Name()))
		}
	}
	sort.Strings(h.GPUs)
	for _, n := range h.NICs {
		for _, g := range h.GPUs {
			h.Pairs = append(h.Pairs, n+"/"+g)
		}
	}
	switch {
	case h.Note != "":
	case len(h.NICs) == 0 && len(h.GPUs) == 0:
		h.Note = "no NIC/GPU: no RDMA device under /sys/class/infiniband and no NVIDIA GPU in " + nvidiaGPUDir
	case len(h.NICs) == 0:
		h.Note = fmt.Sprintf("no NIC: %d GPU(s) but no RDMA device, so no (NIC, GPU) pair", len(h.GPUs))
	case len(h.GPUs) == 0:
		h.Note = fmt.Sprintf("no GPU: %d RDMA device(s) (host-memory rdma runs only)", len(h.NICs))
	case !measurable:
		h.Note = "pairs found but no registered transport moves GPU memory over RDMA (build with the rdma transport)"
	}
	return h
}
