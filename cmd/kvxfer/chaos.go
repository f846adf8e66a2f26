package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvxfer/kvxfer/bootstrap/server"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/engine/faulty"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/cluster"
	"github.com/kvxfer/kvxfer/workload"
)

// kvxfer chaos: the fencing soak. Rooms go from prefill processes (real
// `kvxfer prefill` children, each with its own bootstrap server) to a decode
// rank in this process, whose small KV pool makes every room reuse pages
// that earlier, possibly failed, rooms used. Faults are injected at random
// (chaosFaults). Nothing uses --verify or --checksum: the harness checks
// every successful room's bytes itself, at Success and again before its
// pages are reused, and compares both sides' outcomes.

// chaosFaults are the fault kinds a faulted room draws from (the delay
// fault is not drawn: every room of the last prefill process has it).
var chaosFaults = []string{"kill", "stall", "drop", "slow", "tokens", "abort", "ctlreset", "datareset", "bootstrap", "restart", "exit", "retry"}

// retrySalt turns a room into the test pattern of its first attempt under
// the retry fault (room ^ retrySalt is still a 63-bit room): the two
// attempts of one bootstrap_room carry different bytes.
const retrySalt = 1 << 62

type chaosFlags struct {
	rooms       int
	transports  string
	faults      string
	concurrency int
	prefills    int
	// prefillTP is the producer ranks per prefill instance (--prefill-tp).
	prefillTP int
	faultRate float64
	// layerwiseRate is the fraction of rooms sent layer by layer
	// (--layerwise-rate).
	layerwiseRate float64
	seed          uint64
	minTokens     int
	maxTokens     int
	poolMB        int
	waiting       time.Duration
	fence         time.Duration
	peer          time.Duration
	writeDelay    time.Duration
	model         string
	jsonOut       string
	childLog      string
	quiet         bool
	verbose       bool
}

func init() {
	var f chaosFlags
	cmd := &cobra.Command{
		Use:   "chaos",
		Short: "fencing soak: rooms under random prefill kill/stall, control drops, resets, bootstrap and decode restarts, same-room retries and more; counts outcome disagreements and silent corruptions (both must be 0)",
		Long: `Run the fencing soak. For each transport (--transports), --rooms rooms go
from --prefills prefill processes (kvxfer prefill children, each with its own
bootstrap server; the last one lands every write --write-delay late) to a decode
rank in this process whose KV pool (--pool-mb) holds only a few rooms, so pages
are reused all the time. A fraction --fault-rate of the rooms gets a fault
drawn from --faults, injected once the decode sent TRANSFER:

  kill    SIGKILL of the room's prefill process, which is then restarted
  stall   SIGSTOP of the room's prefill process for 0.2-0.8 s (the room may
          still succeed) or for longer than the waiting timeout (it fails),
          then SIGCONT
  drop    the decode's control messages dropped for 50-500 ms, or its next verdict
  slow    the decode takes 0.3-1.5 s before it decides the room
  tokens  the prefill is given another token count than the decode (same
          page count when there is one): both sides must fail the room
  abort   the decode aborts the room while the prefill writes
  ctlreset  ss -K of the control connections between the decode and the
          room's prefill process (both directions; needs root)
  datareset ss -K of the decode's established tcp data connections (tcp
          only; needs root)
  bootstrap the room's bootstrap server stopped and started again on its
          port 0.2-1 s later
  restart the decode restarts while the room is in flight: its manager is
          closed (every room in flight on it fails) and a new incarnation
          starts, half the time on the same control port and transport
          (same address), else on new ones; later rooms go to it. The KV
          pool is the same memory, so a write of the old incarnation's
          attempts that landed after its close would show in the new one's
          rooms.
  exit    the decode closes (and restarts, as above) right after the room's
          Success, while its verdict may still be on the way: the prefill
          must report the room ok
          (a restart or exit waits while a message the drop fault dropped
          in the last 1.5 s may still be asked for again: a verdict lost
          and then its decode gone is a disagreement no protocol prevents)
  retry   the decode aborts the room's first attempt while the prefill
          writes, then, once both sides concluded it, the same
          bootstrap_room is sent again to the same prefill process into the
          same pages (as a router retrying a request); the first attempt
          carries another room's test pattern, so its bytes in the retry's
          pages show
  (delay: the rooms of the write-delayed prefill process)

With --layerwise-rate F, a fraction F of the rooms is sent layer by layer
(the prefill request key "layerwise", a modeled forward pass of
chaosLayerUS per layer over the whole prompt, chunk by chunk): the fault of
such a room is injected at a random point of that pass, between layers.
A layer-wise room makes one write batch per layer of each chunk (up to 256
for llama-3.1-8b at --max-tokens 512), each landing --write-delay late on
the write-delayed instance: there its layer-wise rooms time out at the
default 100ms (a straggler the decode fences) and succeed only with a
--write-delay of a few ms.

With --prefill-tp N (N > 1), each prefill instance is N kvxfer prefill
processes (--tp-size N, --tp-rank 0…N-1) registered in its bootstrap
server, and every room has N producers, each writing its KV heads of every
token into the TP-1 decode's pages (the hetero-TP strided write). A kill,
stall or ctlreset hits one of them (drawn per room), the tokens fault gives
that one alone the other count, and the write-delayed instance's last rank
is its straggler; the decode must fail or succeed the room and every
producer's result line must say the same.

A kill or stall hits every room in flight on that process, not only the one
that drew it. No rank uses --verify or --checksum. The harness reads every
successful room's bytes itself (at Success, and again just before the pages
go back to the pool) and compares the decode's outcome with the prefill
process's result line. It prints, per transport: rooms, faults injected,
outcome disagreements (one side ok, the other failed), silent corruptions (ok
with bytes that are not the room's), lost result lines (a prefill process
alive at the end that never answered a room), the longest time from a fault
to Failed on each side (for a stalled prefill, from its SIGCONT), and per
fault kind the time to heal: from the fault to the next room that succeeded
on that prefill process, and how many retries with the same room
succeeded. Exit status 1
when a disagreement, a corruption or a lost line was seen.`,
		Example: `  kvxfer chaos --rooms 1000                      # tcp and shm, 1,000 rooms each (several minutes)
  kvxfer chaos --rooms 200 --transports shm --faults kill,stall --seed 7`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if !cmd.Flags().Changed("log-level") && os.Getenv("KVXFER_LOG_LEVEL") == "" {
				// Faults make the engine log by design (peers lost, data
				// paths fenced): keep this process's log to errors.
				slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})))
			}
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			reps, err := runChaos(ctx, &f, os.Stdout)
			if err != nil {
				return err
			}
			for _, r := range reps {
				if r.Disagreements > 0 || r.Corruptions > 0 || r.LostLines > 0 {
					return fmt.Errorf("chaos over %s: %d outcome disagreements, %d silent corruptions, %d lost result lines (want 0, 0 and 0)", r.Transport, r.Disagreements, r.Corruptions, r.LostLines)
				}
			}
			return nil
		},
	}
	fs := cmd.Flags()
	fs.IntVar(&f.rooms, "rooms", 1000, "rooms per transport")
	fs.StringVar(&f.transports, "transports", "tcp,shm", "comma list of transports, one soak each")
	fs.StringVar(&f.faults, "faults", strings.Join(chaosFaults, ","), "comma list of the fault kinds a faulted room draws from")
	fs.IntVar(&f.concurrency, "concurrency", 8, "rooms in flight at once")
	fs.IntVar(&f.prefills, "prefills", 3, "prefill instances (>= 2; the last lands every write --write-delay late)")
	fs.IntVar(&f.prefillTP, "prefill-tp", 1, "prefill TP size: producer processes per prefill instance, each writing its KV heads of every token to the TP-1 decode (a fault hits one of them)")
	fs.Float64Var(&f.faultRate, "fault-rate", 0.3, "fraction of rooms that get a fault (0..1)")
	fs.Float64Var(&f.layerwiseRate, "layerwise-rate", 0, "fraction of rooms the prefill sends layer by layer (request key \"layerwise\", a modeled forward pass of 2 ms per layer; faults land mid-layers) instead of whole (0..1)")
	fs.Uint64Var(&f.seed, "seed", 0, "random seed: which rooms get which fault, their sizes and fault timings (0 = random; printed)")
	fs.IntVar(&f.minTokens, "min-tokens", 16, "smallest room, tokens")
	fs.IntVar(&f.maxTokens, "max-tokens", 512, "largest room, tokens")
	fs.IntVar(&f.poolMB, "pool-mb", 192, "the decode's KV pool, MiB (small: pages are reused all the time)")
	fs.DurationVar(&f.waiting, "waiting-timeout", 2*time.Second, "waiting timeout of both sides")
	fs.DurationVar(&f.fence, "fence-timeout", time.Second, "the decode's fence timeout")
	fs.DurationVar(&f.peer, "peer-timeout", 3*time.Second, "peer timeout of both sides")
	fs.DurationVar(&f.writeDelay, "write-delay", 100*time.Millisecond, "how late the last prefill process lands each write (the delay fault)")
	fs.StringVar(&f.model, "model", "llama-3.1-8b", "model whose KV layout the rooms use (a name kvxfer knows or a config.json path)")
	fs.StringVar(&f.jsonOut, "json", "", "write the per-transport reports as JSON to this file")
	fs.StringVar(&f.childLog, "child-log-level", "error", "log level of the prefill processes")
	fs.BoolVar(&f.quiet, "quiet", false, "no progress lines")
	fs.BoolVar(&f.verbose, "verbose", false, "print the decode's first error of each failure class")
	rootCmd.AddCommand(cmd)
}

