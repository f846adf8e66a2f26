package main

import (
	"github.com/spf13/cobra"

	"github.com/kvxfer/kvxfer/engine"
)

func init() {
	var f roleFlags
	cmd := &cobra.Command{
		Use:   "prefill",
		Short: "run one prefill rank: register with the bootstrap server and send KV for requests read from stdin or --serve (a unix socket or HTTP)",
		Long: `Run one prefill rank (one process per TP/PP rank). It allocates its KV pool,
opens the data transports, binds its ZMQ control socket and registers it with
the bootstrap server (PUT /route). Then it reads requests from stdin, one JSON
object per line: {"room": <bootstrap_room 0 … 2^63-1>, "tokens": <prompt length
>= 1>}; both keys are required. For each it fills the request's pages with the
test pattern, waits for the decode ranks' TRANSFER, writes the pages and the
metadata record.

Layer-wise (optional keys): "layer_compute_us": N models the forward pass,
N µs of compute per layer over the whole prompt, run after the decode's
destination is known, chunk by chunk (--chunk-pages) and layer by layer,
sleeping each layer's share (the pattern is written before); "layerwise":
true sends each layer of each chunk as soon as it is computed
(engine.Sender.SendLayers) instead of each chunk after its last layer. The
result then carries compute_start_unix_ns and compute_end_unix_ns.

stdout: first {"event":"ready", "endpoint": ..., "transports": [...]} (no
room key), then exactly one JSON result line per non-blank input line, in
completion order: {"line": N, "room": R, "ok": true|false, "error": "...",
"pages": P, "bytes": <KV bytes sent>, "transfer_us": T, ...}. A line that is
not a valid request gets a result with ok false and an error naming what is
wrong (and no room key when the room could not be read).

EOF on stdin shuts the rank down once every request has finished, or once
--drain-timeout has passed (the rooms still in flight then fail, on both
sides, naming it), and says so: a rank started with stdin closed exits at
once. Exit status: 0 when every
request succeeded, 1 when any failed (after all input was processed) or the
rank could not start.
` + serveHelp,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error { return runRole(engine.RolePrefill, &f) },
	}
	f.add(cmd, engine.RolePrefill)
	rootCmd.AddCommand(cmd)
}
