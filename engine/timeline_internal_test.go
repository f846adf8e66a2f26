package engine

import (
	"fmt"
	"strings"
	"testing"
)

// TestTimelineKeepsLastBatches: a room of more batch events than the
// timeline's head budget keeps its first batches, its last
// batchTailEvents ones (the batches before the handover) and every chain
// event, in the order they happened, with one marker for the batches left
// out just before the last ones kept; Dropped counts them. Before the
// tail ring, the timeline kept the first batches only.
func TestTimelineKeepsLastBatches(t *testing.T) {
	head := maxRoomEvents - batchEventsReserve - 1 // the register event is the first
	cases := []struct {
		name    string
		batches int
		dropped int
	}{
		{"fits", head, 0},
		{"fits with the tail", head + batchTailEvents, 0},
		{"one over", head + batchTailEvents + 1, 1},
		{"layer by layer, 128 layers x 2", 256, 256 - head - batchTailEvents},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tr := &roomTrace{m: &Manager{}, done: map[Step]bool{}, peers: map[Step]map[string]bool{}}
			tr.appendLocked(RoomEvent{Step: StepRegister, Done: true})
			for i := range tc.batches {
				tr.noteBatch("", fmt.Sprintf("batch %d", i))
				if i == tc.batches-batchTailEvents/2 {
					tr.note(StepTransfer, "", "middle chain event")
				}
			}
			tr.note(StepTransfer, "", "STATUS Success sent")
			tl := tr.snapshot()
			if tl.Dropped != tc.dropped {
				t.Fatalf("Dropped %d, want %d", tl.Dropped, tc.dropped)
			}
			var got []string
			for _, e := range tl.Events {
				got = append(got, e.Detail)
			}
			var want []string
			want = append(want, "")
			for i := range tc.batches {
				if tc.dropped > 0 && i == tc.batches-batchTailEvents {
					want = append(want, fmt.Sprintf("%d batch events not kept", tc.dropped))
				}
				if tc.dropped == 0 || i < head || i >= tc.batches-batchTailEvents {
					want = append(want, fmt.Sprintf("batch %d", i))
				}
				if i == tc.batches-batchTailEvents/2 {
					want = append(want, "middle chain event")
				}
			}
			want = append(want, "STATUS Success sent")
			if strings.Join(got, "|") != strings.Join(want, "|") {
				t.Fatalf("events\n got %q\nwant %q", got, want)
			}
			if tc.dropped > 0 && !strings.Contains(tl.String(), fmt.Sprintf("(%d more events not kept)", tc.dropped)) {
				t.Fatalf("String() does not name the %d events left out: %s", tc.dropped, tl.String())
			}
		})
	}
}