// chaosReport is one transport's soak result.
type chaosReport struct {
	Transport string `json:"transport"`
	Seed      uint64 `json:"seed"`
	Rooms     int    `json:"rooms"`
	// PrefillTP is the producer ranks per room (--prefill-tp): the
	// Prefill* counts below count result lines, PrefillTP per room.
	PrefillTP int `json:"prefill_tp"`
	// Faults counts the faults injected, by kind (delay: rooms of the
	// write-delayed prefill; stall (short)/stall (long): by duration).
	Faults map[string]int `json:"faults"`
	// DecodeOK/DecodeFailed are the decode's outcomes; PrefillOK,
	// PrefillFailed and PrefillUnknown the prefill processes' (unknown: the
	// process was killed before it answered).
	DecodeOK     int `json:"decode_ok"`
	DecodeFailed int `json:"decode_failed"`
	// DecodeFailures counts the decode's failed rooms by failure class
	// (engine.FailureReason: timeout, peer_lost, aborted, ...).
	DecodeFailures map[string]int `json:"decode_failures"`
	// FailureExamples holds the first decode error of each failure class.
	FailureExamples map[string]string `json:"failure_examples,omitempty"`
	PrefillOK       int               `json:"prefill_ok"`
	PrefillFailed   int               `json:"prefill_failed"`
	PrefillUnknown  int               `json:"prefill_unknown"`
	// Disagreements: rooms one side reported ok and the other failed.
	Disagreements int `json:"outcome_disagreements"`
	// DisagreementsAtClose counts those of Disagreements where the decode
	// reported Success and its manager was closed (a restart or exit
	// fault) within chaosCloseWindow after, and the prefill failed the
	// room: a Success verdict lost across the decode's close (issue 22
	// case 1, open).
	DisagreementsAtClose int `json:"outcome_disagreements_at_decode_close"`
	// Corruptions: rooms the decode reported ok whose bytes (checked by the
	// harness at Success and again before reuse) were not the producer's.
	Corruptions int `json:"silent_corruptions"`
	// MaxDecodeFaultToFailedMS and MaxPrefillFaultToFailedMS are, per side,
	// the longest time from an injected fault to that side's Failed for the
	// room that drew it (for a stalled prefill: from its SIGCONT), ms.
	MaxDecodeFaultToFailedMS  float64 `json:"max_fault_to_failed_decode_ms"`
	MaxPrefillFaultToFailedMS float64 `json:"max_fault_to_failed_prefill_ms"`
	// LostLines counts rooms whose prefill process stayed up (it was not
	// killed while the room ran) yet wrote no result line for it.
	LostLines int `json:"lost_lines"`
	// Retries counts the rooms of the retry fault (a first attempt aborted
	// mid-write, then the same bootstrap_room again on the same prefill
	// process and pages) and RetryOK those whose retry succeeded on the
	// decode. Both attempts are checked like any room: their disagreements,
	// corruptions and lost lines count in the totals above.
	// RetryFirstFailed of them had a first attempt that failed on the
	// decode (the abort came before its Success).
	Retries          int `json:"retries"`
	RetryOK          int `json:"retry_ok"`
	RetryFirstFailed int `json:"retry_first_failed"`
	// Layerwise counts the rooms sent layer by layer (--layerwise-rate),
	// LayerwiseOK those that succeeded on the decode and LayerwiseSent the
	// prefill result lines that say ok and layer-wise (the prefill honoured
	// the request key). LayerwiseFaulted counts those with a fault.
	Layerwise        int `json:"layerwise_rooms,omitempty"`
	LayerwiseOK      int `json:"layerwise_decode_ok,omitempty"`
	LayerwiseSent    int `json:"layerwise_prefill_ok,omitempty"`
	LayerwiseFaulted int `json:"layerwise_faulted,omitempty"`
	// Heal is, per fault kind, the time from each fault to the next room
	// that succeeded on the same prefill process (ms): how many, median,
	// max, and how many never healed before the soak ended.
	Heal        map[string]chaosHeal `json:"heal_ms,omitempty"`
	WallSeconds float64              `json:"wall_seconds"`
	Examples    []string             `json:"examples,omitempty"` // first disagreements / corruptions
}

// chaosHeal is one fault kind's time to heal (chaosReport.Heal).
type chaosHeal struct {
	N        int     `json:"n"`
	MedianMS float64 `json:"median_ms"`
	MaxMS    float64 `json:"max_ms"`
	Unhealed int     `json:"unhealed"`
}

// String words the times to heal: median and max of the faults that healed,
// and "never healed (n)" for those that did not before the soak ended (no
// median for them: there is no time to take one of).
func (h chaosHeal) String() string {
	healed := h.N - h.Unhealed
	n := fmt.Sprintf("%d fault", h.N)
	if h.N != 1 {
		n += "s"
	}
	switch {
	case h.Unhealed == 0:
		return fmt.Sprintf("%s, median %.0f ms, max %.0f ms", n, h.MedianMS, h.MaxMS)
	case healed == 0:
		return fmt.Sprintf("%s, never healed (%d) before the end", n, h.Unhealed)
	}
	return fmt.Sprintf("%s: %d healed, median %.0f ms, max %.0f ms; never healed (%d) before the end", n, healed, h.MedianMS, h.MaxMS, h.Unhealed)
}

// chaosPrefill is one prefill instance slot: its bootstrap server address
// and its producer ranks (--prefill-tp processes, tp 0…, registered in that
// server as one instance's TP ranks), each with its current child
// (replaced after a kill).
type chaosPrefill struct {
	idx   int
	addr  string
	exe   string
	mu    sync.Mutex // held while a kill or stall is injected (and the restart after a kill)
	ranks []*chaosRank
	delay bool
	// restartBootstrap stops its bootstrap server and starts it again on
	// the same port (the bootstrap fault).
	restartBootstrap func(down time.Duration) error
}

// chaosRank is one producer rank of a prefill slot: one `kvxfer prefill`
// process with --tp-rank tp.
type chaosRank struct {
	tp   int
	args []string
	cur  atomic.Pointer[child]
	// ctlPort is the current child's control port (its ready line).
	ctlPort atomic.Pointer[string]
}

// name names rank k of the slot in logs and errors ("prefill 1", or
// "prefill 1 tp 0" with --prefill-tp above 1).
func (p *chaosPrefill) name(k int) string {
	if len(p.ranks) == 1 {
		return fmt.Sprintf("prefill %d", p.idx)
	}
	return fmt.Sprintf("prefill %d tp %d", p.idx, k)
}

// start starts every rank of the slot.
func (p *chaosPrefill) start() error {
	for k := range p.ranks {
		if err := p.startRank(k); err != nil {
			return err
		}
	}
	return nil
}

// startRank starts rank k's process and waits for its ready line.
func (p *chaosPrefill) startRank(k int) error {
	rk := p.ranks[k]
	c, err := startChild(p.exe, p.name(k), rk.args, nil)
	if err != nil {
		return err
	}
	select {
	case rl := <-c.ready:
		if u, err := url.Parse(rl.Endpoint); err == nil {
			port := u.Port()
			rk.ctlPort.Store(&port)
		}
	case <-c.exit():
		return fmt.Errorf("%s exited before it was ready: %v", p.name(k), c.proc.Err())
	case <-time.After(2 * time.Minute):
		c.proc.Stop(time.Second)
		return fmt.Errorf("%s not ready within 2 minutes", p.name(k))
	}
	rk.cur.Store(c)
	return nil
}

