package zrpc

import (
	"context"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// TestListenerServesAndCloses: a DEALER on loopback gets the reply the
// ServeFunc returns; a nil reply sends nothing; Close is idempotent.
func TestListenerServesAndCloses(t *testing.T) {
	zctx, err := zmq.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	defer zctx.Term()
	serve := func(frames [][]byte) [][]byte {
		if string(frames[0]) == "silent" {
			return nil
		}
		return append([][]byte{[]byte("re")}, frames...)
	}
	l, err := Listen(zctx, "127.0.0.1", 0, serve, ListenConfig{ErrPrefix: "test", LogPrefix: "test", MaxMessage: 1 << 20,
		BindHint: func(error) string { return "hint" }, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if l.Port <= 0 {
		t.Fatalf("Port = %d, want the bound port", l.Port)
	}
	s, err := NewDealer(zctx, "127.0.0.1", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Connect("tcp://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(l.Port))); err != nil {
		t.Fatal(err)
	}
	_ = s.SetRcvtimeo(10 * time.Second)
	// The silent request goes first: had it been answered, its reply
	// would arrive before the second one's.
	for _, req := range [][][]byte{{[]byte("silent")}, {[]byte("a"), []byte("b")}} {
		if err := Send(s, req); err != nil {
			t.Fatal(err)
		}
	}
	got, err := s.RecvMessageBytes(0)
	if err != nil {
		t.Fatalf("no reply: %v", err)
	}
	if len(got) != 3 || string(got[0]) != "re" || string(got[1]) != "a" || string(got[2]) != "b" {
		t.Fatalf("reply = %q, want [re a b]", got)
	}
	l.Close()
	l.Close()
}

// TestListenBindError: a port in use fails naming the prefix, the address
// and the hint.
func TestListenBindError(t *testing.T) {
	zctx, err := zmq.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	defer zctx.Term()
	cfg := ListenConfig{ErrPrefix: "test listener", LogPrefix: "test", MaxMessage: 1 << 20,
		BindHint: func(error) string { return "pick another port" }, Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	l, err := Listen(zctx, "127.0.0.1", 0, func([][]byte) [][]byte { return nil }, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, err = Listen(zctx, "127.0.0.1", l.Port, func([][]byte) [][]byte { return nil }, cfg)
	if err == nil {
		t.Fatal("second bind of one port succeeded")
	}
	want := "test listener: bind 127.0.0.1:" + strconv.Itoa(l.Port) + ": "
	if !strings.HasPrefix(err.Error(), want) || !strings.HasSuffix(err.Error(), "(pick another port)") {
		t.Fatalf("error %q, want prefix %q and the hint", err, want)
	}
}

func TestPollWaitAndTrunc4k(t *testing.T) {
	if w := PollWait(context.Background()); w != 50*time.Millisecond {
		t.Errorf("PollWait without deadline = %v, want 50ms", w)
	}
	ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	if w := PollWait(ctx); w != time.Millisecond {
		t.Errorf("PollWait past the deadline = %v, want 1ms", w)
	}
	if got := Trunc4k([]byte("short")); got != "short" {
		t.Errorf("Trunc4k(short) = %q", got)
	}
	if got := Trunc4k([]byte(strings.Repeat("x", 5000))); got != strings.Repeat("x", 4096)+"…" {
		t.Errorf("Trunc4k(5000 bytes) has %d bytes, want 4096 and …", len(got))
	}
}
