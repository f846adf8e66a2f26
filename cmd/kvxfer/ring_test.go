package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/internal/testenv"
)

// decodeReadyRing starts this test binary as `kvxfer decode` over the shm
// transport (so the ring is also registered for sharing by fd) with extra
// environment env, and returns its ready line's ring placement.
func decodeReadyRing(t *testing.T, env ...string) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "decode", "--model", "llama-3.1-8b", "--pool-mb", "8", "--transport", "shm", "--ring-slots", "16")
	cmd.Env = append(append(os.Environ(), "KVXFER_TEST_AS_CLI=1"), env...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr lockedBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	defer func() {
		stdin.Close() // EOF on stdin ends the rank
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("decode exited: %v\n%s", err, stderr.String())
			}
		case <-time.After(time.Minute):
			cmd.Process.Kill()
			t.Errorf("decode did not exit after stdin closed\n%s", stderr.String())
		}
	}()
	lines := make(chan replyLine, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		var r replyLine
		if sc.Scan() && json.Unmarshal(sc.Bytes(), &r) == nil {
			lines <- r
		}
		close(lines)
		for sc.Scan() {
		}
		done <- cmd.Wait()
	}()
	select {
	case r, ok := <-lines:
		if !ok || r.Event != readyEvent {
			t.Fatalf("decode gave no ready line (%+v)\n%s", r, stderr.String())
		}
		return r.Ring
	case <-time.After(time.Minute):
		cmd.Process.Kill()
		t.Fatalf("decode not ready within a minute\n%s", stderr.String())
	}
	return ""
}

// TestDecodeRingPlacement: the decode's metadata ring is GPU-visible when
// CUDA is present (here the fake CUDA libraries of cuda/testdata, built with
// gcc) and plain host memory otherwise, on the same code path, and both are
// accepted by the shm transport.
func TestDecodeRingPlacement(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	t.Run("no CUDA", func(t *testing.T) {
		if err := cuda.Available(); err == nil || !errors.Is(err, cuda.ErrNotSupported) {
			t.Skipf("CUDA is usable here (%v)", err)
		}
		if got := decodeReadyRing(t); got != "host" {
			t.Fatalf("ring = %q without CUDA, want host", got)
		}
	})
	t.Run("fake CUDA", func(t *testing.T) {
		if got := decodeReadyRing(t, fakeCUDAEnv(t)...); got != "gpu" {
			t.Fatalf("ring = %q with (fake) CUDA present, want gpu", got)
		}
	})
}

// fakeCUDAEnv builds the fake CUDA libraries of cuda/testdata with gcc and
// returns the environment that makes a kvxfer process load them. It skips
// without gcc.
func fakeCUDAEnv(t *testing.T) []string {
	t.Helper()
	return testenv.BuildFakeCUDA(t, nil, nil).Env()
}

// lockedBuffer is a bytes.Buffer safe for the exec copier goroutine and the test.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