// live returns the current children of every rank (in tp order) when all
// of them are running, else nil: a room needs every producer.
func (p *chaosPrefill) live() []*child {
	var cs []*child
	for _, rk := range p.ranks {
		c := rk.cur.Load()
		if c == nil {
			return nil
		}
		select {
		case <-c.exit():
			return nil
		default:
			cs = append(cs, c)
		}
	}
	return cs
}

func validateChaosFlags(f *chaosFlags) error {
	switch {
	case f.rooms < 1:
		return fmt.Errorf("--rooms %d: must be >= 1", f.rooms)
	case f.concurrency < 1:
		return fmt.Errorf("--concurrency %d: must be >= 1", f.concurrency)
	case f.prefills < 2:
		return fmt.Errorf("--prefills %d: must be >= 2 (one of them is the write-delayed one)", f.prefills)
	case f.prefillTP < 1:
		return fmt.Errorf("--prefill-tp %d: must be >= 1 (the producer processes of each prefill instance)", f.prefillTP)
	case f.faultRate < 0 || f.faultRate > 1:
		return fmt.Errorf("--fault-rate %g: must be in [0, 1]", f.faultRate)
	case f.layerwiseRate < 0 || f.layerwiseRate > 1:
		return fmt.Errorf("--layerwise-rate %g: must be in [0, 1]", f.layerwiseRate)
	case f.minTokens < 1 || f.maxTokens < f.minTokens:
		return fmt.Errorf("--min-tokens %d / --max-tokens %d: want 1 <= min <= max", f.minTokens, f.maxTokens)
	case f.waiting <= 0 || f.fence <= 0 || f.peer <= 0:
		return fmt.Errorf("--waiting-timeout %s, --fence-timeout %s and --peer-timeout %s must all be > 0", f.waiting, f.fence, f.peer)
	case f.writeDelay < 0:
		return fmt.Errorf("--write-delay %s: must be >= 0", f.writeDelay)
	case f.poolMB < 1:
		return fmt.Errorf("--pool-mb %d: must be >= 1", f.poolMB)
	}
	if _, err := parseChaosFaults(f.faults); err != nil {
		return err
	}
	names, err := checkTransportNames("--transports", f.transports)
	if err != nil {
		return err
	}
	for _, t := range names {
		if err := transport.ProbeTransport(t); err != nil {
			return fmt.Errorf("--transports %q: %s: %w", f.transports, t, err)
		}
	}
	return checkOutputFile("--json", f.jsonOut)
}

// parseChaosFaults parses --faults: a comma list of chaosFaults kinds.
func parseChaosFaults(s string) ([]string, error) {
	var out []string
	for _, k := range strings.Split(s, ",") {
		k = strings.TrimSpace(k)
		if k == "" {
			continue
		}
		if !slices.Contains(chaosFaults, k) {
			return nil, fmt.Errorf("--faults %q: unknown fault %q (want some of %s)", s, k, strings.Join(chaosFaults, ","))
		}
		if !slices.Contains(out, k) {
			out = append(out, k)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("--faults %q: names no fault (want some of %s; --fault-rate 0 for none)", s, strings.Join(chaosFaults, ","))
	}
	return out, nil
}

// runChaos runs the soak over every transport and returns the reports (also
// printed on w).
func runChaos(ctx context.Context, f *chaosFlags, w io.Writer) ([]chaosReport, error) {
	if err := validateChaosFlags(f); err != nil {
		return nil, err
	}
	seed := f.seed
	if seed == 0 {
		seed = rand.Uint64() >> 1
	}
	var reps []chaosReport
	for i, t := range strings.Split(f.transports, ",") {
		rep, err := chaosOne(ctx, f, strings.TrimSpace(t), seed+uint64(i), w)
		if err != nil {
			return reps, err
		}
		reps = append(reps, rep)
		printChaos(w, rep, f.verbose)
	}
	if f.jsonOut != "" {
		b, _ := json.MarshalIndent(reps, "", "  ")
		if err := os.WriteFile(f.jsonOut, append(b, '\n'), 0o644); err != nil {
			return reps, fmt.Errorf("--json %s: %w", f.jsonOut, err)
		}
	}
	return reps, nil
}

func printChaos(w io.Writer, r chaosReport, verbose bool) {
	total := 0
	for _, n := range r.Faults {
		total += n
	}
	fmt.Fprintf(w, "chaos over %s (seed %d): %d rooms in %.0f s; faults injected: %d (%s)\n", r.Transport, r.Seed, r.Rooms, r.WallSeconds, total, countList(r.Faults))
	lines := ""
	if r.PrefillTP > 1 {
		lines = fmt.Sprintf(" result lines (prefill TP %d → decode TP 1: %d per room)", r.PrefillTP, r.PrefillTP)
	}
	fmt.Fprintf(w, "  decode: %d ok, %d failed (%s); prefill%s: %d ok, %d failed, %d unknown (process killed)\n", r.DecodeOK, r.DecodeFailed, countList(r.DecodeFailures), lines, r.PrefillOK, r.PrefillFailed, r.PrefillUnknown)
	fmt.Fprintf(w, "  outcome disagreements: %d; silent corruptions: %d; lost result lines: %d\n", r.Disagreements, r.Corruptions, r.LostLines)
	if r.DisagreementsAtClose > 0 {
		fmt.Fprintf(w, "  of the disagreements, %d: decode Success, its manager closed within %s after (restart/exit), prefill failed (a verdict lost across the close)\n", r.DisagreementsAtClose, chaosCloseWindow)
	}
	fmt.Fprintf(w, "  max fault→Failed: decode %.0f ms, prefill %.0f ms (a stalled prefill: from its SIGCONT)\n", r.MaxDecodeFaultToFailedMS, r.MaxPrefillFaultToFailedMS)
	if r.Layerwise > 0 {
		fmt.Fprintf(w, "  layer-wise rooms: %d (%d with a fault), %d ok on the decode, %d prefill lines ok and layer-wise\n", r.Layerwise, r.LayerwiseFaulted, r.LayerwiseOK, r.LayerwiseSent)
	}
	if r.Retries > 0 {
		fmt.Fprintf(w, "  retries with the same room: %d (first attempt failed on the decode: %d), %d retries succeeded on the decode\n", r.Retries, r.RetryFirstFailed, r.RetryOK)
	}
	for _, k := range slices.Sorted(maps.Keys(r.Heal)) {
		h := r.Heal[k]
		fmt.Fprintf(w, "  heal after %s (fault → next ok room on that prefill): %s\n", k, h)
	}
	if verbose {
		for _, k := range slices.Sorted(maps.Keys(r.FailureExamples)) {
			fmt.Fprintf(w, "  first %s failure: %s\n", k, r.FailureExamples[k])
		}
	}
	for _, e := range r.Examples {
		fmt.Fprintf(w, "  ! %s\n", e)
	}
}

// countList formats counts as "a 3, b 1" in key order.
func countList(m map[string]int) string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(out, ", ")
}

// chaosRoom is one room's plan and record.
type chaosRoom struct {
	room      uint64
	pattern   uint64 // whose test pattern its bytes must be (room, or room ^ retrySalt: a first attempt)
	tokens    int
	preTokens int  // the prefill's token count (differs for the tokens fault)
	layerwise bool // sent layer by layer (--layerwise-rate)
	// target is the producer rank (tp) the fault hits with --prefill-tp
	// above 1 (a kill, stall or ctlreset of that process, the tokens
	// fault's other count on that rank only).
	target    int
	rng       *rand.Rand
	prefill   int
	fault     string
	faultAt   time.Time // when it was injected
	resumeAt  time.Time // stall: SIGCONT
	decodeOK  bool
	decodeErr string
	reason    string // engine.FailureReason of the decode's failure
	decodeAt  time.Time
	pre       *replyLine // tp 0's result line; nil: unknown
	preAt     time.Time
	corrupt   string
	lost      bool // its prefill process, alive, never wrote its result line
	// others are the result lines of the room's other producer ranks (tp
	// 1…, --prefill-tp), as pre, preAt and lost are tp 0's.
	others []chaosRankLine
	// closedAfterOK: the decode succeeded and its manager was closed
	// within chaosCloseWindow after (DisagreementsAtClose), closeAfter
	// after its Success.
	closedAfterOK bool
	closeAfter    time.Duration
	// first is the first attempt of a room retried with the same
	// bootstrap_room (the retry fault); the record itself is the retry.
	first *chaosRoom
}

