package main

import (
	"github.com/spf13/cobra"

	"github.com/kvxfer/kvxfer/engine"
)

func init() {
	var f roleFlags
	cmd := &cobra.Command{
		Use:   "prefill",
		Short: "run one prefill rank: register with the bootstrap server and send KV for requests read from stdin",
		Long: `Run one prefill rank (one process per TP/PP rank). It allocates its KV pool,
opens the data transports, binds its ZMQ control socket and registers it with
the bootstrap server (PUT /route). Then it reads requests from stdin, one JSON
object per line: {"room": <bootstrap_room>, "tokens": <prompt length>}. For each
it fills the request's pages with the test pattern, waits for the decode
ranks' TRANSFER, writes the pages and the metadata record, and prints one JSON
result line to stdout. EOF on stdin shuts the rank down.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error { return runRole(engine.RolePrefill, &f) },
	}
	f.add(cmd, engine.RolePrefill)
	rootCmd.AddCommand(cmd)
}
