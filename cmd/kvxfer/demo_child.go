package main

// The demo's rank processes: a cluster.Proc each, speaking the ranks' JSON
// lines.

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/internal/cluster"
)

// child is one prefill or decode process (a cluster.Proc speaking the
// ranks' JSON lines: request lines in, a ready line and result lines out).
type child struct {
	name string
	// metrics is the child's --metrics-addr as bound (its ready line).
	metrics string
	proc    *cluster.Proc
	ready   chan replyLine
	mu      sync.Mutex
	wait    map[uint64]chan replyLine
	dead    error
}

// startChild starts `exe args...` with this process's environment plus env
// ("NAME=value" entries, which win).
func startChild(exe, name string, args, env []string) (*child, error) {
	c := &child{name: name, ready: make(chan replyLine, 1), wait: map[uint64]chan replyLine{}}
	p, err := cluster.Start(cluster.Spec{Name: name, Exe: exe, Args: args, Env: env, OnLine: c.line, OnExit: c.exited})
	if err != nil {
		return nil, err
	}
	c.proc = p
	return c, nil
}

// line dispatches one stdout line: the ready line, or a room's result to
// the submit waiting for it.
func (c *child) line(b []byte) {
	var l replyLine
	if err := json.Unmarshal(b, &l); err != nil {
		slog.Warn("unparsable line from child", "child", c.name, "line", string(b))
		return
	}
	if l.Event == readyEvent {
		c.ready <- l
		return
	}
	if l.Room == nil {
		// Only a line the child could not read has no room; the demo
		// writes well-formed lines, so this is a bug worth seeing.
		slog.Warn("result line without a room from child", "child", c.name, "line", string(b))
		return
	}
	c.mu.Lock()
	ch := c.wait[*l.Room]
	delete(c.wait, *l.Room)
	c.mu.Unlock()
	if ch != nil {
		ch <- l
	}
}

// exited fails every room still waiting with the child's end.
func (c *child) exited(err error) {
	c.mu.Lock()
	c.dead = err
	for room, ch := range c.wait {
		ch <- replyLine{Room: new(room), Result: cluster.Result{Error: err.Error()}}
	}
	c.wait = map[uint64]chan replyLine{}
	c.mu.Unlock()
}

// exit is closed once the child was waited for.
func (c *child) exit() <-chan struct{} { return c.proc.Exited() }

// submit sends a request line and returns the channel of its reply.
func (c *child) submit(q requestLine) <-chan replyLine {
	ch := make(chan replyLine, 1)
	c.mu.Lock()
	if c.dead != nil {
		c.mu.Unlock()
		ch <- replyLine{Room: new(q.Room), Result: cluster.Result{Error: c.dead.Error()}}
		return ch
	}
	c.wait[q.Room] = ch
	c.mu.Unlock()
	b, _ := json.Marshal(q)
	if err := c.proc.WriteLine(b); err != nil {
		c.mu.Lock()
		if c.wait[q.Room] == ch {
			delete(c.wait, q.Room)
			ch <- replyLine{Room: new(q.Room), Result: cluster.Result{Error: fmt.Sprintf("write request: %v", err)}}
		}
		c.mu.Unlock()
	}
	return ch
}

// stop closes the child's stdin (the ranks' stop) and waits up to grace
// before SIGTERM, then SIGKILL.
func (c *child) stop(grace time.Duration) { c.proc.Stop(grace) }
