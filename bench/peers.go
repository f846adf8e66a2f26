package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// PeerSpec is one peer-tool configuration run at every block size.
type PeerSpec struct {
	// Tool is the executable ("iperf3", "ucx_perftest", "ib_write_bw").
	Tool string
	// Test is the tool's test name.
	Test string
	// Transport is the kvxfer transport it is compared with.
	Transport string
	// Env is "KEY=VALUE" set for both server and client ("" for none).
	Env string
	// Device is the RDMA device for ib_write_bw.
	Device string
}

// Label is the series name, the same as PeerResult.Label.
func (p PeerSpec) Label() string {
	return PeerResult{Tool: p.Tool, Test: p.Test, Env: p.Env}.Label()
}

// DefaultPeers returns the peer runs that match transports: iperf3 and
// ucx_perftest tag_bw over UCX_TLS=tcp for tcp; ucx_perftest tag_bw and
// ucp_put_bw (UCP one-sided put; plain put_bw is a UCT test that needs a
// device) over UCX_TLS=sm for shm; ib_write_bw on each RDMA device for rdma.
// Tools that are not installed are returned too and fail with a hint.
func DefaultPeers(transports []string, rdmaDevices []string) []PeerSpec {
	var out []PeerSpec
	for _, t := range transports {
		switch t {
		case "tcp":
			out = append(out,
				PeerSpec{Tool: "iperf3", Test: "tcp", Transport: "tcp"},
				PeerSpec{Tool: "ucx_perftest", Test: "tag_bw", Transport: "tcp", Env: "UCX_TLS=tcp"})
		case "shm":
			out = append(out,
				PeerSpec{Tool: "ucx_perftest", Test: "tag_bw", Transport: "shm", Env: "UCX_TLS=sm"},
				PeerSpec{Tool: "ucx_perftest", Test: "ucp_put_bw", Transport: "shm", Env: "UCX_TLS=sm"})
		case "rdma":
			for _, d := range rdmaDevices {
				out = append(out, PeerSpec{Tool: "ib_write_bw", Test: "write", Transport: "rdma", Device: d})
			}
		}
	}
	return out
}

// iperf3MaxBlock is iperf3's largest TCP buffer length (-l), in bytes.
const iperf3MaxBlock = 1 << 20

// peerBytes is how much a peer run moves per block size: enough for a stable
// figure on loopback, bounded so 64 MiB blocks stay quick.
func peerBytes(block uint64) uint64 { return max(256<<20, 4*block) }

