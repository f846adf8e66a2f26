package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
)

func TestParseRequest(t *testing.T) {
	cases := []struct {
		line    string
		role    engine.Role
		want    requestLine
		hasRoom bool
		errHas  string // "" = valid
	}{
		{`{"room":0,"tokens":1}`, engine.RoleDecode, requestLine{Room: 0, Tokens: 1}, true, ""},
		{`{"room":9223372036854775807,"tokens":5,"bootstrap":"h:1"}`, engine.RoleDecode, requestLine{Room: 1<<63 - 1, Tokens: 5, Bootstrap: "h:1"}, true, ""},
		{`{"room":60,"tokens":0}`, engine.RoleDecode, requestLine{Room: 60}, true, `"tokens" 0`},
		{`{"room":60,"tokens":-1}`, engine.RolePrefill, requestLine{Room: 60}, true, `"tokens" -1`},
		{`{"room":60,"tokens":1.5}`, engine.RolePrefill, requestLine{Room: 60}, true, `"tokens" 1.5`},
		{`{"room":60}`, engine.RolePrefill, requestLine{Room: 60}, true, `missing "tokens"`},
		{`{"tokens":5}`, engine.RoleDecode, requestLine{}, false, `missing "room"`},
		{`{"room":-3,"tokens":5}`, engine.RoleDecode, requestLine{}, false, `"room" -3`},
		{`{"room":9223372036854775808,"tokens":5}`, engine.RoleDecode, requestLine{}, false, `"room" 9223372036854775808`},
		{`{"room":"7","tokens":5}`, engine.RoleDecode, requestLine{}, false, `"room" "7"`},
		{`{"room":null,"tokens":5}`, engine.RoleDecode, requestLine{}, false, `"room" null`},
		{` { "room" : 3 , "tokens" :	8 } `, engine.RolePrefill, requestLine{Room: 3, Tokens: 8}, true, ""},
		{`{"room":1,"tokens":5,"tokenz":1}`, engine.RoleDecode, requestLine{}, false, `unknown field "tokenz"`},
		{`{"room":1,"tokens":5} {"room":2}`, engine.RoleDecode, requestLine{}, false, "text after"},
		{`garbage`, engine.RoleDecode, requestLine{}, false, "not JSON (invalid at byte 1"},
		{`not json`, engine.RolePrefill, requestLine{}, false, "not JSON"},
		{`[1,2]`, engine.RolePrefill, requestLine{}, false, "a JSON array, not an object"},
		{`null`, engine.RoleDecode, requestLine{}, false, "a JSON null, not an object: a request line must be one JSON object"},
		{` null `, engine.RolePrefill, requestLine{}, false, "a JSON null, not an object"},
		{`"room"`, engine.RolePrefill, requestLine{}, false, "a JSON string, not an object"},
		{`{"room":1,"tokens":5,"bootstrap":"h:1"}`, engine.RolePrefill, requestLine{Room: 1, Tokens: 5}, true, "decode request field"},
		{`{"room":1,"tokens":5,"bootstrap":""}`, engine.RoleDecode, requestLine{Room: 1, Tokens: 5}, true, "empty"},
		{`{"room":1,"tokens":1100,"hash_ids":[0,4,9]}`, engine.RoleDecode, requestLine{Room: 1, Tokens: 1100, HashIDs: []int64{0, 4, 9}}, true, ""},
		{`{"room":1,"tokens":1100,"hash_ids":[0,4,9]}`, engine.RolePrefill, requestLine{Room: 1, Tokens: 1100, HashIDs: []int64{0, 4, 9}}, true, ""},
		{`{"room":1,"tokens":5,"hash_ids":["a"]}`, engine.RoleDecode, requestLine{}, false, `"hash_ids" is a JSON string`},
		{`{"room":1,"tokens":64,"layerwise":true,"layer_compute_us":250}`, engine.RolePrefill, requestLine{Room: 1, Tokens: 64, Layerwise: true, LayerComputeUS: 250}, true, ""},
		{`{"room":1,"tokens":64,"layer_compute_us":250}`, engine.RolePrefill, requestLine{Room: 1, Tokens: 64, LayerComputeUS: 250}, true, ""},
		{`{"room":1,"tokens":64,"layerwise":true}`, engine.RoleDecode, requestLine{Room: 1, Tokens: 64}, true, "prefill request fields"},
		{`{"room":1,"tokens":64,"layer_compute_us":-1}`, engine.RolePrefill, requestLine{Room: 1, Tokens: 64}, true, `"layer_compute_us" -1`},
		{`{"room":1,"tokens":64,"layerwise":1}`, engine.RolePrefill, requestLine{}, false, `"layerwise" is a JSON number`},
		{`{"room":1,"tokens":64,"pattern_room":77}`, engine.RolePrefill, requestLine{Room: 1, Tokens: 64, PatternRoom: new(uint64(77))}, true, ""},
		{`{"room":1,"tokens":64,"pattern_room":77}`, engine.RoleDecode, requestLine{Room: 1, Tokens: 64}, true, "prefill request field"},
		{`{"room":1,"tokens":64,"pattern_room":-1}`, engine.RolePrefill, requestLine{Room: 1, Tokens: 64}, true, `"pattern_room" -1`},
		{`{"room":1,"tokens":64,"pattern_room":9223372036854775808}`, engine.RolePrefill, requestLine{Room: 1, Tokens: 64}, true, `"pattern_room" 9223372036854775808`},
	}
	for _, c := range cases {
		q, hasRoom, err := parseRequest(c.line, c.role)
		if c.errHas == "" {
			if err != nil || !reflect.DeepEqual(q, c.want) || !hasRoom {
				t.Errorf("%s: got %+v %v %v, want %+v", c.line, q, hasRoom, err, c.want)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), c.errHas) || strings.Contains(err.Error(), "<nil>") {
			t.Errorf("%s: err %v, want one containing %q", c.line, err, c.errHas)
		}
		if hasRoom != c.hasRoom || (hasRoom && q.Room != c.want.Room) {
			t.Errorf("%s: hasRoom %v room %d, want %v %d", c.line, hasRoom, q.Room, c.hasRoom, c.want.Room)
		}
	}
}