// chaosRankLine is one producer rank's result line for a room.
type chaosRankLine struct {
	pre   *replyLine // nil: unknown (the process was killed before it answered)
	preAt time.Time
	lost  bool // the process, alive, never wrote it
}

// lines returns the room's result lines of every producer rank, tp order.
func (r *chaosRoom) lines() []chaosRankLine {
	return append([]chaosRankLine{{r.pre, r.preAt, r.lost}}, r.others...)
}

// chaosEnv is one transport's soak: the prefill processes and the decode.
type chaosEnv struct {
	f    *chaosFlags
	pres []*chaosPrefill
	// The decode rank: its manager and transport, replaced by a decode
	// restart (restartDecode) under mgrMu; rooms take the current manager
	// (decode) before they open a receiver, so a room started during a
	// restart goes to the new incarnation.
	mgrMu sync.RWMutex
	m     *engine.Manager
	tr    transport.Transport
	// dataPorts are this process's data listening ports (datareset).
	dataPorts []string
	// restartMu: one decode restart at a time; newDecode starts a decode
	// manager on tr and control port (0: a free one), openTransport a
	// transport for a restart on a new address.
	restartMu     sync.Mutex
	newDecode     func(tr transport.Transport, port int) (*engine.Manager, error)
	openTransport func() (transport.Transport, error)
	bootPorts     []string
	// fatal is a decode restart that could not start the new incarnation:
	// the soak stops with it.
	fatal atomic.Pointer[error]
	// quiet keeps drop faults out while a decode restart waits for the
	// control messages dropped last to be asked for again (restartDecode);
	// lastDrop is when the drop fault last dropped a message (Unix ns).
	quiet    sync.RWMutex
	lastDrop atomic.Int64
	// closes are when each decode restart closed the old manager.
	closes []time.Time

	pool *workload.KVBuffers
	rows *workload.PageAllocator
	// passTime is a layer-wise room's modeled forward pass (chaosLayerUS
	// per layer of the model).
	passTime time.Duration
	drop     *faulty.ControlDropper
	slow     sync.Map // room → time.Duration the decode takes to decide it
	faults   []string

	faultMu sync.Mutex
	counts  map[string]int
	// okAt are, per prefill process, when its rooms succeeded (decode
	// side); injected are the faults with their process and time (heal).
	okAt     map[int][]time.Time
	injected []chaosFaultAt
}

// decode returns the decode rank's current manager (it waits while a
// restart is replacing it).
func (e *chaosEnv) decode() *engine.Manager {
	e.mgrMu.RLock()
	defer e.mgrMu.RUnlock()
	return e.m
}

// ports returns the current decode's data listening ports (datareset).
func (e *chaosEnv) ports() []string {
	e.mgrMu.RLock()
	defer e.mgrMu.RUnlock()
	return e.dataPorts
}

// chaosCloseWindow: a room whose decode closed this soon after its
// Success counts, when the prefill then failed it, in
// chaosReport.DisagreementsAtClose.
const chaosCloseWindow = 2 * time.Second

// markClosedAfterOK sets closedAfterOK on the successful attempts whose
// decode manager closed within chaosCloseWindow after their Success.
func (e *chaosEnv) markClosedAfterOK(records []*chaosRoom) {
	e.faultMu.Lock()
	defer e.faultMu.Unlock()
	for _, r := range records {
		for a := r; a != nil; a = a.first {
			if !a.decodeOK {
				continue
			}
			for _, c := range e.closes {
				if d := c.Sub(a.decodeAt); d >= 0 && d <= chaosCloseWindow && !a.closedAfterOK {
					a.closedAfterOK, a.closeAfter = true, d
				}
			}
		}
	}
}

// chaosVerdictSettle is how long after a dropped control message a decode
// restart waits: the prefill's verdict re-ask interval (engine verdictAsk,
// 1 s) and a margin.
const chaosVerdictSettle = 1500 * time.Millisecond

// restartDecode restarts the decode rank for fault kind ("restart",
// "exit"): it closes the manager (every room in flight on it fails; the
// verdicts it decided before go out first, Manager.Close) and starts a new
// incarnation (a new instance id) on the same pool, either on the same
// control port and transport or, drawn from rng, on a new port and a new
// transport (the old one closed once the old manager is). It returns the
// fault as counted, "KIND (same address)" or "KIND (new address)", and
// injected false with the reason when it did not restart (another restart
// in progress). A new incarnation that cannot start stops the soak
// (e.fatal).
func (e *chaosEnv) restartDecode(kind string, rng *rand.Rand) (counted string, injected bool) {
	if !e.restartMu.TryLock() {
		return kind + " (skipped: another decode restart in progress)", false
	}
	defer e.restartMu.Unlock()
	// A verdict the drop fault ate is asked for again by its prefill
	// (every second) and answered from the decode's memory of the room;
	// a restart before that would lose it for good, a disagreement no
	// protocol can prevent (README: a verdict over a path that is down)
	// and not what this fault tests. So no drop starts now, and the
	// restart waits until the last dropped message is that old (at most
	// 10 s, for a DropNext no message came to satisfy).
	e.quiet.Lock()
	defer e.quiet.Unlock()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if e.drop.Pending("") == 0 && time.Since(time.Unix(0, e.lastDrop.Load())) > chaosVerdictSettle {
			break
		}
	}
	same := rng.IntN(2) == 0
	e.mgrMu.Lock()
	defer e.mgrMu.Unlock()
	old, oldTr := e.m, e.tr
	port := old.ControlPort()
	e.faultMu.Lock()
	e.closes = append(e.closes, time.Now())
	e.faultMu.Unlock()
	_ = old.Close()
	tr := oldTr
	counted = kind + " (same address)"
	if !same {
		counted, port = kind+" (new address)", 0
		t, err := e.openTransport()
		if err != nil {
			err = fmt.Errorf("decode restart: open the new incarnation's transport: %w", err)
			e.fatal.Store(&err)
			return counted, true
		}
		tr = t
	}
	var m *engine.Manager
	var err error
	// The old incarnation's control port is free once its manager closed;
	// a bind that still fails (another process took it) is retried a while.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if m, err = e.newDecode(tr, port); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		err = fmt.Errorf("decode restart (%s): start the new incarnation: %w", counted, err)
		e.fatal.Store(&err)
		if tr != oldTr {
			_ = tr.Close()
		}
		return counted, true
	}
	if tr != oldTr {
		_ = oldTr.Close()
	}
	e.m, e.tr = m, tr
	if e.dataPorts != nil {
		e.dataPorts = ownDataPorts(strconv.Itoa(m.ControlPort()), e.bootPorts)
	}
	return counted, true
}

// chaosFaultAt is one injected fault, for the time to heal.
type chaosFaultAt struct {
	kind    string
	prefill int
	at      time.Time
}

func (e *chaosEnv) countFault(k string) {
	e.faultMu.Lock()
	e.counts[k]++
	e.faultMu.Unlock()
}

// noteFault records fault kind k on prefill process p at (the time to heal
// counts from it).
func (e *chaosEnv) noteFault(k string, p int, at time.Time) {
	e.faultMu.Lock()
	e.injected = append(e.injected, chaosFaultAt{k, p, at})
	e.faultMu.Unlock()
}

// noteOK records a room that succeeded on prefill process p at.
func (e *chaosEnv) noteOK(p int, at time.Time) {
	e.faultMu.Lock()
	e.okAt[p] = append(e.okAt[p], at)
	e.faultMu.Unlock()
}

// heal computes chaosReport.Heal.
func (e *chaosEnv) heal() map[string]chaosHeal {
	e.faultMu.Lock()
	defer e.faultMu.Unlock()
	byKind := map[string][]float64{}
	unhealed := map[string]int{}
	for _, ts := range e.okAt {
		slices.SortFunc(ts, func(a, b time.Time) int { return a.Compare(b) })
	}
	for _, f := range e.injected {
		ts := e.okAt[f.prefill]
		i, _ := slices.BinarySearchFunc(ts, f.at, func(a, b time.Time) int { return a.Compare(b) })
		if i == len(ts) {
			unhealed[f.kind]++
			byKind[f.kind] = append(byKind[f.kind], -1)
			continue
		}
		byKind[f.kind] = append(byKind[f.kind], float64(ts[i].Sub(f.at).Microseconds())/1000)
	}
	out := map[string]chaosHeal{}
	for k, ds := range byKind {
		ds = slices.DeleteFunc(ds, func(d float64) bool { return d < 0 })
		h := chaosHeal{N: len(ds) + unhealed[k], Unhealed: unhealed[k]}
		if len(ds) > 0 {
			slices.Sort(ds)
			h.MedianMS, h.MaxMS = ds[len(ds)/2], ds[len(ds)-1]
		}
		out[k] = h
	}
	return out
}

