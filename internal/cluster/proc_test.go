package cluster

import (
	"strings"
	"sync"
	"testing"
	"time"
)

// A child that echoes its stdin: lines come back in order, Stop ends it by
// closing stdin, OnExit runs once before Exited closes.
func TestProcEchoAndStop(t *testing.T) {
	var mu sync.Mutex
	var lines []string
	got := make(chan struct{}, 8)
	exits := 0
	p, err := Start(Spec{Name: "cat", Exe: "cat",
		OnLine: func(b []byte) { mu.Lock(); lines = append(lines, string(b)); mu.Unlock(); got <- struct{}{} },
		OnExit: func(error) { mu.Lock(); exits++; mu.Unlock() }})
	if err != nil {
		t.Skipf("cat: %v", err)
	}
	for _, l := range []string{"one", "two"} {
		if err := p.WriteLine([]byte(l)); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		select {
		case <-got:
		case <-time.After(30 * time.Second):
			t.Fatal("echoed lines did not come back")
		}
	}
	p.Stop(30 * time.Second)
	<-p.Exited()
	mu.Lock()
	defer mu.Unlock()
	if strings.Join(lines, ",") != "one,two" || exits != 1 {
		t.Fatalf("lines %q, OnExit ran %d times", lines, exits)
	}
	if p.Err() == nil || !strings.Contains(p.Err().Error(), "cat: exited") {
		t.Fatalf("Err = %v, want \"cat: exited\"", p.Err())
	}
	p.Stop(time.Second) // idempotent
}

// A child that ignores stdin's end is stopped by SIGTERM after the grace.
func TestProcStopEscalates(t *testing.T) {
	p, err := Start(Spec{Name: "sleeper", Exe: "sleep", Args: []string{"600"}})
	if err != nil {
		t.Skipf("sleep: %v", err)
	}
	start := time.Now()
	p.Stop(100 * time.Millisecond)
	if p.Err() == nil || !strings.Contains(p.Err().Error(), "signal") {
		t.Fatalf("Err = %v, want a signal exit", p.Err())
	}
	if el := time.Since(start); el > time.Minute {
		t.Fatalf("Stop took %v", el)
	}
}
