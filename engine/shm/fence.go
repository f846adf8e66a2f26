package shm

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// Fencing (transport.Fencer) and deregistration with copies in flight.
//
// A receiver cannot revoke a mapping a sender made of its memory, so shm
// fences cooperatively, through the control memfd both sides map:
//
//   - Every segment claims a sender slot in the receiver's control memfd
//     (its epoch, pid and start time, a fenced flag, a phase word and two
//     in-flight counters) and gives it back at Close.
//   - A sender copies in units of at most 1 MiB into one region. For each
//     unit it reads its slot's phase p, increments counter p, and only then
//     checks its fenced flag and the region's control slot (length 0 =
//     deregistered); it copies if both allow it, and decrements counter p.
//   - To fence an epoch the receiver withdraws its admission, sets the
//     fenced flag of every slot of that epoch, flips the slot's phase and
//     waits until the old phase's counter is zero, or the slot's sender has
//     exited (pid and start time no longer match). Deregistration sets the
//     region's length to 0 and does the same for every claimed slot.
//     Because every access is a sequentially consistent atomic, a unit that
//     started before the flag or length was set is counted on the old phase
//     and waited for, and a unit counted after the flip sees the flag or
//     length: when the wait ends, nothing more lands.
//   - A sender stopped (SIGSTOP) in the middle of a unit keeps the old
//     counter up: the wait ends only when it is continued (it finishes at
//     most that unit, then sees the flag) or exits. FenceEpoch and
//     DeregisterMemory are bounded (ctx, deregisterWait); their error names
//     the pid, and the memory stays quarantined until a later call succeeds.
//   - A segment opened with a non-zero epoch checks, after publishing its
//     epoch in its slot, that the receiver admitted the epoch (AdmitEpoch);
//     a fenced or unknown epoch is refused with transport.ErrFenced. Epoch 0
//     (raw transport users) is never checked.

// Control memfd layout (8-byte words) after the region slots.
const (
	// admitSlots epochs can be admitted at once (0 = free entry).
	admitSlots = 4096
	ctlAdmit   = ctlSlots + 2*MaxRegions

	// sendSlots senders can have a segment open to one receiver at once;
	// each slot is sendWords words (one cache line).
	sendSlots = 1024
	sendWords = 8
	ctlSend   = ctlAdmit + admitSlots

	// word offsets inside a sender slot
	sState    = 0 // slotFree, slotUsed, slotClaiming
	sEpoch    = 1
	sPID      = 2
	sStart    = 3 // start time (clock ticks since boot) of that pid
	sFenced   = 4
	sPhase    = 5
	sCount0   = 6 // units in flight counted on phase 0
	sCount1   = 7 // … on phase 1
	slotFree  = 0
	slotUsed  = 1
	slotClaim = 2
)

// deregisterWait bounds how long DeregisterMemory waits for a sender's copy
// in progress into the region (a copy unit is at most 1 MiB: milliseconds,
// unless the sender process is stopped).
const deregisterWait = 10 * time.Second

// slot returns the words of sender slot i in the control memfd ctl.
func slotWords(ctl []uint64, i int) []uint64 {
	base := ctlSend + i*sendWords
	return ctl[base : base+sendWords : base+sendWords]
}

// senderAlive reports whether the process pid with start time start runs.
func senderAlive(pid, start uint64) bool {
	if pid == 0 {
		return false
	}
	st, err := procStartTime(int(pid))
	return err == nil && st == start
}