// planRoom draws room i's size, fault and fault timings from its own
// generator (seed, i), so a seed names the same plan whatever the timing.
func (e *chaosEnv) planRoom(seed uint64, i int) *chaosRoom {
	rng := rand.New(rand.NewPCG(seed, uint64(i)))
	f := e.f
	rec := &chaosRoom{room: (seed<<20 ^ uint64(i)*0x9E3779B97F4A7C15) & (1<<63 - 1), rng: rng}
	rec.pattern = rec.room
	rec.tokens = f.minTokens + rng.IntN(f.maxTokens-f.minTokens+1)
	rec.preTokens = rec.tokens
	if rng.Float64() < f.faultRate {
		rec.fault = e.faults[rng.IntN(len(e.faults))]
	}
	if rec.fault == "tokens" {
		rec.preTokens = otherTokenCount(rec.tokens, 16)
	}
	if f.layerwiseRate > 0 {
		// A generator of its own: the plan's other draws stay what they
		// are without the flag.
		rec.layerwise = rand.New(rand.NewPCG(seed^layerwiseSalt, uint64(i))).Float64() < f.layerwiseRate
	}
	if f.prefillTP > 1 {
		rec.target = rand.New(rand.NewPCG(seed^targetSalt, uint64(i))).IntN(f.prefillTP)
	}
	return rec
}

// layerwiseSalt keys the generator that draws which rooms go layer by
// layer (planRoom).
const layerwiseSalt = 0x6c61796572776973

// targetSalt keys the generator that draws which producer rank a room's
// fault hits (planRoom, --prefill-tp).
const targetSalt = 0x7461726765747470

// chaosLayerUS is the modeled compute time of one layer over a layer-wise
// room's whole prompt, µs (the request's layer_compute_us): the forward
// pass of llama-3.1-8b's 32 layers takes 64 ms, long enough for a fault to
// land between layers.
const chaosLayerUS = 2000

// otherTokenCount returns a token count other than t that fills the same
// number of pages of pageSize tokens when one exists (the mismatch nothing
// but the token count catches), else t+1.
func otherTokenCount(t, pageSize int) int {
	pages := (t + pageSize - 1) / pageSize
	if last := pages * pageSize; last != t {
		return last
	}
	if t-1 > (pages-1)*pageSize {
		return t - 1
	}
	return t + 1
}

func chaosOne(ctx context.Context, f *chaosFlags, transportName string, seed uint64, w io.Writer) (chaosReport, error) {
	rep := chaosReport{Transport: transportName, Seed: seed, PrefillTP: f.prefillTP}
	start := time.Now()
	faults, err := parseChaosFaults(f.faults)
	if err != nil {
		return rep, err
	}
	if transportName != "tcp" { // no data connection to reset
		faults = slices.DeleteFunc(slices.Clone(faults), func(k string) bool { return k == "datareset" })
		if len(faults) == 0 {
			faults = []string{"ctlreset"}
		}
	}
	env := &chaosEnv{f: f, drop: faulty.DropControl(), faults: faults, counts: map[string]int{}, okAt: map[int][]time.Time{}}
	env.openTransport = func() (transport.Transport, error) {
		return openEnvTransport(transportName)
	}
	model, err := workload.LookupModel(f.model)
	if err != nil {
		return rep, err
	}
	exe, err := os.Executable()
	if err != nil {
		exe = os.Args[0]
	}
	// One bootstrap server per prefill process (its own instance); the
	// servers stop after the processes (deferred first, run last).
	var servers []func()
	defer func() {
		for _, stop := range servers {
			stop()
		}
	}()
	defer func() {
		var wg sync.WaitGroup
		for _, p := range env.pres {
			wg.Add(1)
			go func() {
				defer wg.Done()
				p.mu.Lock() // a stall or a restart in progress ends first
				defer p.mu.Unlock()
				for _, rk := range p.ranks {
					if c := rk.cur.Load(); c != nil {
						_ = c.proc.Signal(syscall.SIGCONT)
						c.proc.Stop(5 * time.Second)
					}
				}
			}()
		}
		wg.Wait()
	}()
	dl, err := workload.NewLayout(model, workload.LayoutOptions{PageSize: 16, TPSize: 1, PPSize: 1, NumPages: 1})
	if err != nil {
		return rep, err
	}
	if f.prefillTP > 1 {
		if _, err := workload.NewLayout(model, workload.LayoutOptions{PageSize: 16, TPSize: f.prefillTP, PPSize: 1, NumPages: 1}); err != nil {
			return rep, fmt.Errorf("--prefill-tp %d with --model %s: %w", f.prefillTP, f.model, err)
		}
	}
	pageBytes := dl.ItemLen() * uint64(dl.NumBuffers())
	env.passTime = time.Duration(dl.Layers()*chaosLayerUS) * time.Microsecond
	maxPages := (f.maxTokens + 1 + 15) / 16 // the tokens fault may ask for one more token
	// A prefill process may hold every room in flight at once.
	preMB := max(64, int(uint64(f.concurrency*maxPages)*pageBytes*5/4>>20)+1)
	var bootPorts []string
	for i := 0; i < f.prefills; i++ {
		bs := &chaosBootstrap{}
		if err := bs.start(0); err != nil {
			return rep, fmt.Errorf("bootstrap server %d: %w", i, err)
		}
		servers = append(servers, bs.stop)
		_, port, _ := net.SplitHostPort(bs.addr)
		bootPorts = append(bootPorts, port)
		p := &chaosPrefill{idx: i, addr: bs.addr, exe: exe, delay: i == f.prefills-1, restartBootstrap: bs.restart}
		for tp := 0; tp < f.prefillTP; tp++ {
			rk := &chaosRank{tp: tp}
			rk.args = []string{"prefill", "--log-level", f.childLog, "--model", f.model, "--pool-mb", strconv.Itoa(preMB), "--transport", transportName,
				"--bootstrap", p.addr, "--host", "127.0.0.1", "--bootstrap-timeout", (3 * f.waiting).String(), "--waiting-timeout", f.waiting.String(),
				"--peer-timeout", f.peer.String(), "--chunk-pages", "4", "--aux-rows", strconv.Itoa(4 * f.concurrency),
				"--tp-size", strconv.Itoa(f.prefillTP), "--tp-rank", strconv.Itoa(tp)}
			// The write-delayed instance's last rank is the straggler: with
			// --prefill-tp 2 one producer of each room lands late.
			if p.delay && f.writeDelay > 0 && tp == f.prefillTP-1 {
				rk.args = append(rk.args, "--inject-write-delay", f.writeDelay.String())
			}
			p.ranks = append(p.ranks, rk)
		}
		if err := p.start(); err != nil {
			return rep, err
		}
		env.pres = append(env.pres, p)
	}

	// The decode rank, in this process.
	env.bootPorts = bootPorts
	if env.tr, err = env.openTransport(); err != nil {
		return rep, err
	}
	defer func() { // the current incarnation's (a restart replaces it)
		env.mgrMu.Lock()
		defer env.mgrMu.Unlock()
		_ = env.tr.Close()
	}()
	npages := int((uint64(f.poolMB) << 20) / pageBytes)
	if npages < maxPages {
		return rep, fmt.Errorf("--pool-mb %d holds %d pages of %d bytes; the largest room needs %d (raise --pool-mb or lower --max-tokens)", f.poolMB, npages, pageBytes, maxPages)
	}
	if dl, err = workload.NewLayout(model, workload.LayoutOptions{PageSize: 16, TPSize: 1, PPSize: 1, NumPages: npages}); err != nil {
		return rep, err
	}
	env.pool, err = workload.NewKVBuffers(dl, workload.BufferOptions{Name: "chaos-decode", Device: -1, Aux: workload.DefaultAux, AuxRows: 2 * f.concurrency})
	if err != nil {
		return rep, err
	}
	defer env.pool.Close()
	env.rows = workload.NewPageAllocator(2 * f.concurrency)
	env.newDecode = func(tr transport.Transport, port int) (*engine.Manager, error) {
		return engine.NewManager(ctx, engine.ManagerConfig{Role: engine.RoleDecode, KV: env.pool.Args(), Transports: []transport.Transport{tr},
			ControlPort:      port,
			BootstrapTimeout: 3 * f.waiting, WaitingTimeout: f.waiting, PeerTimeout: f.peer, FenceTimeout: f.fence,
			ControlFault: func(peer, msgType string) bool {
				if env.drop.Filter(peer, msgType) {
					env.lastDrop.Store(time.Now().UnixNano())
					return true
				}
				return false
			},
			Logger: slog.Default().With("rank", "chaos decode"),
			VerifyKV: func(kv engine.ReceivedKV) error { // the slow-decode fault: the decode takes its time
				if d, ok := env.slow.Load(kv.Room); ok {
					time.Sleep(d.(time.Duration))
				}
				return nil
			}})
	}
	if env.m, err = env.newDecode(env.tr, 0); err != nil {
		return rep, err
	}
	defer func() {
		env.mgrMu.Lock()
		defer env.mgrMu.Unlock()
		_ = env.m.Close()
	}()
	if slices.Contains(faults, "datareset") {
		env.dataPorts = ownDataPorts(strconv.Itoa(env.m.ControlPort()), bootPorts)
	}

	records := make([]*chaosRoom, f.rooms)
	var next, doneN atomic.Int64
	stopProgress := make(chan struct{})
	if !f.quiet {
		go func() {
			t := time.NewTicker(5 * time.Second)
			defer t.Stop()
			for {
				select {
				case <-stopProgress:
					return
				case <-t.C:
					fmt.Fprintf(w, "chaos over %s: %d/%d rooms done\n", transportName, doneN.Load(), f.rooms)
				}
			}
		}()
	}
	var wg sync.WaitGroup
	for wk := 0; wk < f.concurrency; wk++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= f.rooms || ctx.Err() != nil || env.fatal.Load() != nil {
					return
				}
				rec := env.planRoom(seed, i)
				records[i] = rec
				env.runRoom(ctx, rec)
				doneN.Add(1)
			}
		}()
	}
	wg.Wait()
	close(stopProgress)
	if err := ctx.Err(); err != nil {
		return rep, err
	}
	if err := env.fatal.Load(); err != nil {
		return rep, *err
	}
	rep.Faults = env.counts
	env.markClosedAfterOK(slices.DeleteFunc(slices.Clone(records), func(r *chaosRoom) bool { return r == nil }))
	for _, r := range records {
		if r != nil {
			rep.add(r)
		}
	}
	rep.Heal = env.heal()
	rep.WallSeconds = time.Since(start).Seconds()
	return rep, nil
}

