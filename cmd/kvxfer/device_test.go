package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/cuda"
)

// TestDemoDevicePools runs the demo with every rank's KV pool in (fake)
// device memory: the prefill fills and the decode verifies every byte and
// the CRC32C through host copies, and only tcp (which bounces device memory
// through pinned buffers) is used, even with --transport auto.
func TestDemoDevicePools(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	useFakeCUDA(t)
	for _, c := range []struct {
		name      string
		ptp, dtp  int
		transport string
	}{
		{"tp1-auto", 1, 1, "auto"},
		{"tp1-to-2-tcp", 1, 2, "tcp"},
	} {
		t.Run(c.name, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "out.json")
			f := &demoFlags{requests: 3, model: "llama-3.1-8b", prefillTP: c.ptp, prefillPP: 1, decodeTP: c.dtp, pageSize: 16,
				poolMB: 16, concurrency: 2, transport: c.transport, checksum: true, jsonOut: out, seed: 11,
				timeout: 60 * time.Second, noProgress: true, childLog: "warn", device: "cuda:0"}
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			if err := runDemo(ctx, f); err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(out)
			if err != nil {
				t.Fatal(err)
			}
			var got struct {
				Summary demoSummary `json:"summary"`
			}
			if err := json.Unmarshal(b, &got); err != nil {
				t.Fatal(err)
			}
			s := got.Summary
			if s.Requests != 3 || s.Verified != 3 || s.Failures != 0 || s.Bytes == 0 || strings.Join(s.Used, ",") != "tcp" {
				t.Fatalf("summary %+v; want 3 verified requests over tcp", s)
			}
		})
	}
}

// TestDeviceFlag: --device parsing, and a clear refusal when CUDA is absent
// or the named transport cannot move device memory.
func TestDeviceFlag(t *testing.T) {
	for _, c := range []struct {
		in     string
		dev    int
		on, ok bool
	}{
		{"", -1, false, true}, {"host", -1, false, true}, {"cuda:0", 0, true, true}, {"cuda:7", 7, true, true},
		{"cuda", 0, false, false}, {"cuda:-1", 0, false, false}, {"gpu0", 0, false, false}, {"cuda:x", 0, false, false},
	} {
		dev, on, err := parseDevice(c.in)
		if (err == nil) != c.ok || (c.ok && (dev != c.dev || on != c.on)) {
			t.Errorf("parseDevice(%q) = %d, %v, %v; want %d, %v, ok=%v", c.in, dev, on, err, c.dev, c.on, c.ok)
		}
		if err != nil && !strings.Contains(err.Error(), "cuda:N") {
			t.Errorf("parseDevice(%q) error %q does not say what to write", c.in, err)
		}
	}
	t.Run("no CUDA", func(t *testing.T) {
		if err := cuda.Available(); err == nil || !errors.Is(err, cuda.ErrNotSupported) {
			t.Skipf("CUDA is usable here (%v)", err)
		}
		f := &demoFlags{requests: 1, model: "llama-3.1-8b", prefillTP: 1, prefillPP: 1, decodeTP: 1, concurrency: 1, poolMB: 16, device: "cuda:0",
			pageSize: 16, timeout: time.Minute, transport: "auto", childLog: "warn"}
		err := runDemo(context.Background(), f)
		if err == nil || !strings.Contains(err.Error(), "CUDA is not usable") || !strings.Contains(err.Error(), "drop --device") {
			t.Fatalf("demo --device cuda:0 without CUDA = %v, want a clear refusal", err)
		}
	})
	t.Run("shm with device memory", func(t *testing.T) {
		ts, err := openTransports("shm", "127.0.0.1", "")
		if err != nil {
			t.Skip(err)
		}
		if _, err := deviceTransports(ts, "shm", "cuda:0"); err == nil || !strings.Contains(err.Error(), "shm cannot move device memory") {
			t.Fatalf("deviceTransports(shm) = %v, want a refusal naming shm", err)
		}
	})
}

// TestDemoLayerwiseDevicePools is scripts/gpu-check.sh's demo
// --layerwise --device cuda:0 step on the fake CUDA library: device-memory
// KV pools, both modes, every byte verified through host copies.
func TestDemoLayerwiseDevicePools(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	useFakeCUDA(t)
	f := &demoFlags{requests: 1, model: "llama-3.1-8b", prefillTP: 1, prefillPP: 1, decodeTP: 1, pageSize: 16, poolMB: 16, concurrency: 1,
		transport: "auto", jsonOut: filepath.Join(t.TempDir(), "out.json"), seed: 7, timeout: 60 * time.Second, noProgress: true, childLog: "warn", device: "cuda:0",
		lw: layerwiseFlags{on: true, tflops: 200, tokens: 64}}
	var got struct {
		Summary layerwiseSummary `json:"summary"`
	}
	runDemoJSON(t, f, &got)
	if s := got.Summary; s.Requests != 1 || s.Failures != 0 || s.Transport != "[tcp]" {
		t.Fatalf("summary %+v; want one request, both modes verified over tcp", s)
	}
}

// useFakeCUDA makes this test process and the ranks it starts use the fake
// CUDA libraries (their environment), as the CLI.
func useFakeCUDA(t *testing.T) {
	t.Helper()
	for _, kv := range fakeCUDAEnv(t) {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	t.Setenv("KVXFER_TEST_AS_CLI", "1")
	cuda.Close() // forget a cached "no CUDA" answer; load the fake libraries
	t.Cleanup(func() { cuda.Close() })
}
