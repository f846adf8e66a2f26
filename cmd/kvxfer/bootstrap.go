package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/bootstrap/server"
)

// bootstrapFlags are the `kvxfer bootstrap` settings; flags win over the
// environment (KVXFER_*, then SGLang's names where they mean the same).
type bootstrapFlags struct {
	host         string
	port         int
	entryTTL     time.Duration
	authToken    string
	compat       string
	distInitAddr string
	requestLog   bool
	metadata     string
	metadataTTL  time.Duration
}

var bsFlags bootstrapFlags

var bootstrapCmd = &cobra.Command{
	Use:   "bootstrap",
	Short: "run the SGLang-compatible bootstrap directory server of one prefill instance",
	Long: `Run the bootstrap directory: prefill ranks register with PUT /route, decode
ranks resolve the topology and each rank's endpoint with GET /route, rooms map
to prefill DP ranks through /register_dp_rank and /query_dp_ranks, and /health
answers heartbeats (GET and HEAD) — SGLang's routes, bodies and status codes,
DP-attention registrations included. kvxfer adds GET /v1/table (the whole
directory), GET /v1/entry (one rank's entry, whether or not the directory is
ready: ranks poll it and register again after a restart), DELETE /route
(deregistration; with &instance_id= only while the entry still names that
instance) and /metrics (Prometheus). --host :: serves IPv6 and IPv4.

Environment (flags win): KVXFER_BOOTSTRAP_HOST, KVXFER_BOOTSTRAP_PORT,
KVXFER_BOOTSTRAP_ENTRY_TTL (a duration such as 120s) or
SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL (seconds),
KVXFER_BOOTSTRAP_AUTH_TOKEN or SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN,
KVXFER_BOOTSTRAP_COMPAT, KVXFER_DIST_INIT_ADDR.`,
	Args: cobra.NoArgs,
	RunE: func(cmd *cobra.Command, args []string) error {
		ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		return runBootstrap(ctx, cmd, bsFlags)
	},
}

var bootstrapTableCmd = &cobra.Command{
	Use:   "table ADDR",
	Short: "Print a bootstrap server's directory (GET /v1/table) as JSON; ADDR is host:port",
	Args:  cobra.ExactArgs(1),
	RunE: func(cmd *cobra.Command, args []string) error {
		c, err := bootstrap.NewClient(args[0])
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(cmd.Context(), 10*time.Second)
		defer cancel()
		t, err := c.Table(ctx)
		if err != nil {
			return err
		}
		enc := json.NewEncoder(cmd.OutOrStdout())
		enc.SetIndent("", "  ")
		return enc.Encode(t)
	},
}

func init() {
	f := bootstrapCmd.Flags()
	f.StringVar(&bsFlags.host, "host", envOr("KVXFER_BOOTSTRAP_HOST", "127.0.0.1"), "listen host: 127.0.0.1 (this machine only), 0.0.0.0 or :: (every interface), or an address of a local interface (env KVXFER_BOOTSTRAP_HOST)")
	f.IntVar(&bsFlags.port, "port", bootstrap.DefaultPort, "listen port, SGLang's --disaggregation-bootstrap-port; 0 picks a free one (env KVXFER_BOOTSTRAP_PORT)")
	f.DurationVar(&bsFlags.entryTTL, "entry-ttl", bootstrap.DefaultEntryTTL, "lifetime of room→dp-rank entries (env KVXFER_BOOTSTRAP_ENTRY_TTL, SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL in seconds)")
	f.StringVar(&bsFlags.authToken, "auth-token", "", "require this bearer token on PUT/DELETE /route and POST /register_dp_rank; off when empty (env KVXFER_BOOTSTRAP_AUTH_TOKEN, SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN; prefer the env, flags show in ps)")
	f.StringVar(&bsFlags.compat, "compat", envOr("KVXFER_BOOTSTRAP_COMPAT", bootstrap.DefaultCompat),
		"PrefillServerInfo key set: "+bootstrap.CompatSGLangNewest+" (default: SGLang's newest, with decode_allocation_policy and dsv41_spec_layout) or "+
			bootstrap.CompatSGLang0094505+" (for SGLang decodes of that age, which refuse keys they do not know) (env KVXFER_BOOTSTRAP_COMPAT)")
	f.StringVar(&bsFlags.distInitAddr, "dist-init-addr", envOr("KVXFER_DIST_INIT_ADDR", ""), "multi-node prefill leader address host:port; reported to followers for their leader check (env KVXFER_DIST_INIT_ADDR)")
	f.BoolVar(&bsFlags.requestLog, "request-log", false, "log every request at debug level")
	addMetadataFlags(f, &bsFlags.metadata, &bsFlags.metadataTTL)
	bootstrapCmd.AddCommand(bootstrapTableCmd)
	rootCmd.AddCommand(bootstrapCmd)
}

