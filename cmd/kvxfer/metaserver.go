package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/kvxfer/kvxfer/metadata/httpmeta"
)

// metaServerFlags are the `kvxfer metadata-server` settings.
type metaServerFlags struct {
	host      string
	port      int
	maxValue  int64
	maxKeys   int
	maxMemory int64
}

func init() {
	var f metaServerFlags
	cmd := &cobra.Command{
		Use:   "metadata-server",
		Short: "run an HTTP metadata server: Mooncake's http://host:port/metadata mode (GET/PUT/DELETE /metadata?key=)",
		Long: `Run an in-memory HTTP metadata server with the routes of Mooncake's
mooncake_http_metadata_server: GET, PUT and DELETE /metadata?key=<key> and GET
/health. kvxfer engines (C ABI, Python: initialize(..., "http://host:port/metadata",
...)) publish their segment descriptors there under kvxfer/segments/<name>, and
Mooncake's own engines can share it. It prints one line,
"metadata server listening on http://ADDR/metadata", once it listens, and
stops on SIGINT or SIGTERM. Everything stored is lost when it stops; kvxfer
engines publish again within 5 s of a restart.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return runMetaServer(ctx, f, cmd.OutOrStdout())
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.host, "host", "0.0.0.0", "listen host: 0.0.0.0 or :: (every interface, Mooncake's default), 127.0.0.1, or an address of this machine")
	fl.IntVar(&f.port, "port", httpmeta.DefaultPort, "listen port (Mooncake's default 8080); 0 picks a free one")
	fl.Int64Var(&f.maxValue, "max-value-bytes", httpmeta.DefaultMaxValueBytes, "largest value a PUT may store (bytes; larger: 413)")
	fl.IntVar(&f.maxKeys, "max-keys", httpmeta.DefaultMaxKeys, "most keys stored (a new key beyond it: 507)")
	fl.Int64Var(&f.maxMemory, "max-bytes", httpmeta.DefaultMaxTotalBytes, "most bytes of keys and values stored (beyond it: 507)")
	rootCmd.AddCommand(cmd)
}

// runMetaServer serves until ctx is done; the listening line goes to out.
func runMetaServer(ctx context.Context, f metaServerFlags, out io.Writer) error {
	if f.port < 0 || f.port > 65535 {
		return fmt.Errorf("--port %d: want 0–65535", f.port)
	}
	if f.maxValue <= 0 || f.maxKeys <= 0 || f.maxMemory <= 0 {
		return fmt.Errorf("--max-value-bytes, --max-keys and --max-bytes must be positive (got %d, %d, %d)", f.maxValue, f.maxKeys, f.maxMemory)
	}
	s := httpmeta.New(httpmeta.Options{Host: f.host, Port: f.port, PortFlag: "--port", MaxValueBytes: f.maxValue, MaxKeys: f.maxKeys, MaxTotalBytes: f.maxMemory})
	done := make(chan error, 1)
	go func() { done <- s.Start(ctx) }()
	select {
	case err := <-done:
		return err
	case <-s.Ready():
	}
	fmt.Fprintf(out, "metadata server listening on http://%s%s\n", s.Addr(), httpmeta.Path)
	return <-done
}
