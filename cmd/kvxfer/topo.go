package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kvxfer/kvxfer/cuda/gputopo"
	"github.com/kvxfer/kvxfer/rdma"
)

// topoReport is what `kvxfer topo --json` prints.
type topoReport struct {
	GPUs     []gputopo.GPU  `json:"gpus"`
	GPUError string         `json:"gpu_error,omitempty"`
	NICs     []rdma.NIC     `json:"nics"`
	NICError string         `json:"nic_error,omitempty"`
	Affinity *rdma.Affinity `json:"affinity,omitempty"`
}

func init() {
	var jsonOut bool
	var sysfs string
	cmd := &cobra.Command{
		Use:   "topo",
		Short: "show GPUs (NVML), RDMA NICs (sysfs) and the GPU<->NIC affinity matrix",
		Long: `List the GPUs NVML reports (PCI address, NUMA node), the RDMA NICs found in
sysfs, and for each GPU the closest NICs: a shared PCIe switch beats the same
NUMA node, which beats anything else. A host without an NVIDIA driver prints
"no GPU" with the reason and still lists the NICs; a host without RDMA
devices prints "no RDMA NIC".`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			rep, err := buildTopo(sysfs)
			if jsonOut {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				if eerr := enc.Encode(rep); eerr != nil {
					return eerr
				}
			} else {
				printTopo(cmd.OutOrStdout(), rep)
			}
			return err
		},
	}
	cmd.Flags().BoolVar(&jsonOut, "json", false, "print JSON instead of tables")
	cmd.Flags().StringVar(&sysfs, "sysfs", "/sys", "sysfs root (for tests and containers)")
	rootCmd.AddCommand(cmd)
}

// buildTopo gathers the report. "Not supported" outcomes (no driver, no GPU,
// no RDMA stack) are part of the report; other failures are returned after
// the report is complete so the command still prints what it found.
func buildTopo(sysfs string) (topoReport, error) {
	var rep topoReport
	var errs []error
	gpus, err := gputopo.Enumerate(gputopo.WithSysfsRoot(sysfs))
	if err != nil {
		rep.GPUError = err.Error()
		if !errors.Is(err, gputopo.ErrNotSupported) {
			errs = append(errs, fmt.Errorf("topo: GPU enumeration: %w", err))
		}
	}
	rep.GPUs = append([]gputopo.GPU{}, gpus...)
	nics, err := rdma.Discover(rdma.WithSysfsRoot(sysfs))
	if err != nil {
		rep.NICError = err.Error()
		errs = append(errs, fmt.Errorf("topo: RDMA discovery: %w", err))
	}
	rep.NICs = append([]rdma.NIC{}, nics...)
	if len(gpus) > 0 {
		in := make([]rdma.GPU, len(gpus))
		for i, g := range gpus {
			in[i] = rdma.GPU{Index: g.Index, Name: g.Name, PCIAddr: g.PCIAddr, NUMANode: g.NUMANode}
		}
		a, err := rdma.ComputeAffinity(in, nics, rdma.AffinitySysfsRoot(sysfs))
		if err != nil {
			errs = append(errs, err)
		}
		rep.Affinity = a
	}
	return rep, errors.Join(errs...)
}

func numa(n int) string {
	if n < 0 {
		return "?"
	}
	return fmt.Sprint(n)
}

func printTopo(w io.Writer, rep topoReport) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	if len(rep.GPUs) == 0 {
		fmt.Fprintf(tw, "no GPU (%s)\n", rep.GPUError)
	} else {
		fmt.Fprintln(tw, "GPU\tNAME\tPCI\tNUMA\tMEMORY\tNEAREST NIC")
		for i, g := range rep.GPUs {
			best := "-"
			if rep.Affinity != nil {
				if b := rep.Affinity.Best(i); len(b) > 0 {
					best = strings.Join(b, ",") + " (" + rep.Affinity.Links[i][indexOf(rep.Affinity.NICs, b[0])].String() + ")"
				}
			}
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d GiB\t%s\n", g.Index, g.Name, g.PCIAddr, numa(g.NUMANode), g.MemoryBytes>>30, best)
		}
	}
	fmt.Fprintln(tw)
	if len(rep.NICs) == 0 {
		if rep.NICError != "" {
			fmt.Fprintf(tw, "no RDMA NIC (%s)\n", rep.NICError)
		} else {
			fmt.Fprintln(tw, "no RDMA NIC")
		}
	} else {
		fmt.Fprintln(tw, "NIC\tPCI\tNUMA\tNETDEVS\tPORTS")
		for _, n := range rep.NICs {
			var ports []string
			for _, p := range n.Ports {
				ports = append(ports, fmt.Sprintf("%d:%s/%s", p.Num, p.State, p.LinkLayer))
			}
			pci := n.PCIAddr
			if pci == "" {
				pci = "(software)"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", n.Name, pci, numa(n.NUMANode), strings.Join(n.NetDevs, ","), strings.Join(ports, " "))
		}
	}
	if a := rep.Affinity; a != nil && len(a.NICs) > 0 {
		fmt.Fprintln(tw)
		fmt.Fprintln(tw, "AFFINITY\t"+strings.Join(a.NICs, "\t"))
		for g, row := range a.Links {
			cells := make([]string, len(row))
			for n, l := range row {
				cells[n] = l.String()
			}
			fmt.Fprintf(tw, "GPU%d\t%s\n", a.GPUs[g].Index, strings.Join(cells, "\t"))
		}
	}
	tw.Flush()
}

func indexOf(list []string, s string) int {
	for i, x := range list {
		if x == s {
			return i
		}
	}
	return 0
}
