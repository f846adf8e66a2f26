package metadata

import (
	"errors"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestDescribeProbes: each mix of endpoint outcomes gets its own sentence.
func TestDescribeProbes(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	for _, tc := range []struct {
		name    string
		probes  []endpointProbe
		members int
		want    []string
		not     []string
	}{
		{"all refused", []endpointProbe{{ep: "a:1", dialErr: refused}, {ep: "b:1", dialErr: refused}}, 0,
			[]string{"no endpoint answers", "connection refused at a:1", "connection refused at b:1", "start etcd there"}, []string{"quorum"}},
		{"quorum lost", []endpointProbe{{ep: "a:1", member: 1}, {ep: "b:1", dialErr: refused}, {ep: "c:1", dialErr: refused}}, 3,
			[]string{"1 of 3 endpoints answer (a:1)", "lost quorum", "3 members and needs 2", "connection refused at b:1", "start the stopped members"}, nil},
		{"leader but slow", []endpointProbe{{ep: "a:1", member: 1, leader: 2}, {ep: "b:1", member: 2, leader: 2}}, 2,
			[]string{"2 of 2 endpoints answer", "has a leader (member 2)", "took longer than the 5s timeout"}, []string{"not answering"}},
		{"timeout and alarm", []endpointProbe{{ep: "a:1", dialErr: &net.OpError{Op: "dial", Err: errors.New("i/o timeout")}}, {ep: "b:1", member: 2, leader: 2, errs: []string{"NOSPACE"}}}, 0,
			[]string{"1 of 2 endpoints answer (b:1)", "a:1: i/o timeout", "members report: b:1: NOSPACE"}, nil},
	} {
		got := describeProbes(tc.probes, tc.members, time.Second, 5*time.Second)
		for _, w := range tc.want {
			if !strings.Contains(got, w) {
				t.Errorf("%s: %q lacks %q", tc.name, got, w)
			}
		}
		for _, w := range tc.not {
			if strings.Contains(got, w) {
				t.Errorf("%s: %q says %q", tc.name, got, w)
			}
		}
	}
}
