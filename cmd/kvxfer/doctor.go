package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
	"text/tabwriter"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/cuda/gputopo"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/ibverbs"
	"github.com/kvxfer/kvxfer/rdma"
)

// doctorItem is one line of `kvxfer doctor`.
type doctorItem struct {
	Component string `json:"component"`
	// Status is "ok" (present and usable), "warn" (present, but a setting
	// limits it; the detail says what to change), "missing" (not installed
	// or no such device here; the detail says how to get it), "n/a" (does
	// not apply on this host, e.g. a transport whose hardware is absent) or
	// "error" (the probe itself failed).
	Status string `json:"status"`
	Detail string `json:"detail"`
}

func init() {
	var jsonOut bool
	var live liveDoctorFlags
	cmd := &cobra.Command{
		Use:   "doctor",
		Short: "report what this host offers kvxfer; with --bootstrap, walk the evidence chain against a live deployment",
		Long: `Without --bootstrap: what this host offers kvxfer (libzmq, libibverbs and RDMA
devices, CUDA and NVML, memlock limit, usable transports).

With --bootstrap HOST:PORT: walk the evidence chain against a live prefill
instance from this host, as a decode would, with a probe room:

  directory         the bootstrap directory answers GET /health
  register          every rank of the topology registered (missing ranks named)
  resolve_topology  PrefillServerInfo (GET /route, all -1)
  resolve_rank      each rank's rank_ip:rank_port (GET /route per rank)
  connect           each rank's control port accepts a TCP connection from here
  handshake         per rank and transport: the rank answers the probe and opens
                    its data path to this host (RDMA QP exchange included)
  transfer          per rank and transport: a small pattern (--probe-bytes) is
                    written from a buffer of the rank's own into a scratch region
                    here — never into or from serving KV; under 4 MiB the time
                    is a write's latency, from 4 MiB on it is also given as GB/s
  verify            per rank and transport: the bytes landed intact

Each step and rank is timed. The first failing step is printed with what to do,
later steps are skipped. Exit status 0 only when every step passed; 1 when a
step failed; 2 when a rank refuses probes (started with --no-probe): the
doctor then stops at the handshake and says so.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if live.bootstrap != "" {
				rep, err := runLiveDoctor(cmd.Context(), &live)
				if err != nil {
					return err
				}
				return finishLiveDoctor(cmd.OutOrStdout(), rep, jsonOut)
			}
			items := runDoctor()
			if jsonOut {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(items)
			}
			printDoctor(cmd.OutOrStdout(), items)
			return nil
		},
	}
	cmd.Flags().BoolVar(&jsonOut, "json", false, "print JSON instead of a table")
	cmd.Flags().StringVar(&live.bootstrap, "bootstrap", "", "walk the evidence chain against the live prefill instance whose bootstrap directory is at this host:port")
	cmd.Flags().StringVar(&live.transport, "transport", "auto", "with --bootstrap: transports this host offers the ranks: auto (every usable one) or a comma list (tcp, shm, cma, rdma)")
	cmd.Flags().StringVar(&live.host, "doctor-host", "", "with --bootstrap: address of this host the ranks can reach (probe results and data come back to it); default: this host's address on the route to the first rank")
	cmd.Flags().IntVar(&live.probeBytes, "probe-bytes", 64<<10, "with --bootstrap: bytes each probe writes per rank and transport (at most 16 MiB)")
	cmd.Flags().StringVar(&live.controlAuth, "control-auth", controlAuthDefault(os.Getenv), "with --bootstrap: tag the probe's control frames with the deployment's token and check the ranks' answers, as ranks with control authentication need: auto (the default, as the ranks' --control-auth) when a token is given, true, or false (env KVXFER_CONTROL_AUTH=1 or 0)")
	cmd.Flags().Lookup("control-auth").NoOptDefVal = "true"
	cmd.Flags().StringVar(&live.authToken, "bootstrap-auth-token", "", "with --control-auth: the deployment's token (default: env KVXFER_BOOTSTRAP_AUTH_TOKEN, then SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN; prefer the env: flags show in ps)")
	cmd.Flags().DurationVar(&live.timeout, "timeout", 10*time.Second, "with --bootstrap: bound of each directory query and control connection; a rank's probe gets 10 s more")
	rootCmd.AddCommand(cmd)
}

func runDoctor() []doctorItem {
	var items []doctorItem
	add := func(c, status, detail string) { items = append(items, doctorItem{c, status, detail}) }
	classify := func(err error, notSupported ...error) string {
		for _, s := range notSupported {
			if errors.Is(err, s) {
				return "missing"
			}
		}
		return "error"
	}

	maj, min, pat := zmq.Version()
	add("libzmq", "ok", fmt.Sprintf("%d.%d.%d", maj, min, pat))

	if devs, err := ibverbs.Devices(); errors.Is(err, syscall.ENOSYS) {
		add("libibverbs", "warn", "library loaded, but the kernel has no RDMA support ("+err.Error()+"): load ib_uverbs and a NIC driver (or rdma_rxe for Soft-RoCE) to use the rdma transport")
	} else if err != nil {
		add("libibverbs", "error", err.Error())
	} else {
		add("libibverbs", "ok", fmt.Sprintf("%d verbs device(s)", len(devs)))
	}
	if nics, err := rdma.Discover(); err != nil {
		add("RDMA NICs", "error", err.Error())
	} else if len(nics) == 0 {
		add("RDMA NICs", "missing", "no RDMA device in /sys/class/infiniband (load a driver, or rdma link add rxe0 type rxe netdev eth0 for soft-RoCE)")
	} else {
		var names []string
		for _, n := range nics {
			names = append(names, n.Name)
		}
		add("RDMA NICs", "ok", fmt.Sprint(names))
	}

	if err := cuda.Available(); err != nil {
		add("CUDA", classify(err, cuda.ErrNotSupported), err.Error())
	} else {
		n, _ := cuda.DeviceCount()
		rt, drv := cuda.Versions()
		add("CUDA", "ok", fmt.Sprintf("%d device(s), runtime %d, driver %d", n, rt, drv))
		for i := 0; i < n; i++ {
			if p, err := cuda.Device(i); err == nil {
				add(fmt.Sprintf("  cuda:%d", i), "ok", fmt.Sprintf("%s, pci %s, %d GiB, dma-buf %v", p.Name, p.PCIBusID, p.TotalMemory>>30, p.DmaBuf))
			}
		}
	}
	if gpus, err := gputopo.Enumerate(); err != nil {
		add("NVML", classify(err, gputopo.ErrNotSupported), err.Error())
	} else {
		add("NVML", "ok", fmt.Sprintf("%d GPU(s)", len(gpus)))
	}

	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &rl); err != nil {
		add("memlock limit", "error", err.Error())
	} else if rl.Cur == unix.RLIM_INFINITY {
		add("memlock limit", "ok", "unlimited")
	} else {
		st := "ok"
		detail := fmt.Sprintf("%d KiB", rl.Cur>>10)
		if rl.Cur < 1<<30 {
			const raise = "raise it with ulimit -l unlimited, systemd LimitMEMLOCK=infinity or docker --ulimit memlock=-1"
			if transport.ProbeTransport("rdma") == nil {
				st = "warn"
				detail += ": too low for RDMA, which pins the KV pools; " + raise
			} else {
				detail += ": enough without RDMA (only RDMA pins the KV pools); before using RDMA " + raise
			}
		}
		add("memlock limit", st, detail)
	}

	for _, name := range transport.Transports() {
		if err := transport.ProbeTransport(name); err != nil {
			add("transport "+name, "n/a", err.Error())
		} else {
			add("transport "+name, "ok", "usable")
		}
	}
	return items
}

func printDoctor(w io.Writer, items []doctorItem) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "COMPONENT\tSTATUS\tDETAIL")
	for _, it := range items {
		fmt.Fprintf(tw, "%s\t%s\t%s\n", it.Component, it.Status, it.Detail)
	}
	tw.Flush()
}
