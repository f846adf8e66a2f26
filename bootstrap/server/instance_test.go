package server

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// TestInstanceIdentity: entries carry the registering instance's id and
// epoch; an older instance cannot take coordinates back from its successor,
// and a conditional DELETE removes an entry only while it names the caller
// (issue 18: a rolling restart's old rank must not delete the new one).
func TestInstanceIdentity(t *testing.T) {
	s, c := startServer(t, Options{})
	ctx := ctxT(t)
	at := bootstrap.Coord{TP: 1}
	p1, p2 := reg(2, 1, 7001), reg(2, 1, 7002)
	p1.InstanceID, p1.Epoch = "p1", 100
	p2.InstanceID, p2.Epoch = "p2", 200

	if err := c.Register(ctx, p1); err != nil {
		t.Fatal(err)
	}
	// The entry is readable before the directory is ready (tp 0 missing).
	e, err := c.Entry(ctx, at)
	if err != nil || e.InstanceID != "p1" || e.Epoch != 100 || e.RankPort != 7001 {
		t.Fatalf("Entry before ready: %+v %v, want p1 epoch 100 port 7001", e, err)
	}
	if _, err := c.Entry(ctx, bootstrap.Coord{}); !errors.Is(err, bootstrap.ErrNotFound) {
		t.Fatalf("Entry of an absent rank: %v, want ErrNotFound", err)
	}
	// The successor replaces it; the old instance cannot take it back.
	if err := c.Register(ctx, p2); err != nil {
		t.Fatalf("successor PUT: %v", err)
	}
	err = c.Register(ctx, p1)
	if !errors.Is(err, bootstrap.ErrReplaced) || !strings.Contains(err.Error(), "p2") {
		t.Fatalf("old instance PUT after its successor: %v, want ErrReplaced naming p2", err)
	}
	// The old instance's conditional DELETE leaves the successor in place.
	err = c.Deregister(ctx, at, "p1")
	if !errors.Is(err, bootstrap.ErrReplaced) || !strings.Contains(err.Error(), "p2") || !strings.Contains(err.Error(), "7002") {
		t.Fatalf("old instance DELETE: %v, want ErrReplaced naming p2 and its endpoint", err)
	}
	if err := c.Register(ctx, reg(2, 0, 7000)); err != nil {
		t.Fatal(err)
	}
	ri, err := c.RankInfo(ctx, 0, 0, 1, 0)
	if err != nil || ri.RankPort != 7002 || ri.InstanceID != "p2" || ri.Epoch != 200 {
		t.Fatalf("rank after the old instance's DELETE: %+v %v, want p2's entry", ri, err)
	}
	// A rank without an instance id (SGLang's) gets exactly SGLang's two keys.
	if code, _, body := raw(t, "GET", "http://"+s.Addr()+"/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0", ""); code != 200 || body != `{"rank_ip":"127.0.0.1","rank_port":7000}` {
		t.Fatalf("SGLang-style rank answer: %d %s", code, body)
	}
	// Its own conditional DELETE removes it; an unconditional one always does.
	if err := c.Deregister(ctx, at, "p2"); err != nil {
		t.Fatalf("successor DELETE: %v", err)
	}
	if _, err := c.Entry(ctx, at); !errors.Is(err, bootstrap.ErrNotFound) {
		t.Fatalf("Entry after DELETE: %v, want ErrNotFound", err)
	}
	if err := c.Deregister(ctx, bootstrap.Coord{}, "p9"); !errors.Is(err, bootstrap.ErrReplaced) {
		t.Fatalf("conditional DELETE of a rank without id: %v, want ErrReplaced", err)
	}
	if err := c.Deregister(ctx, bootstrap.Coord{}, ""); err != nil {
		t.Fatal(err)
	}
	// Equal epochs (or a newer one) replace, as before.
	p3 := p1
	p3.InstanceID, p3.Epoch = "p3", 100
	if err := c.Register(ctx, p1); err != nil {
		t.Fatal(err)
	}
	if err := c.Register(ctx, p3); err != nil {
		t.Fatalf("equal-epoch PUT: %v", err)
	}
	// Malformed ids are refused naming the field.
	for _, tc := range []struct{ method, path, body string }{
		{"PUT", "/route", strings.Replace(sglangBody(1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 7000), `{`, `{"instance_id":"bad id!",`, 1)},
		{"PUT", "/route", strings.Replace(sglangBody(1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 7000), `{`, `{"epoch":-1,`, 1)},
		{"DELETE", "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0&instance_id=" + strings.Repeat("x", 65), ""},
	} {
		if code, _, body := raw(t, tc.method, "http://"+s.Addr()+tc.path, tc.body); code != 400 || !(strings.Contains(body, "instance_id") || strings.Contains(body, "epoch")) {
			t.Errorf("%s %s %s: %d %q, want 400 naming the field", tc.method, tc.path, tc.body, code, body)
		}
	}
}

// TestEntryUnsupported: a server without GET /v1/entry (SGLang's) is told
// from "no entry" by the missing X-Kvxfer-Entry header.
func TestEntryUnsupported(t *testing.T) {
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "404: Not Found", http.StatusNotFound)
	}))
	defer hs.Close()
	c, err := bootstrap.NewClient(strings.TrimPrefix(hs.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Entry(ctxT(t), bootstrap.Coord{}); !errors.Is(err, bootstrap.ErrUnsupported) {
		t.Fatalf("Entry on a foreign server: %v, want ErrUnsupported", err)
	}
}
