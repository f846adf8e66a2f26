// Package etcdtest starts real etcd servers for tests: one node or a
// cluster, on free loopback ports, with data directories under the test's
// temporary directory, stopped when the test ends. Members can be stopped,
// killed, paused (SIGSTOP) and restarted on the same ports and data, which
// is what the fault tests need.
//
// The etcd binary is found on $PATH (Debian's etcd-server installs
// /usr/bin/etcd; scripts/install-deps.sh installs it) or at $KVXFER_ETCD.
// Without it a test is skipped with the reason, except under CI ($CI set, as
// .ci/run does), where a missing etcd is a failure.
package etcdtest

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Binary returns the etcd executable's path, or an error saying how to
// install it.
func Binary() (string, error) {
	if p := os.Getenv("KVXFER_ETCD"); p != "" {
		return p, nil
	}
	p, err := exec.LookPath("etcd")
	if err != nil {
		return "", errors.New("etcd not found on $PATH (install Debian's etcd-server: scripts/install-deps.sh, or set KVXFER_ETCD)")
	}
	return p, nil
}

// Require skips tb when etcd is not installed, or fails it under CI.
func Require(tb testing.TB) string {
	tb.Helper()
	p, err := Binary()
	if err != nil {
		if os.Getenv("CI") != "" {
			tb.Fatalf("%v — CI must run the etcd tests", err)
		}
		tb.Skip(err)
	}
	return p
}

// Member is one etcd server of a Cluster.
type Member struct {
	Name      string
	ClientURL string // http://127.0.0.1:port
	PeerURL   string
	dataDir   string
	args      []string
	bin       string
	log       *os.File

	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{}
}

// Cluster is a running etcd cluster started by Start.
type Cluster struct {
	Members []*Member
	tb      testing.TB
	dirs    []string // removed by Stop (StartShared)
}

// Options tune Start.
type Options struct {
	// Members is the cluster size (default 1).
	Members int
	// HeartbeatMS and ElectionMS are etcd's raft timers (defaults 50 and
	// 500 ms: failover within a second, and a minimum lease TTL of 1 s).
	HeartbeatMS, ElectionMS int
}

func (o Options) withDefaults() Options {
	if o.Members <= 0 {
		o.Members = 1
	}
	if o.HeartbeatMS <= 0 {
		o.HeartbeatMS = 50
	}
	if o.ElectionMS <= 0 {
		o.ElectionMS = 500
	}
	return o
}

// freePorts reserves n distinct free loopback ports (closed before return;
// etcd binds them right after).
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var ports []int
	for i := 0; i < n; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// Start starts an etcd cluster and waits until every member is healthy;
// the test's cleanup stops it. It skips (or fails under CI) without etcd.
func Start(tb testing.TB, o Options) *Cluster {
	tb.Helper()
	bin := Require(tb)
	o = o.withDefaults()
	c := startRetry(tb, bin, o, false)
	tb.Cleanup(c.Stop)
	return c
}

// StartShared starts a cluster that outlives the calling test (for a
// package's shared cluster): the caller stops it, e.g. from TestMain after
// m.Run. Its directories are removed by Stop.
func StartShared(tb testing.TB, o Options) *Cluster {
	tb.Helper()
	bin := Require(tb)
	return startRetry(tb, bin, o.withDefaults(), true)
}

func startRetry(tb testing.TB, bin string, o Options, shared bool) *Cluster {
	tb.Helper()
	var c *Cluster
	// A port taken between freePorts and etcd's bind makes etcd exit: retry.
	for attempt := 1; ; attempt++ {
		var err error
		c, err = start(tb, bin, o, shared)
		if err == nil {
			break
		}
		if attempt == 3 {
			tb.Fatalf("etcdtest: %v", err)
		}
		tb.Logf("etcdtest: %v; retrying on other ports", err)
	}
	return c
}

func start(tb testing.TB, bin string, o Options, shared bool) (*Cluster, error) {
	ports, err := freePorts(2 * o.Members)
	if err != nil {
		return nil, err
	}
	c := &Cluster{tb: tb}
	// etcd fsyncs its WAL; tmpfs (/dev/shm) keeps that from dominating test
	// time.
	base := "/dev/shm"
	if st, err := os.Stat(base); err != nil || !st.IsDir() {
		base = ""
	}
	dir, err := os.MkdirTemp(base, "kvxfer-etcd-")
	if err != nil {
		return nil, err
	}
	c.dirs = append(c.dirs, dir)
	if !shared {
		tb.Cleanup(func() { os.RemoveAll(dir) })
	}
	var initial []string
	for i := 0; i < o.Members; i++ {
		m := &Member{Name: fmt.Sprintf("m%d", i), ClientURL: fmt.Sprintf("http://127.0.0.1:%d", ports[2*i]),
			PeerURL: fmt.Sprintf("http://127.0.0.1:%d", ports[2*i+1]), dataDir: filepath.Join(dir, fmt.Sprintf("m%d", i)), bin: bin}
		c.Members = append(c.Members, m)
		initial = append(initial, m.Name+"="+m.PeerURL)
	}
	for _, m := range c.Members {
		m.args = []string{
			"--name", m.Name, "--data-dir", m.dataDir,
			"--listen-client-urls", m.ClientURL, "--advertise-client-urls", m.ClientURL,
			"--listen-peer-urls", m.PeerURL, "--initial-advertise-peer-urls", m.PeerURL,
			"--initial-cluster", strings.Join(initial, ","), "--initial-cluster-state", "new",
			"--initial-cluster-token", "kvxfer-test",
			"--heartbeat-interval", strconv.Itoa(o.HeartbeatMS), "--election-timeout", strconv.Itoa(o.ElectionMS),
			"--logger", "zap", "--log-level", "warn",
		}
		if m.log, err = os.Create(filepath.Join(dir, m.Name+".log")); err != nil {
			c.Stop()
			return nil, err
		}
		if err := m.Start(); err != nil {
			c.Stop()
			return nil, err
		}
	}
	for _, m := range c.Members {
		if err := m.WaitHealthy(30 * time.Second); err != nil {
			c.Stop()
			return nil, err
		}
	}
	return c, nil
}

