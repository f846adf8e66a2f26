package metadata

// Saying what happened when etcd does not answer: the client's own error is
// usually a bare "context deadline exceeded" (its retries hide "connection
// refused", and a member without a leader only makes requests wait), so a
// failed request probes every endpoint and the error names what each did.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

const (
	// maxProbe bounds the diagnosis of a failed request (all endpoints are
	// probed at once); Options.Timeout bounds it too when shorter.
	maxProbe = 2 * time.Second
	// diagnosisTTL is how long a diagnosis is reused: during an outage
	// every request fails, and one round of probes says it for all of them.
	diagnosisTTL = 2 * time.Second
)

// diagCache holds the latest diagnosis of a store.
type diagCache struct {
	mu   sync.Mutex
	at   time.Time
	text string
}

// endpointProbe is what one endpoint did when probed.
type endpointProbe struct {
	ep string
	// dialErr: the TCP connect failed; statusErr: it connected but etcd's
	// Status call failed.
	dialErr, statusErr error
	// From Status: the member's raft leader (0: none), its own id, and the
	// alarms or errors it reports.
	leader, member uint64
	errs           []string
}

// diagnose probes every endpoint of the store (in parallel, bounded by
// min(Timeout, maxProbe)) and says what happened; "" when the request was
// cancelled by its caller (nothing to explain).
func (s *Store) diagnose(opErr error) string {
	if errors.Is(opErr, context.Canceled) {
		return ""
	}
	s.diag.mu.Lock()
	defer s.diag.mu.Unlock()
	if s.diag.text != "" && time.Since(s.diag.at) < diagnosisTTL {
		return s.diag.text
	}
	timeout := min(s.opts.Timeout, maxProbe)
	ctx, cancel := context.WithTimeout(s.ctx, timeout)
	defer cancel()
	probes := make([]endpointProbe, len(s.url.Endpoints))
	var wg sync.WaitGroup
	for i, ep := range s.url.Endpoints {
		wg.Add(1)
		go func() { defer wg.Done(); probes[i] = s.probe(ctx, ep) }()
	}
	members := 0
	wg.Add(1)
	go func() {
		defer wg.Done()
		// The member list is local state on every member (no leader
		// needed), so a member that lost quorum still gives it.
		if ml, err := s.cli.MemberList(ctx, clientv3.WithSerializable()); err == nil {
			members = len(ml.Members)
		}
	}()
	wg.Wait()
	if s.ctx.Err() != nil {
		return ""
	}
	s.diag.text, s.diag.at = describeProbes(probes, members, timeout, s.opts.Timeout), time.Now()
	return s.diag.text
}

// probe connects to ep and asks its etcd for its status.
func (s *Store) probe(ctx context.Context, ep string) endpointProbe {
	p := endpointProbe{ep: ep}
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", ep)
	if err != nil {
		p.dialErr = err
		return p
	}
	c.Close()
	st, err := s.cli.Status(ctx, ep)
	if err != nil {
		p.statusErr = err
		return p
	}
	p.leader, p.member, p.errs = st.Leader, st.Header.MemberId, st.Errors
	return p
}

// describeProbes turns the probes into one sentence: which endpoints
// answered, whether any has a leader, what the others did, and what to do.
func describeProbes(probes []endpointProbe, members int, probeTimeout, opTimeout time.Duration) string {
	var up, down, advice []string
	leaders := map[uint64]bool{}
	var alarms []string
	advise := func(a string) {
		if !slices.Contains(advice, a) {
			advice = append(advice, a)
		}
	}
	for _, p := range probes {
		switch {
		case p.dialErr != nil:
			down = append(down, dialFailure(p.ep, p.dialErr, probeTimeout))
			if errors.Is(p.dialErr, syscall.ECONNREFUSED) {
				advise("start etcd there, or fix the endpoints of the metadata URL")
			} else {
				advise("check the host and the network path to it, and the endpoints of the metadata URL")
			}
		case p.statusErr != nil:
			down = append(down, fmt.Sprintf("%s accepts connections but did not answer etcd's Status call within %v (%v): paused (SIGSTOP), overloaded, or not an etcd client port",
				p.ep, probeTimeout, shortErr(p.statusErr)))
			advise("resume or restart that member (see its log), or fix the port if it is not etcd's client port")
		default:
			up = append(up, p.ep)
			if p.leader != 0 {
				leaders[p.leader] = true
			}
			for _, e := range p.errs {
				alarms = append(alarms, p.ep+": "+e)
			}
		}
	}
	n := len(probes)
	var b strings.Builder
	switch {
	case len(up) == 0:
		fmt.Fprintf(&b, "no endpoint answers: %s; %s", strings.Join(down, "; "), strings.Join(advice, "; "))
	case len(leaders) == 0:
		fmt.Fprintf(&b, "%d of %d endpoints answer (%s) but none has a raft leader: the cluster has lost quorum", len(up), n, strings.Join(up, ", "))
		if members > 0 {
			fmt.Fprintf(&b, " (it has %d members and needs %d running to elect a leader)", members, members/2+1)
		}
		if len(down) > 0 {
			fmt.Fprintf(&b, "; not answering: %s", strings.Join(down, "; "))
		}
		b.WriteString("; start the stopped members (or restore the network between them); requests wait until a leader is elected")
	default:
		ids := make([]string, 0, len(leaders))
		for id := range leaders {
			ids = append(ids, fmt.Sprintf("%x", id))
		}
		fmt.Fprintf(&b, "%d of %d endpoints answer (%s) and the cluster has a leader (member %s): the request itself failed or took longer than the %v timeout",
			len(up), n, strings.Join(up, ", "), strings.Join(ids, ", "), opTimeout)
		if len(down) > 0 {
			fmt.Fprintf(&b, "; not answering: %s", strings.Join(down, "; "))
		}
	}
	if len(alarms) > 0 {
		fmt.Fprintf(&b, "; members report: %s", strings.Join(alarms, "; "))
	}
	return b.String()
}

// dialFailure says why a TCP connect to ep failed.
func dialFailure(ep string, err error, timeout time.Duration) string {
	var dns *net.DNSError
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return fmt.Sprintf("connection refused at %s (nothing listens there: etcd is not running on that port)", ep)
	case errors.As(err, &dns):
		return fmt.Sprintf("%s: the host does not resolve (%v)", ep, dns.Err)
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return fmt.Sprintf("%s: no route to the host (%v)", ep, shortErr(err))
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Sprintf("%s: no answer to a TCP connect within %v (host down, or a firewall drops the packets)", ep, timeout)
	}
	return fmt.Sprintf("%s: %v", ep, shortErr(err))
}

// shortErr is err's text without the dial noise ("dial tcp a:b: ").
func shortErr(err error) string {
	var op *net.OpError
	if errors.As(err, &op) && op.Err != nil {
		return op.Err.Error()
	}
	return err.Error()
}