// RunPeer runs one peer tool at one block size on loopback: the server in
// the background, the client in the foreground, both killed at ctx's end.
func RunPeer(ctx context.Context, p PeerSpec, block uint64) PeerResult {
	res := PeerResult{Tool: p.Tool, Test: p.Test, Transport: p.Transport, Env: p.Env, BlockBytes: block, ToolBlockBytes: block}
	if _, err := exec.LookPath(p.Tool); err != nil {
		res.Err = fmt.Sprintf("%s is not installed (run scripts/install-deps.sh bench)", p.Tool)
		return res
	}
	port, err := freePort()
	if err != nil {
		res.Err = err.Error()
		return res
	}
	ps := strconv.Itoa(port)
	var server, client []string
	iters := func(minIters uint64) string {
		return strconv.FormatUint(max(minIters, peerBytes(block)/block), 10)
	}
	switch p.Tool {
	case "iperf3":
		res.ToolBlockBytes = min(block, iperf3MaxBlock)
		server = []string{"iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", ps}
		client = []string{"iperf3", "-c", "127.0.0.1", "-p", ps, "-l", strconv.FormatUint(res.ToolBlockBytes, 10),
			"-n", strconv.FormatUint(peerBytes(block), 10), "-J"}
	case "ucx_perftest":
		server = []string{"ucx_perftest", "-p", ps}
		client = []string{"ucx_perftest", "127.0.0.1", "-p", ps, "-t", p.Test, "-s", strconv.FormatUint(block, 10),
			"-n", iters(8), "-w", "4"}
	case "ib_write_bw":
		common := []string{"-d", p.Device, "-s", strconv.FormatUint(block, 10), "-n", iters(8), "-p", ps, "-F", "--report_gbits"}
		server = append([]string{"ib_write_bw"}, common...)
		client = append(append([]string{"ib_write_bw"}, common...), "127.0.0.1")
	default:
		res.Err = fmt.Sprintf("unknown peer tool %q", p.Tool)
		return res
	}
	res.Command = strings.TrimSpace(p.Env + " " + strings.Join(client, " "))
	env := os.Environ()
	if p.Env != "" {
		env = append(env, p.Env)
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	srv := exec.CommandContext(sctx, server[0], server[1:]...)
	srv.Env = env
	srv.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	srv.Cancel = func() error { return syscall.Kill(-srv.Process.Pid, syscall.SIGKILL) }
	var srvOut strings.Builder
	srv.Stdout, srv.Stderr = &srvOut, &srvOut
	if err := srv.Start(); err != nil {
		res.Err = fmt.Sprintf("start %s server: %v", p.Tool, err)
		return res
	}
	exited := make(chan struct{})
	go func() { srv.Wait(); close(exited) }()
	defer func() { cancel(); <-exited }()
	if err := waitListen(ctx, port, exited); err != nil {
		res.Err = fmt.Sprintf("%s server on port %d: %v; server said: %s", p.Tool, port, err, lastLines(srvOut.String(), 3))
		return res
	}
	cl := exec.CommandContext(ctx, client[0], client[1:]...)
	cl.Env = env
	cl.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cl.Cancel = func() error { return syscall.Kill(-cl.Process.Pid, syscall.SIGKILL) }
	out, err := cl.CombinedOutput()
	if err != nil {
		res.Err = fmt.Sprintf("%s: %v: %s", res.Command, err, lastLines(string(out), 3))
		return res
	}
	var gbps float64
	switch p.Tool {
	case "iperf3":
		gbps, err = parseIperf3(out)
	case "ucx_perftest":
		gbps, err = parseUCXPerftest(out)
	case "ib_write_bw":
		gbps, err = parseIBWriteBW(out, block)
	}
	if err != nil {
		res.Err = fmt.Sprintf("%s: %v", res.Command, err)
		return res
	}
	res.GBps = gbps
	return res
}

// parseIperf3 reads the receiver's rate from iperf3 -J output.
func parseIperf3(out []byte) (float64, error) {
	var doc struct {
		Error string `json:"error"`
		End   struct {
			SumReceived struct {
				BitsPerSecond float64 `json:"bits_per_second"`
			} `json:"sum_received"`
		} `json:"end"`
	}
	if err := json.Unmarshal(out, &doc); err != nil {
		return 0, fmt.Errorf("iperf3 -J output is not JSON: %v", err)
	}
	if doc.Error != "" {
		return 0, errors.New("iperf3: " + doc.Error)
	}
	if doc.End.SumReceived.BitsPerSecond <= 0 {
		return 0, errors.New("iperf3 reported no received bandwidth")
	}
	return doc.End.SumReceived.BitsPerSecond / 8 / 1e9, nil
}

// parseUCXPerftest reads the "Final:" line: iterations, 3 latency columns
// (usec), bandwidth average and overall (MB/s, 2^20 bytes/s), 2 message-rate
// columns. The overall bandwidth is returned in GB/s.
func parseUCXPerftest(out []byte) (float64, error) {
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 9 && f[0] == "Final:" {
			mb, err := strconv.ParseFloat(f[6], 64)
			if err != nil {
				return 0, fmt.Errorf("ucx_perftest Final line %q: bandwidth %q is not a number", sc.Text(), f[6])
			}
			return mb * (1 << 20) / 1e9, nil
		}
	}
	return 0, fmt.Errorf("ucx_perftest printed no Final line: %s", lastLines(string(out), 3))
}

// parseIBWriteBW reads the result row "#bytes #iterations BWpeak BWaverage
// MsgRate" printed with --report_gbits (Gb/s).
func parseIBWriteBW(out []byte, block uint64) (float64, error) {
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 5 && f[0] == strconv.FormatUint(block, 10) {
			gb, err := strconv.ParseFloat(f[3], 64)
			if err != nil {
				return 0, fmt.Errorf("ib_write_bw row %q: average %q is not a number", sc.Text(), f[3])
			}
			return gb / 8, nil
		}
	}
	return 0, fmt.Errorf("ib_write_bw printed no result row for %d bytes: %s", block, lastLines(string(out), 3))
}

// freePort asks the kernel for a free loopback TCP port (the tools take a
// number, so the listener is closed before they bind it).
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// waitListen waits until some socket listens on port (read from
// /proc/net/tcp{,6} so the one-shot servers never see a probe connection),
// the server exits, or 10 s pass.
func waitListen(ctx context.Context, port int, exited <-chan struct{}) error {
	deadline := time.Now().Add(10 * time.Second)
	want := fmt.Sprintf(":%04X", port)
	for time.Now().Before(deadline) {
		for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
			b, _ := os.ReadFile(f)
			for _, l := range strings.Split(string(b), "\n") {
				fs := strings.Fields(l)
				if len(fs) > 3 && strings.HasSuffix(fs[1], want) && fs[3] == "0A" {
					return nil
				}
			}
		}
		select {
		case <-exited:
			return errors.New("server exited before listening")
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return errors.New("server did not listen within 10s")
}

func lastLines(s string, n int) string {
	ls := strings.Split(strings.TrimSpace(s), "\n")
	if len(ls) > n {
		ls = ls[len(ls)-n:]
	}
	return strings.Join(ls, " | ")
}

// PeerVersions returns each installed peer tool's version line.
func PeerVersions() map[string]string {
	m := map[string]string{}
	if v := toolVersion("iperf3", "--version"); v != "" {
		m["iperf3"] = v
	}
	if v := toolVersion("ucx_info", "-v"); v != "" {
		m["ucx_perftest"] = v
	}
	if v := toolVersion("ib_write_bw", "--version"); v != "" {
		m["ib_write_bw"] = v
	}
	return m
}
