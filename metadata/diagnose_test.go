package metadata_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/etcdtest"
	"github.com/kvxfer/kvxfer/metadata"
)

// wantAll fails unless err wraps ErrMetadataUnavailable and says every
// part of want.
func wantAll(t *testing.T, what string, err error, want ...string) {
	t.Helper()
	if !errors.Is(err, transport.ErrMetadataUnavailable) {
		t.Fatalf("%s: %v, want ErrMetadataUnavailable", what, err)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%s: %q does not say %q", what, err, w)
		}
	}
	t.Logf("%s: %v", what, err)
}

// TestQuorumLossSaysWhatHappened (issue 26 item 7): a three-member cluster
// with two members stopped. Opening it, and a request on a store opened
// before, fail with an error that says one of three endpoints answers but
// has no leader (quorum lost, two of three needed), names the stopped ones
// with "connection refused", and says what to do, instead of "unreachable
// or not answering … context deadline exceeded". Once a member is back the
// store works again.
func TestQuorumLossSaysWhatHappened(t *testing.T) {
	etcdtest.Require(t)
	c := etcdtest.Start(t, etcdtest.Options{Members: 3})
	url := c.URL("quorum")
	opts := metadata.Options{TTL: testTTL, Timeout: 2 * time.Second}
	before, err := metadata.Open(context.Background(), url, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer before.Close()
	c.Members[1].Kill()
	c.Members[2].Kill()
	live, dead1, dead2 := c.Members[0].Addr(), c.Members[1].Addr(), c.Members[2].Addr()
	want := []string{"1 of 3 endpoints answer (" + live + ")", "none has a raft leader", "lost quorum", "3 members and needs 2",
		"connection refused at " + dead1, "connection refused at " + dead2, "start the stopped members"}
	_, err = metadata.Open(context.Background(), url, opts)
	wantAll(t, "open", err, want...)
	if strings.Contains(err.Error(), "unreachable or not answering") {
		t.Errorf("open still says %q", "unreachable or not answering")
	}
	_, _, err = before.Resolve(context.Background(), "any")
	wantAll(t, "resolve on an open store", err, want...)

	if err := c.Members[1].Start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "requests work again with two of three members", func() bool {
		_, _, err := before.Resolve(context.Background(), "any")
		return errors.Is(err, transport.ErrSegmentNotFound)
	})
}

// TestPausedAndRefusedEndpoints: a paused member (SIGSTOP: it accepts
// connections and never answers) is named as such, and with nothing at all
// at an address the error says connection refused at it.
func TestPausedAndRefusedEndpoints(t *testing.T) {
	etcdtest.Require(t)
	c := etcdtest.Start(t, etcdtest.Options{})
	m := c.Members[0]
	if err := m.Pause(); err != nil {
		t.Fatal(err)
	}
	_, err := metadata.Open(context.Background(), c.URL("paused"), metadata.Options{Timeout: time.Second})
	if rerr := m.Resume(); rerr != nil {
		t.Fatal(rerr)
	}
	wantAll(t, "paused member", err, "no endpoint answers", m.Addr()+" accepts connections but did not answer", "paused (SIGSTOP)", "resume or restart that member")
	m.Kill()
	_, err = metadata.Open(context.Background(), c.URL("refused"), metadata.Options{Timeout: time.Second})
	wantAll(t, "stopped member", err, "connection refused at "+m.Addr(), "start etcd")
}
