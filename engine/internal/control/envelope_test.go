package control

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestControlEnvelope: SealControl/OpenControl round trip with and without a
// key, and every way a frame is refused: altered body or envelope, another
// token, a missing tag where one is required, a send time outside
// ReplayWindow, a malformed envelope.
func TestControlEnvelope(t *testing.T) {
	key, other := ControlKey("deployment-secret"), ControlKey("another")
	if ControlKey("") != nil || bytes.Equal(key, other) || len(key) != 32 {
		t.Fatalf("ControlKey: %x %x", key, other)
	}
	now := time.Unix(1_800_000_000, 123_000_000)
	body := (&TransferMsg{Attempt: 3, Room: 7, Endpoint: "tcp://10.0.0.1:5555", Pages: []int32{1, 2}, Slot: 3, Generation: 1, RequiredDstInfoNum: 1, Epoch: 9, AuxIndex: -1}).Encode()
	open := func(parts [][]byte, key []byte, at time.Time) (Envelope, error) {
		got, env, err := OpenControl(parts, key, at)
		if err == nil && !reflect.DeepEqual(got, body) {
			t.Fatalf("opened body differs: %q", got)
		}
		return env, err
	}
	sealed := SealControl(body, "inst-a", 42, 17, now, key)
	if len(sealed) != len(body)+5 || len(body) != 16 {
		t.Fatalf("sealed %d frames from %d", len(sealed), len(body))
	}
	env, err := open(sealed, key, now.Add(time.Second))
	if err != nil || env.Instance != "inst-a" || env.Epoch != 42 || env.Seq != 17 || !env.SentAt.Equal(now.Truncate(time.Millisecond)) || !env.Authenticated {
		t.Fatalf("open with the key: %+v %v", env, err)
	}
	if env, err := open(sealed, nil, now); err != nil || env.Authenticated || env.Instance != "inst-a" {
		t.Fatalf("a rank without a key accepts a tagged frame unchecked: %+v %v", env, err)
	}
	plain := SealControl(body, "inst-b", 0, 1, now, nil)
	if env, err := open(plain, nil, now); err != nil || env.Instance != "inst-b" {
		t.Fatalf("untagged, no key: %+v %v", env, err)
	}
	alter := func(i int, b []byte) [][]byte {
		c := append([][]byte(nil), sealed...)
		c[i] = b
		return c
	}
	for _, tc := range []struct {
		name  string
		parts [][]byte
		key   []byte
		at    time.Time
		want  error
		text  string
	}{
		{"no tag, key required", plain, key, now, ErrUnauthenticated, "carries no tag"},
		{"another token", sealed, other, now, ErrUnauthenticated, "does not verify"},
		{"body altered", alter(3, []byte("8")), key, now, ErrUnauthenticated, "does not verify"},
		{"instance altered", alter(len(sealed)-5, []byte("inst-x")), key, now, ErrUnauthenticated, "does not verify"},
		{"epoch altered", alter(len(sealed)-4, []byte("43")), key, now, ErrUnauthenticated, "does not verify"},
		{"time altered", alter(len(sealed)-3, []byte("1800000000124")), key, now, ErrUnauthenticated, "does not verify"},
		{"sequence altered", alter(len(sealed)-2, []byte("18")), key, now, ErrUnauthenticated, "does not verify"},
		{"replayed late", sealed, key, now.Add(ReplayWindow + time.Second), ErrUnauthenticated, "a replay, or clocks apart"},
		{"from the future", sealed, key, now.Add(-ReplayWindow - time.Second), ErrUnauthenticated, "a replay, or clocks apart"},
		{"short tag", alter(len(sealed)-1, []byte{1, 2}), nil, now, ErrBadFrame, "tag of 2 bytes"},
		{"bad instance", alter(len(sealed)-5, []byte("a b")), nil, now, ErrBadFrame, "sender instance id"},
		{"empty instance", alter(len(sealed)-5, nil), nil, now, ErrBadFrame, "sender instance id"},
		{"bad epoch", alter(len(sealed)-4, []byte("042")), nil, now, ErrBadFrame, "sender epoch"},
		{"signed time", alter(len(sealed)-3, []byte("+1800000000123")), nil, now, ErrBadFrame, "send time"},
		{"bad time", alter(len(sealed)-3, []byte("-5")), nil, now, ErrBadFrame, "send time"},
		{"bad sequence", alter(len(sealed)-2, []byte("017")), nil, now, ErrBadFrame, "sequence"},
		{"signed sequence", alter(len(sealed)-2, []byte("-1")), nil, now, ErrBadFrame, "sequence"},
		{"no envelope", (&PingMsg{Endpoint: "e"}).Encode(), nil, now, ErrBadFrame, "no room for the envelope"},
		{"not kvxfer", [][]byte{[]byte("HELLO"), []byte("5"), []byte("PING"), []byte("e"), []byte("i"), []byte("1"), []byte("1"), []byte("1"), nil}, nil, now, ErrBadFrame, "not a kvxfer peer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := open(tc.parts, tc.key, tc.at)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.text) {
				t.Fatalf("err %v, want %v naming %q", err, tc.want, tc.text)
			}
		})
	}
}

