package cluster

import (
	"context"
	"fmt"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/workload"
)

// computeTimes are a modeled forward pass's start and end, and when its
// first send was queued.
type computeTimes struct {
	start, end, firstSend time.Time
}

// forwardPass runs a prefill's modeled forward pass over the pages it
// sends (src, the request's logical pages first… onwards), chunk by chunk
// (RoomConfig.ChunkPages, chunked prefill) and layer by layer: each layer of
// a chunk takes its share of LayerTime (chunk pages / all pages), slept
// with no lock held, as the host waits while a GPU computes (the KV, the
// pattern, was written before: a CPU fill here would compete with the
// transfer for the host's cores, which a GPU's compute does not). Layer-wise, each
// layer of each chunk is queued as soon as it is "computed"
// (SendLayers); otherwise each chunk is queued after its last layer (Send,
// the last chunk marked last), which is what a prefill without layer-wise
// sending does. A dummy rank (no real destination, src empty) computes and
// names every layer with no pages.
func forwardPass(ctx context.Context, s *engine.Sender, pool *workload.KVBuffers, c RoomConfig, room uint64, src []int32) (computeTimes, error) {
	lay := pool.Layout()
	chunk := c.ChunkPages
	if chunk <= 0 || chunk > len(src) {
		chunk = max(len(src), 1)
	}
	var ct computeTimes
	ct.start = time.Now()
	// Layers end at fixed times from the start (a late wake-up of one
	// layer does not delay the next: the host being busy does not slow a
	// GPU's compute).
	due := ct.start
	calls := 0
	for at := 0; at < len(src) || (at == 0 && len(src) == 0); at += chunk {
		pages := src[at:min(at+chunk, len(src))]
		share := c.LayerTime
		if len(src) > 0 {
			share = time.Duration(int64(c.LayerTime) * int64(len(pages)) / int64(len(src)))
		}
		for l := lay.StartLayer; l < lay.EndLayer; l++ {
			due = due.Add(share)
			if err := sleepUntil(ctx, due); err != nil {
				return ct, err
			}
			if !c.Layerwise {
				continue
			}
			if ct.firstSend.IsZero() {
				ct.firstSend = time.Now()
			}
			if err := s.SendLayers(pages, l, l, nil); err != nil {
				return ct, err
			}
			calls++
			if c.AfterLayers != nil {
				if err := s.Flush(ctx); err != nil {
					return ct, err
				}
				if !c.AfterLayers(room, calls) {
					ct.end = time.Now()
					return ct, nil // stalled: the room ends as the decode decides
				}
			}
		}
		if !c.Layerwise {
			if ct.firstSend.IsZero() {
				ct.firstSend = time.Now()
			}
			if err := s.Send(pages, at+len(pages) >= len(src)); err != nil {
				return ct, err
			}
		}
		if len(src) == 0 {
			break
		}
	}
	ct.end = time.Now()
	return ct, nil
}

// sleepUntil sleeps until t (at once when it passed) or ctx ends.
func sleepUntil(ctx context.Context, t time.Time) error {
	d := time.Until(t)
	if d <= 0 {
		return nil
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("forward pass: %w", context.Cause(ctx))
	}
}
