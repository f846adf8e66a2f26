package main

import (
	"strings"
	"testing"
	"time"
)

// Layer-wise rooms between real `kvxfer prefill` and `kvxfer decode`
// processes, no --verify and no --checksum: the decode prints the SHA-256
// of each room's received KV (--digest) and the test compares it with the
// digest of the room's pattern (expectedDigest). (That each layer's writes
// follow its compute is the engine's tests' part: they write each layer's
// pattern just before sending it, and hold a CUDA stream before the copies.)

// TestCLILayerwise: layer-wise rooms (one chunk, and a chunked prefill of
// 4-page chunks × layers) and a whole-room room with the same compute
// model, between one prefill and one decode, then with prefill TP 2 →
// decode TP 1 (head slicing per layer): every byte right, both sides ok,
// the prefill's result carrying its compute interval and the decode's its
// Success time after it.
func TestCLILayerwise(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	t.Setenv("KVXFER_TEST_AS_CLI", "1")
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host, "--chunk-pages", "4")...)
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--digest")...)
	p.ready()
	d.ready()
	for i, c := range []struct {
		tokens    int
		layerwise bool
	}{{40, true}, {200, true}, {100, false}} {
		room := uint64(700 + i)
		p.send(requestLine{Room: room, Tokens: c.tokens, Layerwise: c.layerwise, LayerComputeUS: 300})
		d.send(requestLine{Room: room, Tokens: c.tokens})
		pr, dr := p.result(time.Minute), d.result(time.Minute)
		agree(t, room, pr, dr)
		if !dr.OK || dr.Digest != expectedDigest(t, room, c.tokens) {
			t.Fatalf("room %d (%d tokens, layer-wise %v): prefill %+v\ndecode %+v", room, c.tokens, c.layerwise, pr, dr)
		}
		if pr.Layerwise != c.layerwise || pr.ComputeStartUnixNS == 0 || pr.ComputeEndUnixNS < pr.ComputeStartUnixNS || dr.SuccessUnixNS < pr.ComputeEndUnixNS {
			t.Fatalf("room %d: compute %d…%d, decode Success %d, layerwise %v: want start <= end <= Success", room, pr.ComputeStartUnixNS, pr.ComputeEndUnixNS, dr.SuccessUnixNS, pr.Layerwise)
		}
	}

	// Prefill TP 2 → decode TP 1: each prefill rank sends its heads of
	// every layer, layer by layer; the decode's pages hold all heads.
	_, b2 := startBootstrapProc(t, host, 0)
	var ps []*proc
	for r := 0; r < 2; r++ {
		pp := startProc(t, "prefill tp"+string(rune('0'+r)), nil, roleArgs("prefill", b2, host, "--tp-size", "2", "--tp-rank", string(rune('0'+r)), "--chunk-pages", "3")...)
		pp.ready()
		ps = append(ps, pp)
	}
	d2 := startProc(t, "decode", nil, roleArgs("decode", b2, host, "--digest")...)
	d2.ready()
	const room = 710
	for _, pp := range ps {
		pp.send(requestLine{Room: room, Tokens: 96, Layerwise: true, LayerComputeUS: 200})
	}
	d2.send(requestLine{Room: room, Tokens: 96})
	dr := d2.result(time.Minute)
	for _, pp := range ps {
		agree(t, room, pp.result(time.Minute), dr)
	}
	if !dr.OK || dr.Digest != expectedDigest(t, room, 96) {
		t.Fatalf("TP 2 → 1 layer-wise room: %+v", dr)
	}
}

// TestCLILayerwiseFaults: faults between layers with real processes. A
// prefill killed (SIGKILL) once 3 layer-wise calls landed: the decode
// fails the room naming the lost peer, and its pages serve the next room
// from another prefill, byte for byte. A prefill that stops sending after 3
// layers (a stalled forward pass): the decode fails the room at its waiting
// timeout and the prefill reports the same room failed, aborted by the
// decode.
func TestCLILayerwiseFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	t.Setenv("KVXFER_TEST_AS_CLI", "1")
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	// The decode's pool holds one 256-token room (32 MiB of llama-3.1-8b),
	// so the next room reuses the failed room's pages: only after its
	// producer is fenced.
	d := startProc(t, "decode", nil, roleArgs("decode", b, host, "--pool-mb", "40", "--digest", "--waiting-timeout", "3s", "--peer-timeout", "3s", "--fence-timeout", "2s")...)
	killed := startProc(t, "prefill killed", nil, roleArgs("prefill", b, host, "--inject-exit-after-layers", "3")...)
	d.ready()
	killed.ready()
	const tokens = 256
	killed.send(requestLine{Room: 801, Tokens: tokens, Layerwise: true, LayerComputeUS: 500})
	d.send(requestLine{Room: 801, Tokens: tokens})
	dr := d.result(time.Minute)
	if dr.OK {
		t.Fatalf("room 801 succeeded on the decode although its prefill died after 3 layers: %+v", dr)
	}
	if err := killed.wait(30 * time.Second); err == nil || exitCode(err) != -1 {
		t.Fatalf("the prefill did not die by its signal: %v", err)
	}
	t.Logf("decode failed room 801 (prefill killed after 3 layers): %s", dr.Error)
	// A new prefill on the same directory; the room reuses 801's pages.
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host)...)
	p.ready()
	p.send(requestLine{Room: 802, Tokens: tokens, Layerwise: true, LayerComputeUS: 200})
	d.send(requestLine{Room: 802, Tokens: tokens})
	pr, dr := p.result(time.Minute), d.result(time.Minute)
	agree(t, 802, pr, dr)
	if !dr.OK || dr.Digest != expectedDigest(t, 802, tokens) {
		t.Fatalf("room after the killed prefill: prefill %+v\ndecode %+v", pr, dr)
	}

	_, b2 := startBootstrapProc(t, host, 0)
	stall := startProc(t, "prefill stalls", nil, roleArgs("prefill", b2, host, "--inject-stall-after-layers", "3")...)
	stall.ready()
	stall.send(requestLine{Room: 803, Tokens: tokens, Layerwise: true, LayerComputeUS: 200})
	d.send(requestLine{Room: 803, Tokens: tokens, Bootstrap: b2})
	dr = d.result(time.Minute)
	pr = stall.result(time.Minute)
	agree(t, 803, pr, dr)
	if !strings.Contains(pr.Error, "aborted by decode") || !strings.Contains(dr.Error, "no Success") {
		t.Fatalf("stalled prefill: prefill %q, decode %q; want the decode's waiting timeout on both", pr.Error, dr.Error)
	}
	// The decode's pages serve the next room, byte for byte.
	p.send(requestLine{Room: 805, Tokens: tokens})
	d.send(requestLine{Room: 805, Tokens: tokens})
	pr, dr = p.result(time.Minute), d.result(time.Minute)
	agree(t, 805, pr, dr)
	if !dr.OK || dr.Digest != expectedDigest(t, 805, tokens) {
		t.Fatalf("whole-room room after the stalls: %+v", dr)
	}
}