// add counts one room's outcome in the report.
func (rep *chaosReport) add(r *chaosRoom) {
	rep.Rooms++
	if r.decodeOK {
		rep.DecodeOK++
	} else {
		rep.DecodeFailed++
		if rep.DecodeFailures == nil {
			rep.DecodeFailures = map[string]int{}
		}
		class := cmp.Or(r.reason, engine.ReasonOther)
		rep.DecodeFailures[class]++
		if rep.FailureExamples == nil {
			rep.FailureExamples = map[string]string{}
		}
		if _, ok := rep.FailureExamples[class]; !ok {
			rep.FailureExamples[class] = r.decodeErr
		}
	}
	for _, l := range r.lines() {
		switch {
		case l.pre == nil:
			rep.PrefillUnknown++
		case l.pre.OK:
			rep.PrefillOK++
		default:
			rep.PrefillFailed++
		}
		if r.layerwise && l.pre != nil && l.pre.OK && l.pre.Layerwise {
			rep.LayerwiseSent++
		}
	}
	if r.layerwise {
		rep.Layerwise++
		if r.decodeOK {
			rep.LayerwiseOK++
		}
		if r.fault != "" && r.fault != "delay" {
			rep.LayerwiseFaulted++
		}
	}
	rep.check(r, "")
	if r.first != nil {
		rep.Retries++
		if r.decodeOK {
			rep.RetryOK++
		}
		if !r.first.decodeOK {
			rep.RetryFirstFailed++
		}
		rep.check(r.first, "first attempt of ")
	}
}

// check counts one attempt's disagreement, corruption, lost line and fault
// → Failed times (what names names the attempt in examples).
func (rep *chaosReport) check(r *chaosRoom, what string) {
	example := func(s string) {
		if len(rep.Examples) < 5 {
			rep.Examples = append(rep.Examples, s)
		}
	}
	lines := r.lines()
	disagree := false
	for k, l := range lines {
		if l.lost {
			rep.LostLines++
		}
		if l.pre == nil || l.pre.OK == r.decodeOK {
			continue
		}
		if !disagree { // one disagreement per attempt, however many ranks
			disagree = true
			rep.Disagreements++
			if r.decodeOK && r.closedAfterOK {
				rep.DisagreementsAtClose++
			}
		}
		when := ""
		if r.decodeOK {
			// How late the prefill failed tells a verdict lost (about the
			// prefill's verdict grace, 2 s, after the close) from a room
			// failed at once.
			when = fmt.Sprintf(" (prefill's line %d ms after the decode's Success", l.preAt.Sub(r.decodeAt).Milliseconds())
			if r.closedAfterOK {
				when += fmt.Sprintf("; decode closed %d ms after it", r.closeAfter.Milliseconds())
			}
			when += ")"
		}
		rank := ""
		if len(lines) > 1 {
			rank = fmt.Sprintf(" tp %d", k)
			if r.fault != "" {
				rank += fmt.Sprintf(" (the fault hit tp %d)", r.target)
			}
		}
		example(fmt.Sprintf("%sroom %d (fault %q, prefill %d%s): decode ok=%v %s; prefill%s ok=%v %s%s", what, r.room, r.fault, r.prefill, r.mode(), r.decodeOK, r.decodeErr, rank, l.pre.OK, l.pre.Error, when))
	}
	if r.corrupt != "" {
		rep.Corruptions++
		example(fmt.Sprintf("%sroom %d (fault %q, prefill %d%s): %s", what, r.room, r.fault, r.prefill, r.mode(), r.corrupt))
	}
	if r.fault == "" || r.faultAt.IsZero() {
		return
	}
	ms := func(d time.Duration) float64 { return float64(max(d, 0).Microseconds()) / 1000 }
	if !r.decodeOK && !r.decodeAt.IsZero() {
		rep.MaxDecodeFaultToFailedMS = max(rep.MaxDecodeFaultToFailedMS, ms(r.decodeAt.Sub(r.faultAt)))
	}
	for _, l := range lines {
		if l.pre != nil && !l.pre.OK {
			from := r.faultAt
			if !r.resumeAt.IsZero() {
				from = r.resumeAt
			}
			rep.MaxPrefillFaultToFailedMS = max(rep.MaxPrefillFaultToFailedMS, ms(l.preAt.Sub(from)))
		}
	}
}

// mode words how the room was sent in examples: ", layer-wise" or nothing.
func (r *chaosRoom) mode() string {
	if r.layerwise {
		return ", layer-wise"
	}
	return ""
}

