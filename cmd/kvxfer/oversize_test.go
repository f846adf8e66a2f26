package main

import (
	"bufio"
	"encoding/binary"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvxfer/kvxfer/engine"
)

// zmtpPush opens a raw TCP connection to a ZeroMQ endpoint "tcp://h:p" and
// speaks ZMTP 3.0 as a PUSH socket with the NULL mechanism, up to the first
// message frame: the test then writes a frame header and as many bytes as
// it likes, without allocating them.
func zmtpPush(t *testing.T, endpoint string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", strings.TrimPrefix(endpoint, "tcp://"), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	greeting := make([]byte, 64)
	greeting[0], greeting[9], greeting[10], greeting[11] = 0xFF, 0x7F, 3, 0
	copy(greeting[12:], "NULL")
	ready := []byte{0x04, 0, 5}
	ready = append(ready, "READY"...)
	ready = append(ready, 11)
	ready = append(ready, "Socket-Type"...)
	ready = binary.BigEndian.AppendUint32(ready, 4)
	ready = append(ready, "PUSH"...)
	ready[1] = byte(len(ready) - 2)
	if _, err := c.Write(append(greeting, ready...)); err != nil {
		t.Fatal(err)
	}
	// The rank's greeting and READY (64 bytes, then a command frame).
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	r := bufio.NewReader(c)
	if _, err := io.ReadFull(r, make([]byte, 64)); err != nil {
		t.Fatalf("ZMTP greeting from %s: %v", endpoint, err)
	}
	hdr := make([]byte, 2)
	if _, err := io.ReadFull(r, hdr); err != nil || hdr[0] != 0x04 {
		t.Fatalf("ZMTP READY from %s: %v (flags %#x)", endpoint, err, hdr[0])
	}
	if _, err := io.ReadFull(r, make([]byte, hdr[1])); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Time{})
	return c
}

// vmHWM is the peak resident set of process pid, in bytes.
func vmHWM(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmHWM:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb << 10
		}
	}
	t.Skip("no VmHWM in /proc/PID/status")
	return 0
}

// TestCLIOversizeControlFrame: a 512 MiB frame streamed at a prefill rank's
// control endpoint (the field case: it cost a rank 1.2 GB of RSS) is
// refused from its length (ZMQ_MAXMSGSIZE): the connection is dropped, the
// rank's peak RSS stays far below the frame, and the rank serves the next
// room. A frame under the socket's bound but over what its type can need (a
// 1 MiB STATUS field) is dropped with a log line naming the type, the frame
// and both sizes.
func TestCLIOversizeControlFrame(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const host = "127.0.0.1"
	_, b := startBootstrapProc(t, host, 0)
	p := startProc(t, "prefill", nil, roleArgs("prefill", b, host)...)
	ready := p.ready()
	pid := p.cmd.Process.Pid
	before := vmHWM(t, pid)

	c := zmtpPush(t, ready.Endpoint)
	const frame = 512 << 20
	hdr := []byte{0x02} // a long, final frame
	hdr = binary.BigEndian.AppendUint64(hdr, frame)
	chunk := make([]byte, 1<<20)
	sent := 0
	_ = c.SetWriteDeadline(time.Now().Add(2 * time.Minute))
	_, err := c.Write(hdr)
	for err == nil && sent < frame {
		var n int
		n, err = c.Write(chunk)
		sent += n
	}
	c.Close()
	t.Logf("wrote %d MiB of the 512 MiB frame before the rank closed the connection (err %v)", sent>>20, err)
	time.Sleep(500 * time.Millisecond) // let a rank that buffered it copy it too
	after := vmHWM(t, pid)
	if grew := after - before; grew > 128<<20 {
		t.Fatalf("the rank's peak RSS grew by %d MiB (from %d to %d MiB) for one oversize frame: it buffered the frame", grew>>20, before>>20, after>>20)
	}
	t.Logf("peak RSS %d MiB before, %d MiB after", before>>20, after>>20)

	// A STATUS whose reason is 1 MiB: under ZMQ_MAXMSGSIZE, over its type.
	push, err := zmq.NewSocket(zmq.PUSH)
	if err != nil {
		t.Fatal(err)
	}
	defer push.Close()
	_ = push.SetLinger(0)
	if err := push.Connect(ready.Endpoint); err != nil {
		t.Fatal(err)
	}
	if _, err := push.SendMessage("KVXFER", strconv.Itoa(engine.ControlVersion), "STATUS", "1", "4", "0", "tcp://127.0.0.1:1", strings.Repeat("x", 1<<20), "1"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(p.stderr.String(), "STATUS frame 7 is 1048576 bytes, over the 4096 bytes its type can need") {
		if time.Now().After(deadline) {
			t.Fatalf("no log line names the oversize STATUS frame; stderr:\n%s", p.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}

	// The rank survived and serves a room.
	d := startProc(t, "decode", nil, roleArgs("decode", b, host)...)
	d.ready()
	p.send(requestLine{Room: 90, Tokens: 16})
	d.send(requestLine{Room: 90, Tokens: 16})
	pr, dr := p.result(time.Minute), d.result(time.Minute)
	agree(t, 90, pr, dr)
	if !dr.OK {
		t.Fatalf("room after the oversize frames failed: %s", dr.Error)
	}
}