// claimSlot claims a sender slot in the receiver's control memfd for this
// process, reclaiming one whose sender exited when none is free, and
// publishes epoch in it. It returns the slot index.
func claimSlot(ctl []uint64, pid, start, epoch uint64) (int, error) {
	init := func(w []uint64) {
		atomic.StoreUint64(&w[sPID], pid)
		atomic.StoreUint64(&w[sStart], start)
		atomic.StoreUint64(&w[sFenced], 0)
		atomic.StoreUint64(&w[sPhase], 0)
		atomic.StoreUint64(&w[sCount0], 0)
		atomic.StoreUint64(&w[sCount1], 0)
		atomic.StoreUint64(&w[sEpoch], epoch)
		atomic.StoreUint64(&w[sState], slotUsed)
	}
	for i := 0; i < sendSlots; i++ {
		w := slotWords(ctl, i)
		if atomic.CompareAndSwapUint64(&w[sState], slotFree, slotClaim) {
			init(w)
			return i, nil
		}
	}
	for i := 0; i < sendSlots; i++ {
		w := slotWords(ctl, i)
		if atomic.LoadUint64(&w[sState]) == slotUsed && !senderAlive(atomic.LoadUint64(&w[sPID]), atomic.LoadUint64(&w[sStart])) &&
			atomic.CompareAndSwapUint64(&w[sState], slotUsed, slotClaim) {
			init(w)
			return i, nil
		}
	}
	return 0, fmt.Errorf("all %d sender slots of the receiver are in use by live senders (close unused segments)", sendSlots)
}

// releaseSlot gives a sender slot back (no copy of this segment runs).
func releaseSlot(ctl []uint64, i int) {
	w := slotWords(ctl, i)
	atomic.StoreUint64(&w[sEpoch], 0)
	atomic.StoreUint64(&w[sState], slotFree)
}

// admitted reports whether epoch is in the receiver's admission table.
func admitted(ctl []uint64, epoch uint64) bool {
	for i := 0; i < admitSlots; i++ {
		if atomic.LoadUint64(&ctl[ctlAdmit+i]) == epoch {
			return true
		}
	}
	return false
}

// enter starts one copy unit into region id on sender slot w: it counts the
// unit on the slot's current phase, then checks the fenced flag and the
// region. It returns the phase to pass to leave, or an error wrapping
// transport.ErrFenced (and ErrPeerLost) or transport.ErrUnknownRegion; then the
// unit is not counted. A receiver that closed its transport (which also
// clears every region) is reported as transport.ErrPeerLost.
func (s *segment) enter(id transport.RegionID) (uint64, error) {
	w := s.slot
	ph := atomic.LoadUint64(&w[sPhase]) & 1
	atomic.AddUint64(&w[sCount0+ph], 1)
	switch {
	case atomic.LoadUint64(&w[sFenced]) != 0:
		atomic.AddUint64(&w[sCount0+ph], ^uint64(0))
		return 0, fmt.Errorf("%s: receiver pid %d fenced this segment (epoch %d): %w: %w", s.t.Name(), s.peer.PID, s.epoch, transport.ErrFenced, transport.ErrPeerLost)
	case atomic.LoadUint64(&s.ctlWord[ctlState]) != stateOpen:
		atomic.AddUint64(&w[sCount0+ph], ^uint64(0))
		return 0, fmt.Errorf("%s: receiver pid %d closed its transport during the batch: %w", s.t.Name(), s.peer.PID, transport.ErrPeerLost)
	case atomic.LoadUint64(&s.ctlWord[ctlSlots+2*int(id)]) == 0:
		atomic.AddUint64(&w[sCount0+ph], ^uint64(0))
		return 0, fmt.Errorf("%s: remote region %d was deregistered by receiver pid %d during the batch: %w", s.t.Name(), id, s.peer.PID, transport.ErrUnknownRegion)
	}
	return ph, nil
}

// leave ends a copy unit started by enter.
func (s *segment) leave(ph uint64) { atomic.AddUint64(&s.slot[sCount0+ph], ^uint64(0)) }