// TestParseRequestUnknownKeyListsAccepted: a line with an unknown key is
// told every key its role accepts (the decode's "hash_ids" included), and
// each key listed is one the role really takes.
func TestParseRequestUnknownKeyListsAccepted(t *testing.T) {
	for _, c := range []struct {
		role   engine.Role
		want   []string
		absent []string
	}{
		{engine.RoleDecode, []string{`"room"`, `"tokens"`, `"bootstrap"`, `"hash_ids"`}, []string{`"layerwise"`, `"pattern_room"`}},
		{engine.RolePrefill, []string{`"room"`, `"tokens"`, `"hash_ids"`, `"layerwise"`, `"layer_compute_us"`, `"pattern_room"`}, []string{`"bootstrap"`}},
	} {
		_, _, err := parseRequest(`{"room":1,"tokens":5,"tokenz":1}`, c.role)
		if err == nil {
			t.Fatalf("%v: a line with key \"tokenz\" was accepted", c.role)
		}
		msg := err.Error()
		if !strings.Contains(msg, `unknown field "tokenz"`) {
			t.Errorf("%v: %q does not name the unknown key", c.role, msg)
		}
		for _, k := range c.want {
			if !strings.Contains(msg, k) {
				t.Errorf("%v: %q does not list the accepted key %s", c.role, msg, k)
			}
		}
		for _, k := range c.absent {
			if strings.Contains(msg, k) {
				t.Errorf("%v: %q lists %s, a key this role refuses", c.role, msg, k)
			}
		}
		values := map[string]string{`"bootstrap"`: `"h:1"`, `"hash_ids"`: `[1]`, `"layerwise"`: `true`, `"layer_compute_us"`: `1`, `"pattern_room"`: `2`}
		for _, k := range requestKeys(c.role) {
			if k == `"room"` || k == `"tokens"` {
				continue
			}
			line := fmt.Sprintf(`{"room":1,"tokens":5,%s:%s}`, k, values[k])
			if _, _, err := parseRequest(line, c.role); err != nil {
				t.Errorf("%v: listed key %s refused: %s: %v", c.role, k, line, err)
			}
		}
	}
}

