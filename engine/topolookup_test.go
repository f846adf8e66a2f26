package engine_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
)

// TestFailedTopologyLookupIsNotRepeated: a room that fails because its
// bootstrap server never gave the topology (here it answers 503 to every
// request) sends that server nothing more once the room failed. The
// receiver used to start a second lookup of the same bootstrap to find
// producers to ABORT, which ran on for a whole bootstrap timeout after the
// room had failed.
func TestFailedTopologyLookupIsNotRepeated(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		hits.Add(1)
		http.Error(w, "not ready", http.StatusServiceUnavailable)
	}))
	defer srv.Close()
	addr := srv.Listener.Addr().String()
	d := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, bootTmo: 500 * time.Millisecond})
	r, err := d.m.NewReceiver(addr, 11)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if st := r.Wait(ctx, engine.KVWaitingForInput); st != engine.KVFailed {
		t.Fatalf("receiver with a bootstrap answering 503: %s", st)
	}
	if hits.Load() == 0 {
		t.Fatal("the bootstrap server was never asked for the topology")
	}
	// A request already on the wire when the room failed may still land.
	time.Sleep(100 * time.Millisecond)
	at := hits.Load()
	time.Sleep(1500 * time.Millisecond)
	if n := hits.Load() - at; n != 0 {
		t.Fatalf("%d more requests reached the bootstrap server in the 1.5 s after the room failed (%v); want none: the failed lookup was repeated", n, r.Failure())
	}
}
