package main

import (
	"strings"
	"testing"
	"time"
)

// TestCLIDecodeRefusalReachesPrefill: a room the decode refuses on its own
// (a room larger than its KV pool; an unsupported PP pairing) fails on the
// prefill too, at once and naming the decode's reason, instead of holding
// the prefill's pages until its bootstrap timeout (60 s here; before: the
// decode failed in 0.4 s, the prefill after 61 s). The pair then serves the
// next room.
func TestCLIDecodeRefusalReachesPrefill(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	for _, tc := range []struct {
		name        string
		prefill     []string
		decode      []string
		tokens      int
		want        string
		thenServers bool // the next room succeeds
	}{
		{name: "room larger than the decode pool", prefill: []string{"--pool-mb", "160"}, decode: []string{"--pool-mb", "32"}, tokens: 1024,
			want: "raise --pool-mb", thenServers: true},
		{name: "unsupported PP pairing", decode: []string{"--pp-size", "2", "--pp-rank", "0"}, tokens: 16, want: "pp_size"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, b := startBootstrapProc(t, host, 0)
			long := []string{"--bootstrap-timeout", "60s", "--waiting-timeout", "60s"}
			p := startProc(t, "prefill", nil, roleArgs("prefill", b, host, append(tc.prefill, long...)...)...)
			d := startProc(t, "decode", nil, roleArgs("decode", b, host, append(tc.decode, long...)...)...)
			p.ready()
			d.ready()
			p.send(requestLine{Room: 70, Tokens: tc.tokens})
			d.send(requestLine{Room: 70, Tokens: tc.tokens})
			dr := d.result(time.Minute)
			start := time.Now()
			pr := p.result(2 * time.Minute)
			took := time.Since(start)
			agree(t, 70, pr, dr)
			if !strings.Contains(dr.Error, tc.want) {
				t.Fatalf("decode error %q: want it to name %q", dr.Error, tc.want)
			}
			if !strings.Contains(pr.Error, tc.want) || !strings.Contains(pr.Error, "aborted by decode") {
				t.Fatalf("prefill error %q: want the decode's abort naming %q", pr.Error, tc.want)
			}
			if took > 20*time.Second {
				t.Fatalf("the prefill failed %s after the decode: it waited for (most of) its 60 s bootstrap timeout", took)
			}
			t.Logf("prefill failed %s after the decode: %s", took.Round(time.Millisecond), pr.Error)
			if tc.thenServers {
				p.send(requestLine{Room: 71, Tokens: 16})
				d.send(requestLine{Room: 71, Tokens: 16})
				if pr, dr := p.result(time.Minute), d.result(time.Minute); !pr.OK || !dr.OK {
					t.Fatalf("room after the refusal: prefill %+v, decode %+v", pr, dr)
				}
			}
		})
	}
}