func TestValidateRoleFlags(t *testing.T) {
	good := func() roleFlags {
		return roleFlags{pageSize: 16, kvDtype: "auto", bootstrapTimeout: time.Second, waitingTimeout: time.Second, peerTimeout: time.Second, auxRows: 8, drainTimeout: time.Second}
	}
	cases := []struct {
		name   string
		mod    func(*roleFlags)
		errHas string
	}{
		{"defaults", func(*roleFlags) {}, ""},
		{"fp8", func(f *roleFlags) { f.kvDtype = "fp8_e4m3" }, ""},
		{"page 0", func(f *roleFlags) { f.pageSize = 0 }, "--page-size 0"},
		{"page -4", func(f *roleFlags) { f.pageSize = -4 }, "--page-size -4"},
		{"dtype empty", func(f *roleFlags) { f.kvDtype = "" }, `--kv-cache-dtype ""`},
		{"dtype bogus", func(f *roleFlags) { f.kvDtype = "bogus" }, "fp8_e4m3"},
		{"chunk", func(f *roleFlags) { f.chunkPages = -1 }, "--chunk-pages"},
		{"waiting", func(f *roleFlags) { f.waitingTimeout = 0 }, "--waiting-timeout"},
		{"peer", func(f *roleFlags) { f.peerTimeout = 0 }, "--peer-timeout"},
		{"aux rows", func(f *roleFlags) { f.auxRows = 0 }, "--aux-rows 0"},
		{"max peers", func(f *roleFlags) { f.maxPeers = -1 }, "KVXFER_MAX_PEERS"},
		{"drain 0", func(f *roleFlags) { f.drainTimeout = 0 }, "--drain-timeout 0s"},
		{"serve unix", func(f *roleFlags) { f.serve = "unix:/run/kvxfer/d.sock" }, ""},
		{"serve http", func(f *roleFlags) { f.serve = "http://127.0.0.1:0" }, ""},
		{"serve empty unix", func(f *roleFlags) { f.serve = "unix:" }, "needs a socket path"},
		{"serve long unix", func(f *roleFlags) { f.serve = "unix:/" + strings.Repeat("d", 120) }, "at most 107 bytes"},
		{"serve http path", func(f *roleFlags) { f.serve = "http://127.0.0.1:9100/v1" }, "no path"},
		{"serve http no port", func(f *roleFlags) { f.serve = "http://127.0.0.1" }, "HOST:PORT"},
		{"serve tcp", func(f *roleFlags) { f.serve = "tcp://127.0.0.1:9" }, "want unix:PATH"},
		{"http port", func(f *roleFlags) { f.httpPort = 30000 }, ""},
		{"http port out of range", func(f *roleFlags) { f.httpPort = 65536 }, "--prefill-http-port 65536"},
		{"bootstrap", func(f *roleFlags) { f.bootstrap = "127.0.0.1:8998" }, ""},
		{"bootstrap ipv6", func(f *roleFlags) { f.bootstrap = "[::1]:8998" }, ""},
		{"bootstrap unbracketed", func(f *roleFlags) { f.bootstrap = "::1:8998" }, "--bootstrap: bootstrap: address \"::1:8998\": an IPv6 address must be bracketed"},
		{"bootstrap no port", func(f *roleFlags) { f.bootstrap = "nonsense" }, "--bootstrap: bootstrap: address \"nonsense\" has no port"},
	}
	for _, c := range cases {
		f := good()
		c.mod(&f)
		err := validateRoleFlags(&f)
		if (c.errHas == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.errHas)) {
			t.Errorf("%s: err %v, want %q", c.name, err, c.errHas)
		}
	}
}