// applyBootstrapEnv fills the settings whose flags were not given from the
// environment; a malformed value is an error naming the variable.
func applyBootstrapEnv(cmd *cobra.Command, f *bootstrapFlags, getenv func(string) string) error {
	changed := cmd.Flags().Changed
	if !changed("port") {
		if v := getenv("KVXFER_BOOTSTRAP_PORT"); v != "" {
			p, err := strconv.Atoi(v)
			if err != nil || p < 0 || p > 65535 {
				return fmt.Errorf("KVXFER_BOOTSTRAP_PORT=%q: want a port number 0–65535", v)
			}
			f.port = p
		}
	}
	if !changed("entry-ttl") {
		if v := getenv("KVXFER_BOOTSTRAP_ENTRY_TTL"); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil || d <= 0 {
				return fmt.Errorf("KVXFER_BOOTSTRAP_ENTRY_TTL=%q: want a positive duration such as 120s", v)
			}
			f.entryTTL = d
		} else if v := getenv("SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL"); v != "" {
			sec, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil || sec <= 0 || sec > 1e9 {
				return fmt.Errorf("SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL=%q: want a positive number of seconds", v)
			}
			f.entryTTL = time.Duration(sec * float64(time.Second))
		}
	}
	if !changed("auth-token") {
		f.authToken = bootstrapToken("", getenv)
	}
	if f.entryTTL <= 0 {
		return fmt.Errorf("--entry-ttl %s: want a positive duration", f.entryTTL)
	}
	if f.port < 0 || f.port > 65535 {
		return fmt.Errorf("--port %d: want 0–65535", f.port)
	}
	if f.distInitAddr != "" {
		if _, err := bootstrap.LeaderBootstrapAddr(f.distInitAddr, bootstrap.DefaultPort); err != nil {
			return fmt.Errorf("--dist-init-addr: %w", err)
		}
	}
	return nil
}

// publishedAddr is the bootstrap address as the fleet sees it: a wildcard
// bind is published with this host's name.
func publishedAddr(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		if h, err := os.Hostname(); err == nil {
			return net.JoinHostPort(h, port)
		}
	}
	return addr
}

func runBootstrap(ctx context.Context, cmd *cobra.Command, f bootstrapFlags) error {
	if err := applyBootstrapEnv(cmd, &f, os.Getenv); err != nil {
		return err
	}
	s := server.New(server.Options{
		Host: f.host, Port: f.port, PortFlag: "--port", EntryTTL: f.entryTTL, AuthToken: f.authToken,
		Compat: f.compat, DistInitAddr: f.distInitAddr, RequestLog: f.requestLog,
	})
	store, err := openMetadata(ctx, f.metadata, f.metadataTTL)
	if err != nil {
		return err
	}
	if store == nil {
		return s.Start(ctx)
	}
	defer store.Close()
	pctx, stopPub := context.WithCancel(ctx)
	published := make(chan struct{})
	go func() {
		defer close(published)
		select {
		case <-s.Ready():
		case <-pctx.Done():
			return
		}
		store.PublishInstanceLoop(pctx, publishedAddr(s.Addr()), s.Snapshot, 0, 0)
	}()
	err = s.Start(ctx)
	stopPub()
	<-published
	return err
}
