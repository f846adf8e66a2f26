package control

import (
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// Doctor probes (kvxfer doctor --bootstrap): a prober proves the data path
// from a prefill rank into this host without touching serving KV. It
// registers a scratch region per transport, sends PROBE to the rank's
// control socket, and the rank (unless it refuses probes) opens a segment to
// the scratch region per transport (the handshake, with the RDMA QP exchange
// over HANDSHAKE/HANDSHAKE_ACK like a decode's), writes a pattern derived
// from the probe id from its own freshly allocated probe buffer (never from
// its KV buffers), and answers PROBE_RESULT with the timings; the prober
// then checks the bytes.
//
//	PROBE (prober → rank):
//	3 prober endpoint "tcp://host:port"
//	4 probe id (>= 1; also the data-path epoch of the probe's segments)
//	5 length: bytes to write per transport (1 … MaxProbeBytes)
//	6 transport count n (1 … 8), then per transport 3 frames: name,
//	  endpoint blob (Transport.Endpoint), region table (packRegions: exactly
//	  one region, the scratch region, at least length bytes)
//
//	PROBE_RESULT (rank → prober):
//	3 rank endpoint   4 probe id
//	5 refusal ("" = the probe ran; else why not, e.g. --no-probe)
//	6 rank ("prefill dp0/tp1/pp0")   7 the rank's transports, comma list
//	8 result count n (0 … 8), then per result 6 frames: transport, failed
//	  stage ("", "handshake" or "transfer"), error, not applicable (0/1: the
//	  transport cannot connect these hosts, e.g. shm across hosts),
//	  handshake µs, transfer µs
const (
	MsgProbe       = "PROBE"
	MsgProbeResult = "PROBE_RESULT"
	// MaxProbeBytes bounds a probe's length per transport (16 MiB).
	MaxProbeBytes = 16 << 20
)

// ProbeOffer is one prober transport in PROBE: its endpoint blob and the
// scratch region.
type ProbeOffer struct {
	Name     string
	Endpoint []byte
	Region   transport.RegionDesc
}

// ProbeMsg is PROBE (see the frame table above).
type ProbeMsg struct {
	Endpoint   string
	ID         uint64
	Length     uint64
	Transports []ProbeOffer
}

// ProbeResult is one transport's outcome of a probe as PROBE_RESULT
// carries it (the rank's side; the prober adds its verification).
type ProbeResult struct {
	// Transport is the transport's name.
	Transport string
	// Stage is where it failed: "" (passed), "handshake" (opening the
	// segment, QP exchange) or "transfer" (the write).
	Stage string
	// Err says why.
	Err string
	// NotApplicable: the transport cannot connect these two hosts (shm
	// across hosts) or the rank does not have it; not a fault.
	NotApplicable bool
	// Handshake and Transfer are the stages' durations on the rank.
	Handshake time.Duration
	Transfer  time.Duration
}

// ProbeResultMsg is PROBE_RESULT (see the frame table above).
type ProbeResultMsg struct {
	Endpoint   string
	ID         uint64
	Refused    string
	Rank       string
	Transports []string
	Results    []ProbeResult
}

// Encode returns the message's frames.
func (m *ProbeMsg) Encode() [][]byte {
	f := append(header(MsgProbe), []byte(m.Endpoint), Dec(m.ID), Dec(m.Length), deci(len(m.Transports)))
	for _, o := range m.Transports {
		f = append(f, []byte(o.Name), o.Endpoint, packRegions([]transport.RegionDesc{o.Region}))
	}
	return f
}

// Encode returns the message's frames.
func (m *ProbeResultMsg) Encode() [][]byte {
	f := append(header(MsgProbeResult), []byte(m.Endpoint), Dec(m.ID), []byte(m.Refused), []byte(m.Rank),
		[]byte(strings.Join(m.Transports, ",")), deci(len(m.Results)))
	for _, r := range m.Results {
		f = append(f, []byte(r.Transport), []byte(r.Stage), []byte(r.Err), b01(r.NotApplicable),
			Dec(uint64(r.Handshake.Microseconds())), Dec(uint64(r.Transfer.Microseconds())))
	}
	return f
}

// DecodeProbe decodes a PROBE message. Errors wrap ErrBadFrame.
func DecodeProbe(parts [][]byte) (*ProbeMsg, error) {
	r, err := newReader(parts, MsgProbe, 7, false)
	if err != nil {
		return nil, err
	}
	m := &ProbeMsg{Endpoint: r.endpoint(3), ID: r.Uint(4, maxEpoch, "probe id"), Length: r.Uint(5, MaxProbeBytes, "length")}
	n := r.int(6, maxTransports, "transport count")
	if r.Err == nil && (m.ID == 0 || m.Length == 0 || n == 0) {
		r.Fail(4, "probe id, length and transport count must be >= 1 (id %d, length %d, %d transports)", m.ID, m.Length, n)
	}
	if r.Err == nil && len(parts) != 7+3*n {
		r.Fail(6, "%d transports need %d frames, message has %d", n, 7+3*n, len(parts))
	}
	for i := 0; r.Err == nil && i < n; i++ {
		base := 7 + 3*i
		o := ProbeOffer{Name: r.Str(base, "transport name")}
		if r.Err == nil && o.Name == "" {
			r.Fail(base, "transport name is empty")
		}
		if len(parts[base+1]) > MaxBlobBytes {
			r.Fail(base+1, "endpoint blob of %d bytes, longer than %d", len(parts[base+1]), MaxBlobBytes)
		}
		regs, err := unpackRegions(parts[base+2])
		switch {
		case err != nil:
			r.Fail(base+2, "region table: %v", err)
		case len(regs) != 1:
			r.Fail(base+2, "region table has %d regions, want exactly the scratch region", len(regs))
		case regs[0].Length < m.Length:
			r.Fail(base+2, "scratch region of %d bytes is shorter than the probe length %d", regs[0].Length, m.Length)
		}
		if r.Err != nil {
			break
		}
		o.Endpoint = append([]byte(nil), parts[base+1]...)
		o.Region = regs[0]
		m.Transports = append(m.Transports, o)
	}
	if r.Err != nil {
		return nil, r.Err
	}
	return m, nil
}

// DecodeProbeResult decodes a PROBE_RESULT message. Errors wrap ErrBadFrame.
func DecodeProbeResult(parts [][]byte) (*ProbeResultMsg, error) {
	r, err := newReader(parts, MsgProbeResult, 9, false)
	if err != nil {
		return nil, err
	}
	m := &ProbeResultMsg{Endpoint: r.endpoint(3), ID: r.Uint(4, maxEpoch, "probe id"), Refused: r.Str(5, "refusal"), Rank: r.Str(6, "rank")}
	if ts := r.Str(7, "transports"); ts != "" {
		m.Transports = strings.Split(ts, ",")
	}
	n := r.int(8, maxTransports, "result count")
	if r.Err == nil && len(parts) != 9+6*n {
		r.Fail(8, "%d results need %d frames, message has %d", n, 9+6*n, len(parts))
	}
	for i := 0; r.Err == nil && i < n; i++ {
		base := 9 + 6*i
		res := ProbeResult{Transport: r.Str(base, "transport"), Stage: r.Str(base+1, "stage"), Err: r.Str(base+2, "error"),
			NotApplicable: r.bool(base+3, "not applicable"),
			Handshake:     time.Duration(r.Uint(base+4, 1<<40, "handshake µs")) * time.Microsecond,
			Transfer:      time.Duration(r.Uint(base+5, 1<<40, "transfer µs")) * time.Microsecond}
		if r.Err == nil && res.Stage != "" && res.Stage != "handshake" && res.Stage != "transfer" {
			r.Fail(base+1, "stage %q: want \"\", handshake or transfer", Trunc([]byte(res.Stage)))
		}
		m.Results = append(m.Results, res)
	}
	if r.Err != nil {
		return nil, r.Err
	}
	return m, nil
}