// pickPrefill picks a prefill slot whose every rank runs for rec, and
// returns its children (tp order). A kill or stall needs a slot no other
// kill or stall is working on: it returns with that slot's mu held
// (released by inject).
func (e *chaosEnv) pickPrefill(ctx context.Context, rec *chaosRoom) (*chaosPrefill, []*child, error) {
	exclusive := chaosExclusive(rec.fault)
	deadline := time.Now().Add(3 * time.Minute)
	for {
		p := e.pres[rec.rng.IntN(len(e.pres))]
		if !exclusive {
			if c := p.live(); c != nil {
				return p, c, nil
			}
		} else if p.mu.TryLock() {
			if c := p.live(); c != nil {
				return p, c, nil
			}
			p.mu.Unlock()
		}
		if time.Now().After(deadline) {
			return nil, nil, fmt.Errorf("no prefill instance with every rank running for 3 minutes")
		}
		select {
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// runRoom runs one room, injects its fault, and records both sides'
// outcomes and the harness's byte checks. A room of the retry fault runs
// twice with the same bootstrap_room, pages and aux row: a first attempt
// (rec.first) the decode aborts, then the retry (rec).
func (e *chaosEnv) runRoom(ctx context.Context, rec *chaosRoom) {
	p, c, err := e.pickPrefill(ctx, rec)
	if err != nil {
		rec.decodeErr, rec.reason, rec.decodeAt = err.Error(), engine.FailureReason(err), time.Now()
		return
	}
	exclusive := chaosExclusive(rec.fault)
	injected := false
	defer func() {
		if exclusive && !injected {
			p.mu.Unlock()
		}
	}()
	rec.prefill = p.idx
	if p.delay && rec.fault == "" && e.f.writeDelay > 0 {
		rec.fault = "delay"
	}
	if rec.fault == "slow" {
		e.slow.Store(rec.room, time.Duration(300+rec.rng.IntN(1200))*time.Millisecond)
		defer e.slow.Delete(rec.room)
	}
	att := rec
	if rec.fault == "retry" {
		att = &chaosRoom{room: rec.room, pattern: rec.room ^ retrySalt, tokens: rec.tokens, preTokens: rec.preTokens, layerwise: rec.layerwise, rng: rec.rng, prefill: p.idx, fault: rec.fault}
		rec.first = att
	}
	preCh := submitAll(c, att)
	// The last attempt's prefill result is waited for after its pages went
	// back to the pool (deferred first, run last).
	defer func() { e.prefillResult(att, preCh) }()

	// The decode side.
	fail := func(err error) { // no pages: neither attempt ran on the decode
		for _, a := range []*chaosRoom{att, rec} {
			a.decodeErr, a.reason, a.decodeAt = err.Error(), engine.FailureReason(err), time.Now()
		}
	}
	pages, err := cluster.AllocWait(ctx, e.pool.PageAllocator, "pages", (rec.tokens+15)/16, 10*time.Minute)
	if err != nil {
		fail(err)
		return
	}
	defer e.pool.Free(pages)
	aux, err := cluster.AllocWait(ctx, e.rows, "aux rows", 1, 10*time.Minute)
	if err != nil {
		fail(err)
		return
	}
	defer e.rows.Free(aux)
	if att != rec {
		// The first attempt, aborted by the decode once TRANSFER went out;
		// the retry goes out once both sides concluded it (its result line
		// came, the decode's receiver closed: its producer fenced), to the
		// same prefill process (restarted, if it was killed meanwhile).
		injected = e.receive(ctx, att, p, c, pages, aux, true) || injected
		e.prefillResult(att, preCh)
		att = rec
		if cur := e.waitLive(ctx, p); cur != nil {
			c = cur
		}
		preCh = submitAll(c, rec)
		injected = e.receive(ctx, rec, p, c, pages, aux, false) || injected
		return
	}
	injected = e.receive(ctx, rec, p, c, pages, aux, true)
}

// submitAll sends an attempt's request line to every producer rank (cs,
// tp order) and returns their replies' channels.
func submitAll(cs []*child, rec *chaosRoom) []<-chan replyLine {
	var chs []<-chan replyLine
	for k, c := range cs {
		chs = append(chs, c.submit(chaosLine(rec, k, len(cs))))
	}
	return chs
}

// chaosLine is producer rank tp's (of tpSize) request line for an attempt
// (pattern_room for a first attempt, whose bytes are another room's
// pattern). The tokens fault's other count goes to the rank it targets
// only; the other ranks get the decode's count.
func chaosLine(rec *chaosRoom, tp, tpSize int) requestLine {
	q := requestLine{Room: rec.room, Tokens: rec.preTokens}
	if tpSize > 1 && tp != rec.target {
		q.Tokens = rec.tokens
	}
	if rec.layerwise {
		q.Layerwise, q.LayerComputeUS = true, chaosLayerUS
	}
	if rec.pattern != rec.room {
		q.PatternRoom = new(rec.pattern)
	}
	return q
}

// waitLive waits up to a minute for every rank of prefill slot p to have a
// running process (a killed one is being restarted).
func (e *chaosEnv) waitLive(ctx context.Context, p *chaosPrefill) []*child {
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline) && ctx.Err() == nil; time.Sleep(20 * time.Millisecond) {
		if c := p.live(); c != nil {
			return c
		}
	}
	return nil
}

// receive runs one attempt of rec on the decode into pages and aux (the
// prefill process c has its request line): it opens the receiver, injects
// the fault when inject (it reports whether inject ran: a kill, stall or
// bootstrap fault released p.mu), waits for the outcome, checks a
// successful attempt's bytes against rec.pattern and closes the receiver
// (for a failed attempt: once its producers are fenced).
func (e *chaosEnv) receive(ctx context.Context, rec *chaosRoom, p *chaosPrefill, c []*child, pages, aux []int32, inject bool) (injected bool) {
	r, err := e.decode().NewReceiver(p.addr, rec.room)
	if err != nil {
		rec.decodeErr, rec.reason, rec.decodeAt = err.Error(), engine.FailureReason(err), time.Now()
		return false
	}
	// Close runs before the pages go back to the pool or to a retry: for a
	// failed room it returns once its producers are fenced.
	defer r.Close()
	if err = r.SetTokens(rec.tokens); err == nil {
		err = r.SendMetadata(pages, int(aux[0]), nil, 0)
	}
	if err != nil {
		rec.decodeErr, rec.reason, rec.decodeAt = err.Error(), engine.FailureReason(err), time.Now()
		return false
	}
	fault := rec.fault
	if !inject {
		fault = ""
	}
	switch fault {
	case "", "exit":
	case "delay", "slow", "tokens":
		e.countFault(fault)
		rec.faultAt = time.Now()
		if fault != "delay" {
			e.noteFault(fault, p.idx, rec.faultAt)
		}
	default: // once TRANSFER went out (the producer may be writing)
		wctx, cancel := context.WithTimeout(ctx, 3*e.f.waiting)
		r.Wait(wctx, engine.KVTransferring)
		cancel()
		switch {
		case fault == "retry": // a retry's first attempt is aborted at once: it should fail
		case rec.layerwise: // somewhere in the forward pass, between layers
			time.Sleep(time.Duration(rec.rng.Int64N(int64(e.passTime) + 1)))
		default:
			time.Sleep(time.Duration(rec.rng.IntN(20)) * time.Millisecond)
		}
		injected = true
		e.inject(rec, p, c, r)
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	st := r.Wait(wctx, engine.KVSuccess)
	cancel()
	rec.decodeAt = time.Now()
	rec.decodeOK = st == engine.KVSuccess
	if fault == "exit" {
		// The decode goes away right after its Success, its verdict
		// possibly still on the way: the prefill must report ok.
		if !rec.decodeOK {
			e.countFault("exit (not injected: the room failed)")
		} else {
			e.noteOK(p.idx, rec.decodeAt)
			rec.faultAt = time.Now()
			kind, ok := e.restartDecode("exit", rec.rng)
			e.countFault(kind)
			if ok {
				e.noteFault(kind, p.idx, rec.faultAt)
			}
		}
	} else if rec.decodeOK {
		e.noteOK(p.idx, rec.decodeAt)
	}
	if !rec.decodeOK {
		if err := r.Failure(); err != nil {
			rec.decodeErr, rec.reason = err.Error(), engine.FailureReason(err)
		} else {
			rec.decodeErr = "receiver still " + st.String()
		}
		return injected
	}
	// The harness's own byte check, at Success and again after the consumer
	// held the pages a while (a late write shows then).
	if err := chaosCheck(e.pool, rec.pattern, pages, int(aux[0])); err != nil {
		rec.corrupt = "at Success: " + err.Error()
	}
	time.Sleep(time.Duration(rec.rng.IntN(200)) * time.Millisecond)
	if err := chaosCheck(e.pool, rec.pattern, pages, int(aux[0])); err != nil && rec.corrupt == "" {
		rec.corrupt = "before reuse: " + err.Error()
	}
	return injected
}

func chaosCheck(pool *workload.KVBuffers, room uint64, pages []int32, aux int) error {
	if err := workload.VerifyPattern(pool, room, pages, 0); err != nil {
		return err
	}
	return workload.VerifyAux(pool, room, aux)
}

// prefillResult waits for each producer rank's result line for the room
// (chs, tp order). A line the process did not write (it died, or its stdin
// was gone: Line 0) leaves that rank's outcome unknown.
func (e *chaosEnv) prefillResult(rec *chaosRoom, chs []<-chan replyLine) {
	deadline := time.After(3*e.f.waiting + e.f.peer + time.Minute)
	rec.others = make([]chaosRankLine, max(len(chs)-1, 0))
	for k, ch := range chs {
		var l chaosRankLine
		select {
		case rl := <-ch:
			l.preAt = time.Now()
			if rl.Line != 0 {
				l.pre = &rl
			}
		case <-deadline:
			// No answer in time (a hung process): unknown, and said so.
			if len(chs) > 1 {
				rec.decodeErr += fmt.Sprintf(" (prefill tp %d never answered)", k)
			} else {
				rec.decodeErr += " (the prefill process never answered)"
			}
			l.lost = true
		}
		if k == 0 {
			rec.pre, rec.preAt, rec.lost = l.pre, l.preAt, l.lost
		} else {
			rec.others[k-1] = l
		}
	}
}

// inject injects rec.fault: on the room's prefill process p (kill, stall;
// the caller holds p.mu, which inject releases), on the decode's control
// channel (drop), or on the decode's receiver (abort).
func (e *chaosEnv) inject(rec *chaosRoom, p *chaosPrefill, cs []*child, r *engine.Receiver) {
	// The producer rank a process fault hits (kill, stall, ctlreset).
	k := min(rec.target, len(cs)-1)
	c, rk := cs[k], p.ranks[k]
	switch rec.fault {
	case "drop":
		// A connection down for a while, or one verdict lost. Verdict drops
		// do not pile up: one still pending would otherwise eat the verdicts
		// (and their repeats) of unrelated rooms, a decode unreachable for
		// seconds rather than one lost message. None while a decode restart
		// waits for dropped verdicts to be asked again.
		if !e.quiet.TryRLock() {
			e.countFault("drop (skipped: decode restart pending)")
			return
		}
		defer e.quiet.RUnlock()
		if rec.rng.IntN(2) == 0 || e.drop.Pending(engine.MsgStatus) > 0 {
			e.drop.DropFor(time.Duration(50+rec.rng.IntN(450)) * time.Millisecond)
		} else {
			e.drop.DropNext(engine.MsgStatus, 1)
		}
		rec.faultAt = time.Now()
		e.countFault("drop")
		e.noteFault("drop", p.idx, rec.faultAt)
	case "abort", "retry": // retry: its first attempt
		rec.faultAt = time.Now()
		r.Abort()
		e.countFault(rec.fault)
		e.noteFault(rec.fault, p.idx, rec.faultAt)
	case "restart":
		rec.faultAt = time.Now()
		kind, ok := e.restartDecode("restart", rec.rng)
		e.countFault(kind)
		if ok {
			e.noteFault(kind, p.idx, rec.faultAt)
		}
	case "ctlreset":
		rec.faultAt = time.Now()
		ports := []string{strconv.Itoa(e.decode().ControlPort())}
		if cp := rk.ctlPort.Load(); cp != nil {
			ports = append(ports, *cp)
		}
		n, err := ssKill(ports)
		kind, reset := resetOutcome(slog.Default(), "ctlreset", ports, n, err)
		e.countFault(kind)
		if reset {
			e.noteFault("ctlreset", p.idx, rec.faultAt)
		}
	case "datareset":
		rec.faultAt = time.Now()
		ports := e.ports()
		n, err := ssKill(ports)
		kind, reset := resetOutcome(slog.Default(), "datareset", ports, n, err)
		e.countFault(kind)
		if reset {
			e.noteFault("datareset", p.idx, rec.faultAt)
		}
	case "bootstrap":
		rec.faultAt = time.Now()
		err := p.restartBootstrap(time.Duration(200+rec.rng.IntN(800)) * time.Millisecond)
		p.mu.Unlock()
		if err != nil {
			slog.Error("chaos: bootstrap restart failed", "prefill", p.idx, "err", err)
			e.countFault("bootstrap (restart failed)")
			return
		}
		e.countFault("bootstrap")
		e.noteFault("bootstrap", p.idx, rec.faultAt)
	case "kill":
		rec.faultAt = time.Now()
		_ = c.proc.Signal(syscall.SIGKILL)
		e.countFault("kill")
		e.noteFault("kill", p.idx, rec.faultAt)
		go func() {
			defer p.mu.Unlock()
			<-c.exit()
			if err := p.startRank(k); err != nil {
				slog.Error("chaos: prefill restart failed", "prefill", p.name(k), "err", err)
			}
		}()
	case "stall":
		d := time.Duration(200+rec.rng.IntN(600)) * time.Millisecond
		kind := "stall (short)"
		if rec.rng.IntN(2) == 0 {
			d = e.f.waiting + e.f.fence + time.Duration(500+rec.rng.IntN(1000))*time.Millisecond
			kind = "stall (long)"
		}
		rec.faultAt = time.Now()
		_ = c.proc.Signal(syscall.SIGSTOP)
		e.countFault(kind)
		e.noteFault(kind, p.idx, rec.faultAt)
		time.Sleep(d)
		_ = c.proc.Signal(syscall.SIGCONT)
		rec.resumeAt = time.Now()
		p.mu.Unlock()
	}
}

// chaosExclusive reports whether fault k needs its prefill process slot to
// itself (no other kill, stall or bootstrap restart on it meanwhile).
func chaosExclusive(k string) bool { return k == "kill" || k == "stall" || k == "bootstrap" }

// chaosBootstrap is a prefill process's bootstrap server, in this process,
// which the bootstrap fault stops and starts again on its port.
type chaosBootstrap struct {
	mu     sync.Mutex
	addr   string
	cancel context.CancelFunc
	done   chan error
}

// start starts the server on port (0: a free one).
func (b *chaosBootstrap) start(port int) error {
	srv := server.New(server.Options{Host: "127.0.0.1", Port: port})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Start(ctx) }()
	select {
	case <-srv.Ready():
	case err := <-done:
		cancel()
		return err
	}
	b.addr, b.cancel, b.done = srv.Addr(), cancel, done
	return nil
}

// stop stops the server (idempotent).
func (b *chaosBootstrap) stop() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cancel != nil {
		b.cancel()
		<-b.done
		b.cancel = nil
	}
}

// restart stops the server, waits down, and starts it again on its port
// (retrying for 5 s while the port is not free yet).
func (b *chaosBootstrap) restart(down time.Duration) error {
	b.stop()
	time.Sleep(down)
	b.mu.Lock()
	defer b.mu.Unlock()
	_, p, _ := net.SplitHostPort(b.addr)
	port, _ := strconv.Atoi(p)
	var err error
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if err = b.start(port); err == nil {
			return nil
		}
	}
	return err
}

