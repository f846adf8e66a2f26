package main

import (
	"github.com/spf13/cobra"

	"github.com/kvxfer/kvxfer/engine"
)

func init() {
	var f roleFlags
	cmd := &cobra.Command{
		Use:   "decode",
		Short: "run one decode rank: receive and verify KV for requests read from stdin or --serve (a unix socket or HTTP)",
		Long: `Run one decode rank (one process per TP rank). It allocates its KV pool and
metadata ring, opens the data transports and binds its ZMQ control socket.
Then it reads requests from stdin, one JSON object per line:
{"room": <bootstrap_room>, "tokens": <prompt length>, "bootstrap": "host:port"}
("room" 0 … 2^63-1 and "tokens" >= 1 are required; "bootstrap" defaults to
--bootstrap; an optional "hash_ids" list names the prompt's blocks for
--prefix-cache-blocks). For each it pre-allocates pages, resolves the producer ranks
through the bootstrap server, sends TRANSFER, waits for every producer's
Success with a verified metadata record and optionally verifies every byte
(--verify).

stdout: first {"event":"ready", "endpoint": ..., "transports": [...],
"ring": "gpu"|"host"} (no room key), then exactly one JSON result line per
non-blank input line, in completion order: {"line": N, "room": R, "ok":
true|false, "error": "...", "pages": P, "bytes": <KV bytes received>,
"transfer_us": T, ...}. A line that is not a valid request gets a result with
ok false and an error naming what is wrong (and no room key when the room
could not be read).

EOF on stdin shuts the rank down once every request has finished, or once
--drain-timeout has passed (the rooms still in flight then fail, on both
sides, naming it), and says so: a rank started with stdin closed exits at
once. Exit status: 0 when every
request succeeded, 1 when any failed (after all input was processed) or the
rank could not start.
` + serveHelp,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error { return runRole(engine.RoleDecode, &f) },
	}
	f.add(cmd, engine.RoleDecode)
	rootCmd.AddCommand(cmd)
}