// TestRoleStdinProtocol runs `kvxfer decode` (this test binary) with good and
// bad request lines: one ready line with event=ready and no room, exactly
// one result per non-blank input line, and exit status 1 because some failed.
func TestRoleStdinProtocol(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a process")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, exe, "decode", "--pool-mb", "16", "--transport", "tcp", "--log-level", "error",
		"--bootstrap", "127.0.0.1:1", "--bootstrap-timeout", "1s", "--waiting-timeout", "1s")
	cmd.Env = append(os.Environ(), "KVXFER_TEST_AS_CLI=1")
	in := strings.Join([]string{`{"room":60,"tokens":0}`, `{"tokens":5}`, ``, `garbage`, `{"room":7,"tokens":-1}`}, "\n") + "\n"
	cmd.Stdin = strings.NewReader(in)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("exit: %v (want status 1); stderr %s", err, stderr.String())
	}
	if !strings.Contains(stderr.String(), "4 of 4 requests failed") {
		t.Errorf("stderr %q lacks the failure count", stderr.String())
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	var lines []map[string]any
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("stdout line %q: %v", sc.Text(), err)
		}
		lines = append(lines, m)
	}
	if len(lines) != 5 {
		t.Fatalf("%d stdout lines, want 1 ready + 4 results:\n%s", len(lines), out)
	}
	if lines[0]["event"] != "ready" || lines[0]["room"] != nil {
		t.Errorf("ready line %v: want event=ready and no room", lines[0])
	}
	seen := map[float64]map[string]any{}
	for _, l := range lines[1:] {
		seen[l["line"].(float64)] = l
		e, _ := l["error"].(string)
		if l["ok"] != false || e == "" || strings.Contains(e, "<nil>") || l["event"] != nil {
			t.Errorf("result %v: want ok false with an error", l)
		}
	}
	for n, room := range map[float64]any{1: 60.0, 2: nil, 4: nil, 5: 7.0} {
		if l, ok := seen[n]; !ok || l["room"] != room {
			t.Errorf("line %v: result %v, want room %v", n, l, room)
		}
	}
}

// FuzzParseRequest: any stdin line gives a request or an error, never a
// panic; accepted requests are within range; errors are never empty.
func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{`{"room":0,"tokens":1}`, `{"room":60,"tokens":0}`, `{"tokens":5}`, `garbage`, `{"room":1,"tokens":2,"bootstrap":"h:1"}`, `{}`, `[]`, `null`,
		`{"room":1,"tokens":64,"layerwise":true,"layer_compute_us":250}`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, line string) {
		for _, role := range []engine.Role{engine.RolePrefill, engine.RoleDecode} {
			q, _, err := parseRequest(line, role)
			if err != nil {
				if err.Error() == "" || strings.Contains(err.Error(), "<nil>") {
					t.Fatalf("%q: empty error", line)
				}
				continue
			}
			if q.Tokens < 1 || q.Room > maxRoom || (role == engine.RolePrefill && q.Bootstrap != "") ||
				(role == engine.RoleDecode && (q.Layerwise || q.LayerComputeUS != 0 || q.PatternRoom != nil)) || q.LayerComputeUS < 0 ||
				(q.PatternRoom != nil && *q.PatternRoom > maxRoom) {
				t.Fatalf("%q accepted as %+v", line, q)
			}
		}
	})
}

// TestReadRequestsLongLine: a line over 1 MiB gets one error result naming
// its length and the lines after it are still read (issue 18: the rank used
// to stop reading and exit 1); a line of exactly 1 MiB is read.
func TestReadRequestsLongLine(t *testing.T) {
	huge := `{"room":1,"tokens":2,"pad":"` + strings.Repeat("x", maxLineBytes) + `"}`
	exact := `{"room":3,"tokens":1}` + strings.Repeat(" ", maxLineBytes-len(`{"room":3,"tokens":1}`))
	in := strings.Join([]string{`{"room":5,"tokens":4}`, huge, ``, exact, `{"room":6,"tokens":7}`, huge}, "\n") // last line without "\n"
	var got []inputLine
	if err := readRequests(strings.NewReader(in), engine.RoleDecode, func(l inputLine) { got = append(got, l) }); err != nil {
		t.Fatal(err)
	}
	if len(got) != 5 {
		t.Fatalf("%d lines read, want 5 (blank line skipped): %+v", len(got), got)
	}
	want := []struct {
		n    int
		room uint64
		err  string
	}{{1, 5, ""}, {2, 0, fmt.Sprintf("line of %d bytes is longer than the limit of %d bytes", len(huge), maxLineBytes)}, {4, 3, ""}, {5, 6, ""},
		{6, 0, fmt.Sprintf("line of %d bytes is longer", len(huge))}}
	for i, w := range want {
		g := got[i]
		switch {
		case g.n != w.n:
			t.Errorf("result %d: line %d, want %d", i, g.n, w.n)
		case w.err == "" && (g.err != nil || g.q.Room != w.room):
			t.Errorf("line %d: %+v, want room %d", g.n, g.q, w.room)
		case w.err != "" && (g.err == nil || !strings.Contains(g.err.Error(), w.err) || g.hasRoom):
			t.Errorf("line %d: err %v, want %q and no room", g.n, g.err, w.err)
		}
	}
}