// resetOutcome logs the outcome of a reset fault (ctlreset, datareset)
// whose ss -K on ports reset n connections or failed with err, and returns
// the fault count's kind and whether anything was reset. A failed ss is
// an error (logged at Error: the fault cannot work here); no port, or no
// established connection on the ports, is an ordinary outcome (between
// rooms; a transport without TCP connections), logged at Info, saying
// nothing was reset.
func resetOutcome(log *slog.Logger, fault string, ports []string, n int, err error) (string, bool) {
	switch {
	case len(ports) == 0:
		log.Info("chaos: " + fault + ": no port to reset (no TCP connection of that kind), nothing was reset")
		return fault + " (nothing to reset)", false
	case err != nil:
		log.Error("chaos: "+fault+" failed: no connection was reset", "ports", ports, "err", err)
		return fault + " (failed)", false
	case n == 0:
		log.Info("chaos: "+fault+": no established connection on the ports, nothing was reset", "ports", ports)
		return fault + " (nothing to reset)", false
	}
	return fault, true
}

// ssKill resets (ss -K) every established TCP connection to or from the
// given local ports and returns how many sockets it reset.
func ssKill(ports []string) (int, error) {
	if len(ports) == 0 {
		return 0, errors.New("no port to reset")
	}
	var filter []string
	for _, p := range ports {
		filter = append(filter, "sport = :"+p, "dport = :"+p)
	}
	out, err := exec.Command("ss", "-HK", "state", "established", "( "+strings.Join(filter, " or ")+" )").CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("ss -K (needs root and CONFIG_INET_DIAG_DESTROY): %v: %s", err, out)
	}
	n := 0
	for _, line := range strings.Split(string(out), "\n") {
		if strings.TrimSpace(line) != "" && !strings.Contains(line, "RTNETLINK") {
			n++
		}
	}
	return n, nil
}

// ownDataPorts lists this process's TCP listening ports other than its
// control port and its bootstrap servers' (the decode's data listener).
func ownDataPorts(control string, bootstrap []string) []string {
	out, err := exec.Command("ss", "-Hltnp").Output()
	if err != nil {
		return nil
	}
	pid := "pid=" + strconv.Itoa(os.Getpid()) + ","
	var ports []string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if !strings.Contains(line, pid) || len(f) < 4 {
			continue
		}
		port := f[3][strings.LastIndex(f[3], ":")+1:]
		if port != control && !slices.Contains(bootstrap, port) && !slices.Contains(ports, port) {
			ports = append(ports, port)
		}
	}
	return ports
}
