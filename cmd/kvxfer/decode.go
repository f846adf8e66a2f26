package main

import (
	"github.com/spf13/cobra"

	"github.com/kvxfer/kvxfer/engine"
)

func init() {
	var f roleFlags
	cmd := &cobra.Command{
		Use:   "decode",
		Short: "run one decode rank: receive and verify KV for requests read from stdin",
		Long: `Run one decode rank (one process per TP rank). It allocates its KV pool and
metadata ring, opens the data transports and binds its ZMQ control socket.
Then it reads requests from stdin, one JSON object per line:
{"room": <bootstrap_room>, "tokens": <prompt length>, "bootstrap": "host:port"}
("bootstrap" defaults to --bootstrap). For each it pre-allocates pages,
resolves the producer ranks through the bootstrap server, sends TRANSFER,
waits for every producer's Success with a verified metadata record, optionally
verifies every byte (--verify) and prints one JSON result line to stdout.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error { return runRole(engine.RoleDecode, &f) },
	}
	f.add(cmd, engine.RoleDecode)
	rootCmd.AddCommand(cmd)
}
