package metadata

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"sort"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// InstanceRecordVersion is the wire version of InstanceRecord.
const InstanceRecordVersion = 1

// maxInstanceRecord bounds a decoded instance record (bytes).
const maxInstanceRecord = 16 << 20

// InstanceRecord is one prefill instance's bootstrap directory as published
// in etcd: where its bootstrap server listens, who publishes it, and the
// directory itself (topology, readiness, ranks, missing coordinates).
type InstanceRecord struct {
	Version int `json:"v"`
	// Addr is the bootstrap server's "host:port" (the key).
	Addr string `json:"addr"`
	// Host, PID and Epoch identify the publishing process (Epoch: random,
	// new on every start).
	Host  string `json:"host"`
	PID   int    `json:"pid"`
	Epoch uint64 `json:"epoch"`
	// Updated is when the record was last written; the publisher rewrites
	// it at least every HeartbeatSeconds.
	Updated          time.Time `json:"updated"`
	HeartbeatSeconds float64   `json:"heartbeat_seconds"`
	// Table is the bootstrap directory (GET /v1/table).
	Table bootstrap.TableSnapshot `json:"table"`
}

// DecodeInstanceRecord parses a record read from etcd. Errors wrap
// ErrBadRecord and name the field.
func DecodeInstanceRecord(b []byte) (InstanceRecord, error) {
	var r InstanceRecord
	if len(b) == 0 || len(b) > maxInstanceRecord {
		return r, fmt.Errorf("%w: instance record of %d bytes (want 1..%d)", ErrBadRecord, len(b), maxInstanceRecord)
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return InstanceRecord{}, fmt.Errorf("%w: instance record: %v", ErrBadRecord, err)
	}
	switch {
	case r.Version != InstanceRecordVersion:
		return InstanceRecord{}, fmt.Errorf("%w: instance record version %d, this build reads %d", ErrBadRecord, r.Version, InstanceRecordVersion)
	case r.Addr == "" || len(r.Addr) > 1024:
		return InstanceRecord{}, fmt.Errorf("%w: instance record: addr is empty or too long", ErrBadRecord)
	case r.Table.Registered < 0 || r.Table.Expected < 0 || r.Table.Stale < 0 || r.HeartbeatSeconds < 0:
		return InstanceRecord{}, fmt.Errorf("%w: instance %s: negative counts", ErrBadRecord, r.Addr)
	}
	return r, nil
}

// PublishInstance stores rec under its bootstrap address, bound to the
// store's lease.
func (s *Store) PublishInstance(ctx context.Context, rec InstanceRecord) error {
	if rec.Addr == "" {
		return fmt.Errorf("metadata: publish instance: the bootstrap address is empty")
	}
	rec.Version = InstanceRecordVersion
	b, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("metadata: publish instance %s: %w", rec.Addr, err)
	}
	ctx, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	return s.put(ctx, s.InstanceKey(rec.Addr), string(b))
}

// UnpublishInstance removes an instance record.
func (s *Store) UnpublishInstance(ctx context.Context, addr string) error {
	ctx, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	return s.del(ctx, s.InstanceKey(addr))
}

// Instances lists the published instance records, sorted by address
// (records that do not decode are counted in bad).
func (s *Store) Instances(ctx context.Context) (out []InstanceRecord, bad int, err error) {
	ctx, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	resp, err := s.cli.Get(ctx, s.url.Prefix+"/instances/", clientv3.WithPrefix())
	if err != nil {
		return nil, 0, s.unavailable("list instances", err)
	}
	for _, kv := range resp.Kvs {
		r, err := DecodeInstanceRecord(kv.Value)
		if err != nil {
			bad++
			continue
		}
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Addr < out[j].Addr })
	return out, bad, nil
}

// DefaultInstanceHeartbeat is how often an InstancePublisher rewrites an
// unchanged record (so a listing can tell a stuck publisher).
const DefaultInstanceHeartbeat = 10 * time.Second

// PublishInstanceLoop publishes the bootstrap directory snapshot() returns
// under addr every time it changes (checked every poll, 250 ms when 0) and
// at least every heartbeat (DefaultInstanceHeartbeat when 0), until ctx
// ends; then it removes the record. Failures (etcd down) are logged and
// retried at the next poll.
func (s *Store) PublishInstanceLoop(ctx context.Context, addr string, snapshot func() bootstrap.TableSnapshot, poll, heartbeat time.Duration) {
	if poll <= 0 {
		poll = 250 * time.Millisecond
	}
	if heartbeat <= 0 {
		heartbeat = DefaultInstanceHeartbeat
	}
	host, _ := os.Hostname()
	epoch := randomEpoch()
	var last bootstrap.TableSnapshot
	var lastAt time.Time
	published := false
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		snap := snapshot()
		if !published || !reflect.DeepEqual(snap, last) || time.Since(lastAt) >= heartbeat {
			rec := InstanceRecord{Addr: addr, Host: host, PID: os.Getpid(), Epoch: epoch, Updated: time.Now().UTC(),
				HeartbeatSeconds: heartbeat.Seconds(), Table: snap}
			if err := s.PublishInstance(ctx, rec); err != nil {
				if ctx.Err() == nil {
					s.log.Warn("publishing the bootstrap directory failed; retrying", "addr", addr, "err", err)
				}
			} else {
				last, lastAt, published = snap, time.Now(), true
			}
		}
		select {
		case <-ctx.Done():
			dctx, cancel := context.WithTimeout(context.Background(), s.opts.Timeout)
			_ = s.UnpublishInstance(dctx, addr)
			cancel()
			return
		case <-t.C:
		}
	}
}