// FuzzOpenControl: OpenControl never panics, its errors wrap ErrBadFrame or
// ErrUnauthenticated, and what it accepts with a key re-seals to the same
// frames.
func FuzzOpenControl(f *testing.F) {
	key := ControlKey("t")
	at := time.UnixMilli(1_800_000_000_000)
	for _, m := range []interface{ Encode() [][]byte }{
		&PingMsg{Endpoint: "tcp://h:1"},
		&AbortMsg{Room: 1, Endpoint: "e", Reason: "r", Epoch: 4},
		sampleRegister(),
	} {
		f.Add(bytes.Join(SealControl(m.Encode(), "inst", 7, 3, at, key), []byte{0}), true)
		f.Add(bytes.Join(SealControl(m.Encode(), "inst", 0, 1, at, nil), []byte{0}), false)
	}
	f.Fuzz(func(t *testing.T, data []byte, keyed bool) {
		parts := bytes.Split(data, []byte{0})
		k := key
		if !keyed {
			k = nil
		}
		body, env, err := OpenControl(parts, k, at)
		if err != nil {
			if !errors.Is(err, ErrBadFrame) && !errors.Is(err, ErrUnauthenticated) {
				t.Fatalf("error wraps neither ErrBadFrame nor ErrUnauthenticated: %v", err)
			}
			return
		}
		if keyed {
			again := SealControl(body, env.Instance, env.Epoch, env.Seq, env.SentAt, k)
			if !reflect.DeepEqual(again, parts) {
				t.Fatalf("re-sealed frames differ: %q vs %q", again, parts)
			}
		}
	})
}

// BenchmarkControlEnvelope: sealing and opening a TRANSFER of 64 pages with
// and without the tag (go test -bench ControlEnvelope ./engine).
func BenchmarkControlEnvelope(b *testing.B) {
	pages := make([]int32, 64)
	body := (&TransferMsg{Attempt: 3, Room: 7, Endpoint: "tcp://10.0.0.1:5555", Pages: pages, Slot: 3, Generation: 1, RequiredDstInfoNum: 1, Epoch: 9, AuxIndex: -1}).Encode()
	for _, c := range []struct {
		name string
		key  []byte
	}{{"untagged", nil}, {"hmac", ControlKey("t")}} {
		b.Run(c.name, func(b *testing.B) {
			now := time.Now()
			for b.Loop() {
				if _, _, err := OpenControl(SealControl(body, "inst", 1, 1, now, c.key), c.key, now); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestReplayGuard: each sender's sequence numbers are accepted once; a
// repeat, or one older than the window, is ErrReplayed; reordering within
// the window is accepted; senders are bounded, and a forgotten sender's old
// frames stay refused (the floor).
func TestReplayGuard(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	env := func(inst string, epoch, seq uint64, at time.Time) Envelope {
		return Envelope{Instance: inst, Epoch: epoch, Seq: seq, SentAt: at, Authenticated: true}
	}
	g := &ReplayGuard{}
	steps := []struct {
		inst  string
		epoch uint64
		seq   uint64
		ok    bool
	}{
		{"a", 1, 5, true},
		{"a", 1, 5, false},  // replayed
		{"a", 1, 7, true},   // a gap: 6 went elsewhere or comes late
		{"a", 1, 6, true},   // late, within the window
		{"a", 1, 6, false},  // replayed
		{"a", 1, 4, true},   // never seen, within the window
		{"a", 2, 5, true},   // another epoch is another sender
		{"b", 1, 5, true},   // another instance too
		{"a", 1, 200, true}, // a jump
		{"a", 1, 7, false},  // now older than the window
		{"a", 1, 200 - replayWindowFrames, true},
		{"a", 1, 200 - replayWindowFrames - 1, false},
		{"a", 1, 0, false}, // not numbered
	}
	for i, s := range steps {
		err := g.Check(env(s.inst, s.epoch, s.seq, now), now)
		if (err == nil) != s.ok || (err != nil && !errors.Is(err, ErrReplayed)) {
			t.Fatalf("step %d (%s epoch %d seq %d): %v, want ok=%v", i, s.inst, s.epoch, s.seq, err, s.ok)
		}
	}
	// Bounded: with room for 2 senders, a third forgets the least recently
	// heard one, whose old frames then meet the floor.
	g = &ReplayGuard{max: 2}
	for i, inst := range []string{"x", "y", "z"} {
		if err := g.Check(env(inst, 1, 1, now.Add(time.Duration(i)*time.Second)), now.Add(time.Duration(i)*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	if len(g.senders) != 2 || g.senders[PeerID{"x", 1}] != nil {
		t.Fatalf("senders %v, want y and z", g.senders)
	}
	if err := g.Check(env("x", 1, 1, now), now.Add(3*time.Second)); !errors.Is(err, ErrReplayed) || !strings.Contains(err.Error(), "forgot") {
		t.Fatalf("the forgotten sender's frame again: %v, want refused at the floor", err)
	}
	if err := g.Check(env("x", 1, 2, now.Add(3*time.Second)), now.Add(3*time.Second)); err != nil {
		t.Fatalf("the forgotten sender's next frame: %v", err)
	}
	// A sender silent for 2 x ReplayWindow is forgotten without a floor.
	later := now.Add(3 * ReplayWindow)
	floor := g.floor
	if err := g.Check(env("w", 1, 1, later), later); err != nil || !g.floor.Equal(floor) {
		t.Fatalf("after silence: %v, floor %v (was %v)", err, g.floor, floor)
	}
}
