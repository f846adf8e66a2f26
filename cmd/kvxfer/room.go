package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/internal/debugsrv"
)

// roomView is what kvxfer room prints: each rank's timeline of the room
// and, for ranks that could not answer, why.
type roomView struct {
	Room      uint64                `json:"room"`
	Timelines []engine.RoomTimeline `json:"timelines"`
	// Missing lists the ranks (debug addresses) that do not have the room;
	// Errors the ranks that could not be asked.
	Missing []string          `json:"missing,omitempty"`
	Errors  map[string]string `json:"errors,omitempty"`
}

func init() {
	var decodes, prefills []string
	var jsonOut bool
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "room ROOM --decode HOST:PORT [--prefill HOST:PORT ...]",
		Short: "show one room's timeline on each rank: when each step of the evidence chain happened, and where and why it failed",
		Long: `Fetch the timeline of bootstrap_room ROOM from the debug servers of the ranks
(their --metrics-addr: GET /debug/rooms/ROOM) and print each rank's events in
order, then all of them merged by time. A rank keeps the timelines of its
active rooms and of its last --timeline-rooms finished ones (default 1024).

Timestamps are each host's own clock: across hosts, the merged order is only as
good as their clock sync. Exit status 1 when no rank has the room or a rank
could not be asked.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			room, err := strconv.ParseUint(args[0], 10, 64)
			if err != nil || room > 1<<63-1 {
				return fmt.Errorf("room %q: want a bootstrap_room, an integer 0 … 2^63-1", args[0])
			}
			if len(decodes)+len(prefills) == 0 {
				return errors.New("give at least one rank's debug address: --decode HOST:PORT and/or --prefill HOST:PORT (the rank's --metrics-addr)")
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			v := fetchRoom(ctx, room, append(slices.Clone(decodes), prefills...))
			if jsonOut {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				if err := enc.Encode(v); err != nil {
					return err
				}
			} else {
				printRoom(cmd.OutOrStdout(), v)
			}
			switch {
			case len(v.Errors) > 0:
				return fmt.Errorf("%d rank(s) could not be asked", len(v.Errors))
			case len(v.Timelines) == 0:
				return fmt.Errorf("no rank has room %d (it never ran there, or finished before the last rooms each rank keeps)", room)
			}
			return nil
		},
	}
	cmd.Flags().StringSliceVar(&decodes, "decode", nil, "debug address (--metrics-addr) of a decode rank; repeatable or comma-separated")
	cmd.Flags().StringSliceVar(&prefills, "prefill", nil, "debug address (--metrics-addr) of a prefill rank; repeatable or comma-separated")
	cmd.Flags().BoolVar(&jsonOut, "json", false, "print JSON")
	cmd.Flags().DurationVar(&timeout, "timeout", 5*time.Second, "bound of all the queries together")
	rootCmd.AddCommand(cmd)
}

func fetchRoom(ctx context.Context, room uint64, addrs []string) roomView {
	v := roomView{Room: room, Timelines: []engine.RoomTimeline{}}
	for _, a := range addrs {
		tl, ok, err := debugsrv.Fetch(ctx, a, room)
		switch {
		case err != nil:
			if v.Errors == nil {
				v.Errors = map[string]string{}
			}
			v.Errors[a] = err.Error()
		case !ok:
			v.Missing = append(v.Missing, a)
		default:
			v.Timelines = append(v.Timelines, tl)
		}
	}
	return v
}

func printRoom(w io.Writer, v roomView) {
	for _, tl := range v.Timelines {
		fmt.Fprintf(w, "%s %s (%s): %s", tl.Role, tl.Rank, strings.TrimPrefix(tl.Endpoint, "tcp://"), tl.State)
		if tl.State == engine.KVFailed.String() {
			fmt.Fprintf(w, " at %s (%s): %s", tl.Step, tl.Reason, tl.Error)
		} else if tl.Step != "" {
			fmt.Fprintf(w, ", in step %s", tl.Step)
		}
		fmt.Fprintln(w)
		for _, e := range tl.Events {
			fmt.Fprintf(w, "  %s  +%9.1f ms  %s\n", e.At.Format("15:04:05.000000"), float64(e.At.Sub(tl.Created).Microseconds())/1000, eventText(e))
		}
	}
	if len(v.Timelines) > 1 {
		type ev struct {
			who string
			e   engine.RoomEvent
		}
		var all []ev
		for _, tl := range v.Timelines {
			for _, e := range tl.Events {
				all = append(all, ev{tl.Role + " " + tl.Rank, e})
			}
		}
		slices.SortStableFunc(all, func(a, b ev) int { return a.e.At.Compare(b.e.At) })
		fmt.Fprintln(w, "merged (each host's clock):")
		for _, x := range all {
			fmt.Fprintf(w, "  %s  %-18s %s\n", x.e.At.Format("15:04:05.000000"), x.who, eventText(x.e))
		}
	}
	for _, a := range v.Missing {
		fmt.Fprintf(w, "%s: does not have room %d\n", a, v.Room)
	}
	for a, e := range v.Errors {
		fmt.Fprintf(w, "%s: %s\n", a, e)
	}
}

func eventText(e engine.RoomEvent) string {
	s := string(e.Step)
	switch {
	case e.Error != "":
		s += " FAILED: " + e.Error
	case e.Done:
		s += " done"
		if e.Detail != "" {
			s += " (" + e.Detail + ")"
		}
	default:
		s += ": " + e.Detail
	}
	if e.Peer != "" {
		s += " [peer " + e.Peer + "]"
	}
	return s
}