// RankStatus is one registered rank of an instance, checked against the
// segments published in etcd.
type RankStatus struct {
	bootstrap.Coord
	RankIP     string `json:"rank_ip"`
	RankPort   int    `json:"rank_port"`
	InstanceID string `json:"instance_id,omitempty"`
	Epoch      uint64 `json:"epoch,omitempty"`
	// Segment is "live" (the rank's segment is published with the epoch the
	// directory lists), "restarted" (published with another epoch: the
	// directory lists an older incarnation) or "absent" (nothing published:
	// the rank crashed more than a TTL ago, or runs without --metadata).
	Segment string `json:"segment"`
	// Heartbeat is the directory's view of the rank: "live" (it checks in
	// within its bound), "stale" (silent beyond bootstrap.StaleAfter of its
	// declared interval: dead, hung or cut off from the directory) or "none"
	// (it declared no heartbeat: an SGLang rank, or one with the directory
	// check off).
	Heartbeat string `json:"heartbeat"`
}

// InstanceStatus is one prefill instance in a FleetReport.
type InstanceStatus struct {
	Addr string `json:"addr"`
	// Ready is true when the directory is ready (every rank registered,
	// none silent beyond its heartbeat bound) and nothing about the instance
	// is stale: never "ready" above a STALE line.
	Ready      bool                         `json:"ready"`
	Registered int                          `json:"registered"`
	Expected   int                          `json:"expected"`
	Topology   *bootstrap.PrefillServerInfo `json:"topology"`
	Missing    []bootstrap.Coord            `json:"missing"`
	Ranks      []RankStatus                 `json:"ranks"`
	Publisher  string                       `json:"publisher"`
	AgeSeconds float64                      `json:"age_seconds"`
	// Stale lists what is stale about the instance: an old record (its
	// publisher stopped rewriting it) and ranks whose segment is absent or
	// from another epoch.
	Stale []string `json:"stale"`
}

// FleetReport is what `kvxfer fleet` prints.
type FleetReport struct {
	URL       string           `json:"url"`
	Instances []InstanceStatus `json:"instances"`
	// Segments counts published segments by kind ("engine", "prefill",
	// "decode", "" for unknown).
	Segments map[string]int `json:"segments"`
	// BadRecords counts records that did not decode.
	BadRecords int `json:"bad_records"`
	// Stale is the number of stale findings over all instances.
	Stale int `json:"stale"`
}

// Fleet reads every instance and segment and checks each registered rank
// against the published segments (a rank's segment name is its
// "rank_ip:rank_port", as KV manager ranks publish it).
func (s *Store) Fleet(ctx context.Context, now time.Time) (FleetReport, error) {
	insts, bad1, err := s.Instances(ctx)
	if err != nil {
		return FleetReport{}, err
	}
	segs, bad2, err := s.Segments(ctx)
	if err != nil {
		return FleetReport{}, err
	}
	return BuildFleetReport(s.url.String(), insts, segs, bad1+bad2, now), nil
}