// Endpoints returns the members' "host:port" client addresses.
func (c *Cluster) Endpoints() []string {
	var out []string
	for _, m := range c.Members {
		out = append(out, m.Addr())
	}
	return out
}

// URL returns kvxfer's metadata URL for the cluster under prefix
// ("etcd://h:p,h:p/prefix").
func (c *Cluster) URL(prefix string) string {
	return "etcd://" + strings.Join(c.Endpoints(), ",") + "/" + strings.TrimPrefix(prefix, "/")
}

// Stop kills every member and removes the cluster's directories
// (idempotent).
func (c *Cluster) Stop() {
	for _, m := range c.Members {
		m.Kill()
		if m.log != nil {
			m.log.Close()
		}
	}
	for _, d := range c.dirs {
		os.RemoveAll(d)
	}
}

// Addr returns the member's client "host:port".
func (m *Member) Addr() string { return strings.TrimPrefix(m.ClientURL, "http://") }

// Start (re)starts the member's process with its data directory and ports.
func (m *Member) Start() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd != nil {
		return fmt.Errorf("etcd member %s is already running", m.Name)
	}
	cmd := exec.Command(m.bin, m.args...)
	cmd.Stdout, cmd.Stderr = m.log, m.log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start etcd member %s: %w", m.Name, err)
	}
	m.cmd, m.exited = cmd, make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) { cmd.Wait(); close(done) }(cmd, m.exited)
	return nil
}

// WaitHealthy polls the member's /health until it reports healthy.
func (m *Member) WaitHealthy(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	cl := &http.Client{Timeout: time.Second}
	var last string
	for time.Now().Before(deadline) {
		m.mu.Lock()
		exited := m.exited
		m.mu.Unlock()
		if exited != nil {
			select {
			case <-exited:
				return fmt.Errorf("etcd member %s exited during start (log %s): %s", m.Name, m.log.Name(), tail(m.log.Name()))
			default:
			}
		}
		resp, err := cl.Get(m.ClientURL + "/health")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if strings.Contains(string(b), `"health":"true"`) {
				return nil
			}
			last = string(b)
		} else {
			last = err.Error()
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("etcd member %s not healthy after %v: %s", m.Name, timeout, last)
}

func tail(path string) string {
	b, _ := os.ReadFile(path)
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

// Kill stops the member with SIGKILL and waits for it (idempotent).
func (m *Member) Kill() {
	m.mu.Lock()
	cmd, exited := m.cmd, m.exited
	m.cmd = nil
	m.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGCONT) // a paused process must be able to die
	_ = cmd.Process.Kill()
	<-exited
}

// Pause sends SIGSTOP: the member stops answering but keeps its sockets.
func (m *Member) Pause() error { return m.signal(syscall.SIGSTOP) }

// Resume sends SIGCONT.
func (m *Member) Resume() error { return m.signal(syscall.SIGCONT) }

func (m *Member) signal(s syscall.Signal) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd == nil {
		return fmt.Errorf("etcd member %s is not running", m.Name)
	}
	return m.cmd.Process.Signal(s)
}

// Restart kills the member and starts it again on the same ports and data,
// waiting until it is healthy.
func (m *Member) Restart(timeout time.Duration) error {
	m.Kill()
	if err := m.Start(); err != nil {
		return err
	}
	return m.WaitHealthy(timeout)
}

// Proxy is a TCP proxy to one address that a test can block (a network
// partition: bytes stop flowing both ways, connections stay open) and
// unblock. Start it with NewProxy; the test's cleanup closes it.
type Proxy struct {
	ln     net.Listener
	target string

	mu      sync.Mutex
	blocked bool
	gate    chan struct{} // closed while unblocked
	conns   map[net.Conn]struct{}
}

// NewProxy listens on a free loopback port and forwards to target.
func NewProxy(tb testing.TB, target string) *Proxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	p := &Proxy{ln: ln, target: target, gate: make(chan struct{}), conns: map[net.Conn]struct{}{}}
	close(p.gate)
	go p.accept()
	tb.Cleanup(p.Close)
	return p
}

// Addr is the proxy's "host:port".
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Block stops forwarding in both directions until Unblock.
func (p *Proxy) Block() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.blocked {
		p.blocked = true
		p.gate = make(chan struct{})
	}
}

// Unblock resumes forwarding (bytes held meanwhile flow on).
func (p *Proxy) Unblock() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.blocked {
		p.blocked = false
		close(p.gate)
	}
}

// Close stops the proxy and closes its connections.
func (p *Proxy) Close() {
	p.ln.Close()
	p.Unblock()
	p.mu.Lock()
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
}

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		u, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns[c], p.conns[u] = struct{}{}, struct{}{}
		p.mu.Unlock()
		go p.pipe(c, u)
		go p.pipe(u, c)
	}
}

func (p *Proxy) pipe(dst, src net.Conn) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			gate := p.gate
			p.mu.Unlock()
			<-gate
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
