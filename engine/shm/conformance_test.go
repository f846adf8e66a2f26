package shm

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"testing"

	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/engine/transporttest"
)

// TestConformance runs the engine's transport conformance suite against shm,
// with a receiver in a child process (this test binary re-executed, see
// TestMain) for the killed-peer case.
func TestConformance(t *testing.T) {
	newPair := func(t *testing.T) (transport.Transport, transport.Transport) {
		snd, err := New(transport.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		rcv, err := New(transport.DefaultOptions())
		if err != nil {
			snd.Close()
			t.Fatal(err)
		}
		return snd, rcv
	}
	transporttest.Run(t, newPair,
		transporttest.WithLargeBytes(256<<20),
		transporttest.WithRemotePeer(remoteReceiver))
}

// remoteReceiver starts the test binary as a receiver process with one region
// of regionBytes and returns its segment info and a SIGKILL function.
func remoteReceiver(t *testing.T, regionBytes int) (transport.SegmentInfo, func()) {
	t.Helper()
	return remoteReceiverEnv(t, regionBytes)
}

// remoteReceiverEnv is remoteReceiver with extra environment variables
// ("K=V") for the child (childCMAEnv: a cma receiver).
func remoteReceiverEnv(t *testing.T, regionBytes int, env ...string) (transport.SegmentInfo, func()) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), fmt.Sprintf("%s=%d", childEnv, regionBytes)), env...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start receiver process: %v", err)
	}
	var once sync.Once
	kill := func() {
		once.Do(func() {
			cmd.Process.Kill()
			cmd.Wait()
			stdin.Close()
		})
	}
	t.Cleanup(kill)
	var info childInfo
	if err := json.NewDecoder(out).Decode(&info); err != nil {
		kill()
		t.Fatalf("read receiver segment info: %v", err)
	}
	return transport.SegmentInfo{Endpoint: info.Endpoint, Regions: info.Regions}, kill
}