// BuildFleetReport is Fleet's pure part (testable without etcd).
func BuildFleetReport(url string, insts []InstanceRecord, segs []transport.SegmentDescriptor, bad int, now time.Time) FleetReport {
	rep := FleetReport{URL: url, Segments: map[string]int{}, BadRecords: bad, Instances: []InstanceStatus{}}
	byName := map[string]transport.SegmentDescriptor{}
	for _, d := range segs {
		byName[d.Name] = d
		rep.Segments[d.Kind]++
	}
	for _, r := range insts {
		st := InstanceStatus{Addr: r.Addr, Ready: r.Table.Ready, Registered: r.Table.Registered, Expected: r.Table.Expected,
			Topology: r.Table.Topology, Missing: r.Table.Missing, Ranks: []RankStatus{}, Stale: []string{},
			Publisher: fmt.Sprintf("%s pid %d", r.Host, r.PID), AgeSeconds: max(0, now.Sub(r.Updated).Seconds())}
		if st.Missing == nil {
			st.Missing = []bootstrap.Coord{}
		}
		if hb := r.HeartbeatSeconds; hb > 0 && st.AgeSeconds > 3*hb {
			st.Stale = append(st.Stale, fmt.Sprintf("record not rewritten for %.0f s (publisher %s stuck; heartbeat %.0f s)", st.AgeSeconds, st.Publisher, hb))
		}
		for _, k := range r.Table.Ranks {
			rs := RankStatus{Coord: k.Coord, RankIP: k.RankIP, RankPort: k.RankPort, InstanceID: k.InstanceID, Epoch: k.Epoch, Segment: "absent", Heartbeat: "none"}
			name := bootstrap.JoinHostPort(k.RankIP, k.RankPort)
			switch {
			case k.Stale:
				rs.Heartbeat = "stale"
				since := "its registration"
				silent := ""
				if k.SilentSince != nil {
					since = k.SilentSince.UTC().Format(time.RFC3339)
					silent = fmt.Sprintf(", %.1f s ago", max(0, now.Sub(*k.SilentSince).Seconds()))
				}
				hb := time.Duration(k.HeartbeatMS) * time.Millisecond
				st.Stale = append(st.Stale, fmt.Sprintf("rank %s at %s: the directory last heard from it at %s%s; it checks in every %v and is stale after %v of silence (dead, hung, or cut off from the directory: see its log)",
					k.Coord, name, since, silent, hb, bootstrap.StaleAfter(hb)))
			case k.HeartbeatMS > 0:
				rs.Heartbeat = "live"
			}
			if d, ok := byName[name]; ok {
				rs.Segment = "live"
				if k.Epoch != 0 && d.Epoch != k.Epoch {
					rs.Segment = "restarted"
				}
			}
			switch rs.Segment {
			case "absent":
				st.Stale = append(st.Stale, fmt.Sprintf("rank %s at %s: no segment published (crashed more than a lease TTL ago, or started without --metadata)", k.Coord, name))
			case "restarted":
				st.Stale = append(st.Stale, fmt.Sprintf("rank %s at %s: the directory lists epoch %d, the running process publishes %d (restarted; its directory entry is old)", k.Coord, name, k.Epoch, byName[name].Epoch))
			}
			st.Ranks = append(st.Ranks, rs)
		}
		st.Ready = st.Ready && len(st.Stale) == 0
		rep.Stale += len(st.Stale)
		rep.Instances = append(rep.Instances, st)
	}
	return rep
}

// FormatFleet renders a report as the text `kvxfer fleet` prints.
func FormatFleet(rep FleetReport) string {
	var b strings.Builder
	fmt.Fprintf(&b, "metadata %s: %d prefill instances; segments:", rep.URL, len(rep.Instances))
	kinds := make([]string, 0, len(rep.Segments))
	for k := range rep.Segments {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	if len(kinds) == 0 {
		b.WriteString(" none")
	}
	for _, k := range kinds {
		name := k
		if name == "" {
			name = "other"
		}
		fmt.Fprintf(&b, " %d %s", rep.Segments[k], name)
	}
	if rep.BadRecords > 0 {
		fmt.Fprintf(&b, "; %d malformed records", rep.BadRecords)
	}
	b.WriteString("\n")
	for _, in := range rep.Instances {
		ready := "NOT READY"
		if in.Ready {
			ready = "ready"
		}
		topo := "no topology yet"
		if t := in.Topology; t != nil {
			topo = fmt.Sprintf("dp %d cp %d tp %d pp %d", t.DPSize, t.AttnCPSize, t.AttnTPSize, t.PPSize)
			if t.PageSize != nil {
				topo += fmt.Sprintf(", page %d", *t.PageSize)
			}
		}
		stale := 0
		for _, r := range in.Ranks {
			if r.Heartbeat == "stale" || r.Segment != "live" {
				stale++
			}
		}
		ranks := fmt.Sprintf("%d/%d ranks registered", in.Registered, in.Expected)
		if stale > 0 {
			ranks += fmt.Sprintf(", %d stale", stale)
		}
		fmt.Fprintf(&b, "\ninstance %s  %s  %s  (%s)  by %s, %.1f s ago\n", in.Addr, ready, ranks, topo, in.Publisher, in.AgeSeconds)
		if len(in.Missing) > 0 {
			var ms []string
			for _, c := range in.Missing {
				ms = append(ms, c.String())
			}
			fmt.Fprintf(&b, "  missing ranks: %s\n", strings.Join(ms, ", "))
		}
		for _, r := range in.Ranks {
			fmt.Fprintf(&b, "  rank %s  %s  segment %s, heartbeat %s\n", r.Coord.String(), bootstrap.JoinHostPort(r.RankIP, r.RankPort), r.Segment, r.Heartbeat)
		}
		for _, s := range in.Stale {
			fmt.Fprintf(&b, "  STALE: %s\n", s)
		}
	}
	return b.String()
}
