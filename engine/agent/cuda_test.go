package agent_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/engine/agent"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/testenv"
)

// vramChild marks the test binary re-run with the fake CUDA libraries in
// its environment (the tcp transport picks its device copier at start-up).
const vramChild = "KVXFER_TEST_AGENT_VRAM_CHILD"

// TestVRAMFake: NIXL's VRAM path (vLLM's kv_buffer_device cuda) on the fake
// CUDA library: both agents register CUDA memory, the decode READs device
// blocks of the prefill into its own device memory over tcp.
func TestVRAMFake(t *testing.T) {
	testenv.InFakeCUDAProcess(t, vramChild, "TestVRAMFake", checkVRAM)
}

// TestVRAMGPU is the same on a real GPU (KVXFER_REQUIRE_GPU=1 makes a
// missing one a failure).
func TestVRAMGPU(t *testing.T) {
	testenv.RequireGPU(t)
	checkVRAM(t)
}

func checkVRAM(t *testing.T) {
	ctx := context.Background()
	p := newAgent(t, "prefill", openTransport(t, "tcp"))
	d := newAgent(t, "decode", openTransport(t, "tcp"))
	const n = numBlocks * blockLen
	dev := func(a *agent.Agent, fill bool) (cuda.DevicePtr, []agent.Desc) {
		ptr, err := cuda.Malloc(0, n)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cuda.Free(0, ptr) })
		src := make([]byte, n)
		if fill {
			for i := range src {
				src[i] = pattern(0, i/blockLen) + byte(i%7)
			}
		}
		if err := cuda.CopyToDevice(0, ptr, src); err != nil {
			t.Fatal(err)
		}
		if _, err := a.RegisterMemory([]transport.Memory{{Addr: uintptr(ptr), Length: n, Kind: transport.MemoryCUDA, Device: 0, FD: -1}}); err != nil {
			t.Fatal(err)
		}
		var ds []agent.Desc
		for b := 0; b < numBlocks; b++ {
			ds = append(ds, agent.Desc{Addr: uint64(ptr) + uint64(b*blockLen), Len: blockLen, Device: 0})
		}
		return ptr, ds
	}
	pp, pd := dev(p, true)
	dp, dd := dev(d, false)
	if _, err := d.AddRemoteAgent(ctx, p.Metadata()); err != nil {
		t.Fatal(err)
	}
	if _, err := d.PrepDlist(ctx, "", transport.MemoryHost, dd); err == nil {
		t.Fatal("device memory prepared as DRAM was accepted")
	}
	l, err := d.PrepDlist(ctx, "", transport.MemoryCUDA, dd)
	if err != nil {
		t.Fatal(err)
	}
	r, err := d.PrepDlist(ctx, "prefill", transport.MemoryCUDA, pd)
	if err != nil {
		t.Fatal(err)
	}
	x, err := d.MakeXfer(agent.OpRead, l, []int{0, 5}, r, []int{9, 2}, []byte("vram:1"))
	if err != nil {
		t.Fatal(err)
	}
	d.Post(x, nil)
	if st, err := waitState(t, d, x); st != agent.XferDone {
		t.Fatalf("VRAM read: %v %v", st, err)
	}
	waitNotif(t, p, "decode")
	got, want := make([]byte, n), make([]byte, n)
	if err := cuda.CopyFromDevice(0, got, dp); err != nil {
		t.Fatal(err)
	}
	if err := cuda.CopyFromDevice(0, want, pp); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[:blockLen], want[9*blockLen:10*blockLen]) || !bytes.Equal(got[5*blockLen:6*blockLen], want[2*blockLen:3*blockLen]) {
		t.Fatal("the decode's device blocks differ from the prefill's")
	}
	if got[blockLen] != 0 {
		t.Fatal("a device block that was not a destination was written")
	}
}
