package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/kvxfer/kvxfer/bench/fleetsim"
	"github.com/kvxfer/kvxfer/metadata"
)

// metadataEnv is the environment variable --metadata defaults to.
const metadataEnv = "KVXFER_METADATA"

const metadataHelp = "metadata server for segment and instance metadata: etcd://host:port[,host:port…][/prefix] " +
	"(descriptors published under a lease; peers found by name, crashes and restarts noticed through watches), " +
	"or empty / P2PHANDSHAKE for none (env " + metadataEnv + ")"

// addMetadataFlags adds --metadata and --metadata-ttl.
func addMetadataFlags(fs *pflag.FlagSet, url *string, ttl *time.Duration) {
	fs.StringVar(url, "metadata", envOr(metadataEnv, ""), metadataHelp)
	fs.DurationVar(ttl, "metadata-ttl", metadata.DefaultTTL, "lease TTL of what this process publishes in the metadata server: it vanishes this long after the process dies or is cut off (>= 2s)")
}

// openMetadata opens the metadata store url names, or returns nil for P2P.
func openMetadata(ctx context.Context, url string, ttl time.Duration) (*metadata.Store, error) {
	if metadata.IsP2P(url) {
		return nil, nil
	}
	s, err := metadata.Open(ctx, url, metadata.Options{TTL: ttl})
	if err != nil {
		return nil, fmt.Errorf("--metadata: %w", err)
	}
	return s, nil
}

type fleetFlags struct {
	metadata string
	jsonOut  bool
	simulate int
	clients  int
	resolves int
}

func init() {
	var f fleetFlags
	cmd := &cobra.Command{
		Use:   "fleet",
		Short: "list the prefill instances and segments published in a metadata server (etcd), or simulate a fleet against it",
		Long: `List what a kvxfer fleet publishes in etcd: every prefill instance's bootstrap
directory (address, readiness, topology, registered and missing ranks) and the
segments engines and ranks publish under their leases. Each registered rank is
checked against the published segments: "live" (published with the epoch the
directory lists), "restarted" (published by a newer process than the
directory entry) or "absent" (crashed more than a lease TTL ago, or started
without --metadata); records whose publisher stopped rewriting them are stale
too. Exit status 0 when nothing is stale, 3 when something is.

--simulate N registers N simulated ranks (a lease and a descriptor each) under
a scratch prefix, times name lookups and the fan-out of one rank's restart to
every other rank's watch, prints the figures and removes everything it wrote.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return runFleet(ctx, cmd, f)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&f.metadata, "metadata", envOr(metadataEnv, ""), "etcd://host:port[,host:port…][/prefix] to read (env "+metadataEnv+")")
	fs.BoolVar(&f.jsonOut, "json", false, "print the report (or the simulation figures) as JSON")
	fs.IntVar(&f.simulate, "simulate", 0, "simulate N ranks against the metadata server instead of listing (N >= 2)")
	fs.IntVar(&f.clients, "clients", 0, "with --simulate: etcd client connections the ranks share (default one per 25 ranks)")
	fs.IntVar(&f.resolves, "resolves", 0, "with --simulate: name lookups to time (default 10 per rank)")
	rootCmd.AddCommand(cmd)
}

// errStale makes `kvxfer fleet` exit with status 3.
type errStale struct{ n int }

func (e errStale) Error() string { return fmt.Sprintf("%d stale entries", e.n) }

func runFleet(ctx context.Context, cmd *cobra.Command, f fleetFlags) error {
	if metadata.IsP2P(f.metadata) {
		return fmt.Errorf("kvxfer fleet: no metadata server: pass --metadata etcd://host:port[/prefix] or set %s", metadataEnv)
	}
	out := cmd.OutOrStdout()
	if f.simulate != 0 {
		if f.simulate < 2 {
			return fmt.Errorf("--simulate %d: want at least 2 ranks", f.simulate)
		}
		r, err := fleetsim.Simulate(ctx, f.metadata, fleetsim.Options{Ranks: f.simulate, Clients: f.clients, Resolves: f.resolves})
		if err != nil {
			return err
		}
		if f.jsonOut {
			enc := json.NewEncoder(out)
			enc.SetIndent("", "  ")
			return enc.Encode(r)
		}
		fmt.Fprintln(out, r)
		return nil
	}
	s, err := metadata.Open(ctx, f.metadata, metadata.Options{})
	if err != nil {
		return err
	}
	defer s.Close()
	rep, err := s.Fleet(ctx, time.Now())
	if err != nil {
		return err
	}
	if f.jsonOut {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return err
		}
	} else {
		fmt.Fprint(out, metadata.FormatFleet(rep))
	}
	if rep.Stale > 0 {
		return errStale{rep.Stale}
	}
	return nil
}
