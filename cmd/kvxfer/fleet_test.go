package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvxfer/kvxfer/bootstrap"
	"github.com/kvxfer/kvxfer/internal/etcdtest"
	"github.com/kvxfer/kvxfer/metadata"
)

// fleetReport runs `kvxfer fleet --json` in-process.
func fleetReport(t *testing.T, url string) (metadata.FleetReport, error) {
	t.Helper()
	var out bytes.Buffer
	cmd := &cobra.Command{}
	cmd.SetOut(&out)
	err := runFleet(context.Background(), cmd, fleetFlags{metadata: url, jsonOut: true})
	var rep metadata.FleetReport
	if jerr := json.Unmarshal(out.Bytes(), &rep); jerr != nil && err == nil {
		t.Fatalf("fleet --json output %q: %v", out.String(), jerr)
	}
	return rep, err
}

// TestFleetCommand: a bootstrap server and a prefill rank started with
// --metadata show up in `kvxfer fleet` (instance ready, rank live); after the
// rank is killed its segment leaves etcd within the TTL, the report marks the
// rank stale and the command exits with status 3.
func TestFleetCommand(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	c := etcdtest.Start(t, etcdtest.Options{})
	url := c.URL("cli")
	if _, err := fleetReport(t, url); err != nil {
		t.Fatalf("empty fleet: %v", err)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	port := freePort(t, "127.0.0.1")
	bsAddr := "127.0.0.1:" + strconv.Itoa(port)
	start := func(args ...string) *exec.Cmd {
		cmd := exec.Command(exe, args...)
		cmd.Env = append(os.Environ(), "KVXFER_TEST_AS_CLI=1", metadataEnv+"="+url)
		cmd.Stderr = os.Stderr
		return cmd
	}
	bs := start("bootstrap", "--port", strconv.Itoa(port), "--metadata-ttl", "2s", "--log-level", "warn")
	if err := bs.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { bs.Process.Kill(); bs.Wait() }()
	model := filepath.Join(t.TempDir(), "m.json")
	os.WriteFile(model, []byte(`{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "torch_dtype": "bfloat16"}`), 0o644)
	pf := start("prefill", "--bootstrap", bsAddr, "--model", model, "--pool-mb", "8", "--page-size", "16", "--metadata-ttl", "2s", "--log-level", "warn")
	stdin, _ := pf.StdinPipe()
	defer stdin.Close()
	out, _ := pf.StdoutPipe()
	if err := pf.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { pf.Process.Kill(); pf.Wait() }()
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		if sc.Scan() {
			ready <- sc.Text()
		}
		close(ready)
	}()
	select {
	case l := <-ready:
		if !strings.Contains(l, `"ready"`) {
			t.Fatalf("prefill: %q", l)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("prefill not ready")
	}
	var rep metadata.FleetReport
	deadline := time.Now().Add(30 * time.Second)
	for {
		rep, err = fleetReport(t, url)
		if err == nil && len(rep.Instances) == 1 && rep.Instances[0].Ready && len(rep.Instances[0].Ranks) == 1 && rep.Instances[0].Ranks[0].Segment == "live" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("fleet never showed the ready instance with its live rank: %+v %v", rep, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if rep.Instances[0].Addr != bsAddr || rep.Segments["prefill"] != 1 {
		t.Fatalf("report %+v", rep)
	}
	pf.Process.Kill()
	killed := time.Now()
	for {
		rep, err = fleetReport(t, url)
		var st errStale
		if errors.As(err, &st) && rep.Instances[0].Ranks[0].Segment == "absent" {
			break
		}
		if time.Since(killed) > 20*time.Second {
			t.Fatalf("killed rank not reported stale: %+v %v", rep, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("killed rank reported absent %v after SIGKILL (TTL 2 s)", time.Since(killed).Round(time.Millisecond))
	// Text form names the stale rank.
	var txt bytes.Buffer
	cmd := &cobra.Command{}
	cmd.SetOut(&txt)
	_ = runFleet(context.Background(), cmd, fleetFlags{metadata: url})
	if !strings.Contains(txt.String(), "STALE: rank") || !strings.Contains(txt.String(), bsAddr) {
		t.Fatalf("text report:\n%s", txt.String())
	}
	// Stopping the bootstrap server removes its instance (orderly exit).
	bs.Process.Signal(os.Interrupt)
	bs.Wait()
	rep, _ = fleetReport(t, url)
	if len(rep.Instances) != 0 {
		t.Fatalf("instance still listed after the bootstrap server stopped: %+v", rep.Instances)
	}
}

func TestFleetErrors(t *testing.T) {
	cmd := &cobra.Command{}
	cmd.SetOut(&bytes.Buffer{})
	if err := runFleet(context.Background(), cmd, fleetFlags{}); err == nil || !strings.Contains(err.Error(), metadataEnv) {
		t.Fatalf("no --metadata: %v", err)
	}
	if err := runFleet(context.Background(), cmd, fleetFlags{metadata: "http://x:1"}); err == nil || !strings.Contains(err.Error(), "etcd://") {
		t.Fatalf("http URL: %v", err)
	}
	if err := runFleet(context.Background(), cmd, fleetFlags{metadata: "etcd://h:1", simulate: 1}); err == nil {
		t.Fatal("--simulate 1 accepted")
	}
}

// TestDemoWithMetadata: the demo's ranks and bootstrap server publish in
// etcd and the requests still verify.
func TestDemoWithMetadata(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	c := etcdtest.Start(t, etcdtest.Options{})
	t.Setenv("KVXFER_TEST_AS_CLI", "1")
	model := filepath.Join(t.TempDir(), "m.json")
	os.WriteFile(model, []byte(`{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "torch_dtype": "bfloat16"}`), 0o644)
	out := filepath.Join(t.TempDir(), "out.json")
	f := &demoFlags{requests: 2, model: model, prefillTP: 1, prefillPP: 1, decodeTP: 1, pageSize: 16, poolMB: 8, concurrency: 2,
		transport: "tcp", jsonOut: out, seed: 3, timeout: 60 * time.Second, noProgress: true, childLog: "warn",
		metadata: c.URL("demo"), metadataTTL: 2 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := runDemo(ctx, f); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(out)
	if !bytes.Contains(b, []byte(`"verified": 2`)) && !bytes.Contains(b, []byte(`"verified":2`)) {
		t.Fatalf("demo summary: %s", b)
	}
	// Everything was unpublished on exit.
	rep, err := fleetReport(t, c.URL("demo"))
	if err != nil || len(rep.Instances) != 0 || len(rep.Segments) != 0 {
		t.Fatalf("after the demo: %+v %v", rep, err)
	}
}

// TestKilledRankNotReady (issue 26 item 10): a TP-2 prefill instance
// registered with a bootstrap process, its ranks publishing in etcd under a
// 30 s lease (so the segments outlive the kill: only the directory's
// heartbeat can tell). After SIGKILL of rank 1 the directory reports it
// stale and not ready within the heartbeat bound (check-ins every 200 ms,
// bound bootstrap.StaleAfter), GET /route still answers it, and `kvxfer
// fleet` says NOT READY with a STALE line for it and exits 3, never "ready"
// above its own STALE line; a restarted rank 1 makes both ready again.
func TestKilledRankNotReady(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	c := etcdtest.Start(t, etcdtest.Options{})
	url := c.URL("killed")
	env := []string{metadataEnv + "=" + url}
	_, addr := startBootstrapProc(t, "127.0.0.1", 0, env...)
	rank := func(tp int) *proc {
		return startProc(t, "prefill tp"+strconv.Itoa(tp), env, roleArgs("prefill", addr, "127.0.0.1", "--tp-size", "2", "--tp-rank", strconv.Itoa(tp),
			"--directory-check-interval", "200ms", "--metadata-ttl", "30s")...)
	}
	pre := []*proc{rank(0), rank(1)}
	for _, p := range pre {
		p.ready()
	}
	pollTable(t, addr, 30*time.Second, "both ranks registered and live", func(tab *bootstrap.TableSnapshot) bool {
		return tab.Ready && tab.Registered == 2 && tab.Stale == 0 && tab.Ranks[1].HeartbeatMS == 200
	})
	fleetOK := func(rep metadata.FleetReport) bool {
		return len(rep.Instances) == 1 && rep.Instances[0].Ready && len(rep.Instances[0].Ranks) == 2 &&
			rep.Instances[0].Ranks[1].Segment == "live" && rep.Instances[0].Ranks[1].Heartbeat == "live"
	}
	waitFleet := func(what string, cond func(metadata.FleetReport, error) bool) metadata.FleetReport {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			rep, err := fleetReport(t, url)
			if cond(rep, err) {
				return rep
			}
			if time.Now().After(deadline) {
				t.Fatalf("fleet: %s: not within 30 s: %+v %v", what, rep, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	waitFleet("the ready instance", func(rep metadata.FleetReport, err error) bool { return err == nil && fleetOK(rep) })

	pre[1].kill9()
	killed := time.Now()
	bound := bootstrap.StaleAfter(200 * time.Millisecond)
	pollTable(t, addr, 30*time.Second, "the killed rank reported stale", func(tab *bootstrap.TableSnapshot) bool {
		return tab.Stale == 1 && tab.Ranks[1].Stale && !tab.Ranks[0].Stale
	})
	t.Logf("killed rank reported stale by the directory %s after SIGKILL (bound %s; segment lease 30 s)", time.Since(killed).Round(time.Millisecond), bound)
	if tab := mustTable(t, addr); tab.Ready || tab.Ranks[1].SilentSince == nil {
		t.Fatalf("table with a killed rank: %+v", tab)
	}
	bc, err := bootstrap.NewClient(addr)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if ri, err := bc.RankInfo(ctx, 0, 0, 1, 0); err != nil || ri.RankPort == 0 {
		t.Fatalf("GET /route for the killed rank: %+v %v, want its endpoint still answered", ri, err)
	}
	rep := waitFleet("the killed rank", func(rep metadata.FleetReport, err error) bool {
		var st errStale
		return errors.As(err, &st) && len(rep.Instances) == 1 && rep.Instances[0].Ranks[1].Heartbeat == "stale"
	})
	if in := rep.Instances[0]; in.Ready || in.Ranks[1].Segment != "live" {
		t.Fatalf("fleet with a killed rank (its lease still alive): %+v", in)
	}
	var txt bytes.Buffer
	cmd := &cobra.Command{}
	cmd.SetOut(&txt)
	_ = runFleet(context.Background(), cmd, fleetFlags{metadata: url})
	if s := txt.String(); !strings.Contains(s, "NOT READY  2/2 ranks registered, 1 stale") || !strings.Contains(s, "STALE: rank dp_rank=0 cp_rank=0 tp_rank=1") || strings.Contains(s, "  ready  ") {
		t.Fatalf("fleet text with a killed rank:\n%s", s)
	}

	pre[1] = rank(1)
	pre[1].ready()
	pollTable(t, addr, 30*time.Second, "the restarted rank live", func(tab *bootstrap.TableSnapshot) bool { return tab.Ready && tab.Stale == 0 })
	waitFleet("ready again", func(rep metadata.FleetReport, err error) bool { return err == nil && fleetOK(rep) })
	for _, p := range pre {
		if err := p.exit(30 * time.Second); err != nil {
			t.Fatalf("%s exit: %v\n%s", p.name, err, p.stderr.String())
		}
	}
}

// mustTable reads the directory's table once.
func mustTable(t *testing.T, addr string) *bootstrap.TableSnapshot {
	t.Helper()
	c, err := bootstrap.NewClient(addr)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	tab, err := c.Table(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return tab
}
