package main

import (
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap"
)

// TestBootstrapAuthToken runs real processes against a directory that
// requires a bearer token: a prefill without the token stops at once with
// "the directory requires a token" naming the environment variable; with
// SGLang's variable it registers, a room transfers, and its clean exit
// deregisters with the token (the table empties).
func TestBootstrapAuthToken(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const token = "s3cret-token"
	noToken := []string{"KVXFER_BOOTSTRAP_AUTH_TOKEN=", "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN="}
	_, addr := startBootstrapProc(t, "127.0.0.1", 0, "KVXFER_BOOTSTRAP_AUTH_TOKEN="+token)

	bad := startProc(t, "prefill without token", noToken, roleArgs("prefill", addr, "127.0.0.1")...)
	start := time.Now()
	err := bad.wait(30 * time.Second)
	if exitCode(err) != 1 {
		t.Fatalf("prefill without token: exit %v, want status 1\n%s", err, bad.stderr.String())
	}
	msg := bad.stderr.String()
	if !strings.Contains(msg, "the directory requires a token") || !strings.Contains(msg, "KVXFER_BOOTSTRAP_AUTH_TOKEN") {
		t.Fatalf("prefill without token: stderr lacks the token hint:\n%s", msg)
	}
	t.Logf("prefill without token stopped after %s", time.Since(start).Round(time.Millisecond))

	pre := startProc(t, "prefill", append(noToken, "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN="+token), roleArgs("prefill", addr, "127.0.0.1")...)
	pre.ready()
	// The prefill has a token, so it authenticates control frames by
	// default (issue 22 case 4): a decode without the token is refused at
	// once, naming the token and the switch.
	plain := startProc(t, "decode without token", noToken, roleArgs("decode", addr, "127.0.0.1")...)
	plain.ready()
	start = time.Now()
	plain.send(requestLine{Room: 76, Tokens: 16})
	if r := plain.result(time.Minute); r.OK || !strings.Contains(r.Error, "authenticates control frames") || !strings.Contains(r.Error, "--control-auth=false") {
		t.Fatalf("decode without the token: %+v, want a refusal naming the token and --control-auth=false", r)
	} else {
		t.Logf("decode without the token refused %s after its request: %s", time.Since(start).Round(time.Millisecond), r.Error)
	}
	dec := startProc(t, "decode", append(noToken, "KVXFER_BOOTSTRAP_AUTH_TOKEN="+token), roleArgs("decode", addr, "127.0.0.1")...)
	dec.ready()
	q := requestLine{Room: 77, Tokens: 100}
	dec.send(q)
	pre.send(q)
	for _, p := range []*proc{pre, dec} {
		if r := p.result(time.Minute); !r.OK {
			t.Fatalf("%s: room 77 failed: %s", p.name, r.Error)
		}
	}
	if err := pre.exit(30 * time.Second); err != nil {
		t.Fatalf("prefill exit: %v\n%s", err, pre.stderr.String())
	}
	pollTable(t, addr, 10*time.Second, "the prefill's entry deregistered with the token", func(tab *bootstrap.TableSnapshot) bool {
		return tab.Registered == 0
	})
	if err := dec.exit(30 * time.Second); err != nil {
		t.Fatalf("decode exit: %v\n%s", err, dec.stderr.String())
	}
}
