// Package cluster starts and drives the child processes of kvxfer's
// multi-process harnesses: `kvxfer demo` (a prefill and a decode process per
// rank, JSON lines over stdin/stdout) and bench/bootstrapload (one directory
// server per child). A Proc is a child whose stdout is read line by line and
// which stops when its stdin closes, with SIGTERM and SIGKILL behind that, so
// no harness leaves a process behind.
//
// It also holds what one such rank does for a room (rooms.go): PrefillRoom
// and DecodeRoom drive an engine Sender and Receiver over workload buffers,
// the reference way to use them, which `kvxfer prefill`/`decode` run for
// every request line.
package cluster

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"
)

// MaxLine is the longest stdout line a Proc reads (bytes); a longer one ends
// the read loop with an error (the process is still waited for).
const MaxLine = 1 << 20

// Spec says what to start and what to do with its output.
type Spec struct {
	// Name names the process in errors ("prefill tp0").
	Name string
	// Exe and Args are the command line.
	Exe  string
	Args []string
	// Env entries ("NAME=value") are added to this process's environment
	// (and win over it); nil: the child inherits the environment as is.
	Env []string
	// OnLine is called with each stdout line (without the newline; the
	// slice is reused after the call), in order, from one goroutine.
	OnLine func(line []byte)
	// OnExit is called once, after stdout ended and the process was waited
	// for, with the reason: the wait error, or an error saying it exited
	// (status 0) or that stdout could not be read. Optional.
	OnExit func(err error)
	// Stderr receives the child's stderr (default: this process's, each
	// line prefixed with "[Name] " so a reader knows which child spoke).
	Stderr io.Writer
}

// Proc is a started child process.
type Proc struct {
	name  string
	cmd   *exec.Cmd
	inMu  sync.Mutex
	stdin io.WriteCloser
	exit  chan struct{}
	err   error // set before exit is closed
}

// Start starts the process of s and its stdout reader.
func Start(s Spec) (*Proc, error) {
	cmd := exec.Command(s.Exe, s.Args...)
	if len(s.Env) > 0 {
		cmd.Env = append(os.Environ(), s.Env...)
	}
	cmd.Stderr = s.Stderr
	if cmd.Stderr == nil {
		cmd.Stderr = &linePrefixer{prefix: "[" + s.Name + "] ", w: os.Stderr}
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("%s: stdin pipe: %w", s.Name, err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("%s: stdout pipe: %w", s.Name, err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s (%s): %w", s.Name, s.Exe, err)
	}
	p := &Proc{name: s.Name, cmd: cmd, stdin: stdin, exit: make(chan struct{})}
	go p.read(stdout, s.OnLine, s.OnExit)
	return p, nil
}

func (p *Proc) read(r io.Reader, onLine func([]byte), onExit func(error)) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), MaxLine)
	for sc.Scan() {
		if onLine != nil {
			onLine(sc.Bytes())
		}
	}
	readErr := sc.Err()
	if readErr != nil {
		// Keep the pipe drained so the child never blocks on a full pipe.
		_, _ = io.Copy(io.Discard, r)
	}
	err := p.cmd.Wait()
	if lp, ok := p.cmd.Stderr.(*linePrefixer); ok {
		lp.flush() // Wait returned: the copying goroutine is done
	}
	switch {
	case err != nil:
	case readErr != nil:
		err = fmt.Errorf("exited after an unreadable stdout line: %w", readErr)
	default:
		err = errors.New("exited")
	}
	p.err = fmt.Errorf("%s: %w", p.name, err)
	if onExit != nil {
		onExit(p.err)
	}
	close(p.exit)
}

// Name is the Spec's name.
func (p *Proc) Name() string { return p.name }

// PID is the child's process id.
func (p *Proc) PID() int { return p.cmd.Process.Pid }

// WriteLine writes b and a newline to the child's stdin, whole (writes of
// concurrent callers do not interleave).
func (p *Proc) WriteLine(b []byte) error {
	p.inMu.Lock()
	defer p.inMu.Unlock()
	if _, err := p.stdin.Write(append(b[:len(b):len(b)], '\n')); err != nil {
		return fmt.Errorf("%s: write stdin: %w", p.name, err)
	}
	return nil
}

// Exited is closed once the child was waited for (after OnExit returned).
func (p *Proc) Exited() <-chan struct{} { return p.exit }

// Err is why the child ended, once Exited is closed (nil before).
func (p *Proc) Err() error {
	select {
	case <-p.exit:
		return p.err
	default:
		return nil
	}
}

// Signal sends sig to the child (an error once it was waited for).
func (p *Proc) Signal(sig os.Signal) error { return p.cmd.Process.Signal(sig) }

// Stop ends the child: it closes stdin (the harness protocol's "stop") and
// waits up to grace, then sends SIGTERM and waits 2 s, then SIGKILL. It
// returns once the child was waited for. Safe to call more than once.
func (p *Proc) Stop(grace time.Duration) {
	p.inMu.Lock()
	_ = p.stdin.Close()
	p.inMu.Unlock()
	select {
	case <-p.exit:
		return
	case <-time.After(grace):
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exit:
	case <-time.After(2 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exit
	}
}

// stderrMu serialises the children's prefixed lines on this process's
// stderr, so lines of two children never interleave mid-line.
var stderrMu sync.Mutex

// linePrefixer writes each complete line it is given to w with prefix in
// front; a partial line waits for its newline, or for flush once the child
// exited. Used by one copying goroutine per child.
type linePrefixer struct {
	prefix string
	w      io.Writer
	buf    []byte
}

func (l *linePrefixer) Write(p []byte) (int, error) {
	l.buf = append(l.buf, p...)
	for {
		i := bytes.IndexByte(l.buf, '\n')
		if i < 0 {
			break
		}
		stderrMu.Lock()
		_, _ = io.WriteString(l.w, l.prefix)
		_, _ = l.w.Write(l.buf[:i+1])
		stderrMu.Unlock()
		l.buf = l.buf[i+1:]
	}
	if len(l.buf) > 64<<10 { // a child writing without newlines: pass it on
		stderrMu.Lock()
		_, _ = io.WriteString(l.w, l.prefix)
		_, _ = l.w.Write(append(l.buf, '\n'))
		stderrMu.Unlock()
		l.buf = l.buf[:0]
	}
	return len(p), nil
}

// flush writes a last line that had no newline.
func (l *linePrefixer) flush() {
	if len(l.buf) == 0 {
		return
	}
	stderrMu.Lock()
	_, _ = io.WriteString(l.w, l.prefix)
	_, _ = l.w.Write(append(l.buf, '\n'))
	stderrMu.Unlock()
	l.buf = l.buf[:0]
}