// quiesceSlot flips sender slot i's phase and waits until no copy unit
// counted on the old phase is in flight, the slot is given back, or its
// sender exited. Callers have set the fenced flag or cleared a region's
// length first. Errors: ctx ended (naming the pid of the sender still
// copying).
func (t *shmTransport) quiesceSlot(ctx context.Context, i int) error {
	mu := &t.slotMu[i]
	mu.Lock()
	defer mu.Unlock()
	w := slotWords(t.ctlWord, i)
	if atomic.LoadUint64(&w[sState]) == slotFree {
		return nil
	}
	old := atomic.LoadUint64(&w[sPhase]) & 1
	atomic.StoreUint64(&w[sPhase], old^1)
	pid, start := atomic.LoadUint64(&w[sPID]), atomic.LoadUint64(&w[sStart])
	pause := 20 * time.Microsecond
	for {
		if atomic.LoadUint64(&w[sCount0+old]) == 0 || atomic.LoadUint64(&w[sState]) == slotFree ||
			atomic.LoadUint64(&w[sPID]) != pid || !senderAlive(pid, start) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: sender pid %d is still in the middle of a copy into this receiver's memory (stopped?): %w", t.Name(), pid, ctx.Err())
		case <-time.After(pause):
		}
		pause = min(2*pause, 10*time.Millisecond)
	}
}

// quiesce runs quiesceSlot for the slots that match (all claimed slots when
// match is nil) and joins the errors.
func (t *shmTransport) quiesce(ctx context.Context, match func(w []uint64) bool) error {
	var errs []error
	for i := 0; i < sendSlots; i++ {
		w := slotWords(t.ctlWord, i)
		if atomic.LoadUint64(&w[sState]) == slotFree || (match != nil && !match(w)) {
			continue
		}
		if err := t.quiesceSlot(ctx, i); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// AdmitEpoch lets segments opened with epoch (>= 1) write until
// FenceEpoch(epoch). Errors: epoch 0, a closed transport, more than 4,096
// epochs admitted at once.
func (t *shmTransport) AdmitEpoch(peer string, epoch uint64) error {
	if epoch == 0 {
		return fmt.Errorf("%s: admit epoch 0 for %q: epochs start at 1 (0 means no epoch)", t.Name(), peer)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return fmt.Errorf("%s: admit epoch %d: transport %w", t.Name(), epoch, transport.ErrClosed)
	}
	if _, ok := t.admitted[epoch]; ok {
		return nil
	}
	for i := 0; i < admitSlots; i++ {
		if atomic.LoadUint64(&t.ctlWord[ctlAdmit+i]) == 0 {
			atomic.StoreUint64(&t.ctlWord[ctlAdmit+i], epoch)
			t.admitted[epoch] = i
			return nil
		}
	}
	return fmt.Errorf("%s: admit epoch %d for %q: all %d admission entries in use (fence unused epochs)", t.Name(), epoch, peer, admitSlots)
}

// FenceEpoch withdraws epoch's admission (segments opened with it later are
// refused), flags every sender slot of that epoch fenced and waits until
// none of those senders has a copy in progress (or it exited). A sender
// stopped in the middle of a copy makes it wait until ctx ends; the error
// then names its pid, and the caller keeps the memory quarantined and calls
// again.
func (t *shmTransport) FenceEpoch(ctx context.Context, peer string, epoch uint64) error {
	if epoch == 0 {
		return nil
	}
	t.ctlRW.RLock() // Close unmaps the control memfd only after this
	defer t.ctlRW.RUnlock()
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil // Close deregistered every region and waited for copies
	}
	if i, ok := t.admitted[epoch]; ok {
		atomic.StoreUint64(&t.ctlWord[ctlAdmit+i], 0)
		delete(t.admitted, epoch)
	}
	ctl := t.ctlWord
	t.mu.Unlock()
	for i := 0; i < sendSlots; i++ {
		w := slotWords(ctl, i)
		if atomic.LoadUint64(&w[sState]) != slotFree && atomic.LoadUint64(&w[sEpoch]) == epoch {
			atomic.StoreUint64(&w[sFenced], 1)
		}
	}
	err := t.quiesce(ctx, func(w []uint64) bool { return atomic.LoadUint64(&w[sEpoch]) == epoch })
	if err != nil {
		return fmt.Errorf("%s: fence epoch %d (%s): %w", t.Name(), epoch, peer, err)
	}
	return nil
}
