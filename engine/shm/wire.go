package shm

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Wire formats. Both blobs are little-endian, fixed size and versioned; they
// travel inside the engine's REGISTER control frame, so the decoders treat them
// as outside input (see FuzzDecodeEndpoint, FuzzDecodeKey).
//
// Endpoint blob (endpointSize bytes):
//
//	off  size  field
//	0    4     magic "KVXS"
//	4    1     version (1)
//	5    16    boot id of the receiver's host (/proc/sys/kernel/random/boot_id, as bytes)
//	21   4     receiver pid (in the receiver's pid namespace)
//	25   8     receiver start time (field 22 of /proc/PID/stat, clock ticks since boot)
//	33   4     fd number of the receiver's control memfd
//	37   8     st_dev of the control memfd
//	45   8     st_ino of the control memfd
//
// Region key (keySize bytes, RegionDesc.Key):
//
//	0    1     version (1)
//	1    4     fd number (in the receiver) of the memfd backing the region
//	5    8     offset of the region inside that memfd, bytes
//	13   8     st_dev of the memfd
//	21   8     st_ino of the memfd
//
// The sender opens /proc/PID/fd/N (the kernel reopens the very memfd the
// receiver holds, subject to the same-user ptrace read check, which Yama's
// ptrace_scope does not restrict) and refuses it unless st_dev/st_ino match,
// so a recycled pid or fd number can never map the wrong memory.
const (
	// wireVersion 2: the control memfd grew the epoch admission table and
	// the sender slots (fence.go).
	wireVersion  = 2
	endpointSize = 53
	keySize      = 29
)

var endpointMagic = [4]byte{'K', 'V', 'X', 'S'}

// endpoint is the decoded endpoint blob.
type endpoint struct {
	BootID    [16]byte
	PID       uint32
	StartTime uint64
	CtlFD     uint32
	CtlDev    uint64
	CtlIno    uint64
	// CtlAddr is the control memfd's address in the receiver (cma blobs
	// only: the sender's first process_vm_readv reads it, so a kernel that
	// refuses cross-memory attach is found at OpenSegment).
	CtlAddr uint64
}

// encode writes the shm blob, or with cma the cma blob (magic "KVXC", the
// same fields and CtlAddr at bytes 53-60).
func (e endpoint) encode(cma bool) []byte {
	if cma {
		b := make([]byte, cmaEndpointSize)
		copy(b, e.encode(false))
		copy(b[0:4], cmaEndpointMagic[:])
		binary.LittleEndian.PutUint64(b[endpointSize:], e.CtlAddr)
		return b
	}
	b := make([]byte, endpointSize)
	copy(b[0:4], endpointMagic[:])
	b[4] = wireVersion
	copy(b[5:21], e.BootID[:])
	binary.LittleEndian.PutUint32(b[21:], e.PID)
	binary.LittleEndian.PutUint64(b[25:], e.StartTime)
	binary.LittleEndian.PutUint32(b[33:], e.CtlFD)
	binary.LittleEndian.PutUint64(b[37:], e.CtlDev)
	binary.LittleEndian.PutUint64(b[45:], e.CtlIno)
	return b
}

// decodeEndpoint parses an shm blob, or with cma a cma blob.
func decodeEndpoint(b []byte, cma bool) (endpoint, error) {
	var e endpoint
	name, size, magic := Name, endpointSize, endpointMagic
	if cma {
		name, size, magic = CMAName, cmaEndpointSize, cmaEndpointMagic
	}
	if len(b) != size {
		return e, fmt.Errorf("%s: endpoint blob is %d bytes, want %d (is the peer running a different kvxfer version or transport?)", name, len(b), size)
	}
	if !bytes.Equal(b[0:4], magic[:]) {
		return e, fmt.Errorf("%s: endpoint blob has magic %q, want %q (not a %s endpoint)", name, b[0:4], magic[:], name)
	}
	if b[4] != wireVersion {
		return e, fmt.Errorf("%s: endpoint blob version %d, this build speaks %d (upgrade both sides)", name, b[4], wireVersion)
	}
	if cma {
		e.CtlAddr = binary.LittleEndian.Uint64(b[endpointSize:])
		if e.CtlAddr == 0 {
			return e, fmt.Errorf("%s: endpoint blob names control address 0", name)
		}
	}
	copy(e.BootID[:], b[5:21])
	e.PID = binary.LittleEndian.Uint32(b[21:])
	e.StartTime = binary.LittleEndian.Uint64(b[25:])
	e.CtlFD = binary.LittleEndian.Uint32(b[33:])
	e.CtlDev = binary.LittleEndian.Uint64(b[37:])
	e.CtlIno = binary.LittleEndian.Uint64(b[45:])
	if e.PID == 0 || e.PID > 1<<22 {
		return e, fmt.Errorf("%s: endpoint blob names pid %d, outside 1..%d", name, e.PID, 1<<22)
	}
	if e.CtlFD > 1<<30 {
		return e, fmt.Errorf("%s: endpoint blob names control fd %d, not a valid fd number", name, e.CtlFD)
	}
	return e, nil
}

// regionKey is the decoded RegionDesc.Key.
type regionKey struct {
	FD     uint32
	Offset uint64
	Dev    uint64
	Ino    uint64
}

func (k regionKey) encode() []byte {
	b := make([]byte, keySize)
	b[0] = wireVersion
	binary.LittleEndian.PutUint32(b[1:], k.FD)
	binary.LittleEndian.PutUint64(b[5:], k.Offset)
	binary.LittleEndian.PutUint64(b[13:], k.Dev)
	binary.LittleEndian.PutUint64(b[21:], k.Ino)
	return b
}

func decodeKey(b []byte) (regionKey, error) {
	var k regionKey
	if len(b) != keySize {
		return k, fmt.Errorf("shm: region key is %d bytes, want %d (was the region registered with the shm transport?)", len(b), keySize)
	}
	if b[0] != wireVersion {
		return k, fmt.Errorf("shm: region key version %d, this build speaks %d", b[0], wireVersion)
	}
	k.FD = binary.LittleEndian.Uint32(b[1:])
	k.Offset = binary.LittleEndian.Uint64(b[5:])
	k.Dev = binary.LittleEndian.Uint64(b[13:])
	k.Ino = binary.LittleEndian.Uint64(b[21:])
	if k.FD > 1<<30 {
		return k, fmt.Errorf("shm: region key names fd %d, not a valid fd number", k.FD)
	}
	if k.Offset > 1<<62 {
		return k, fmt.Errorf("shm: region key offset %d bytes is implausible", k.Offset)
	}
	return k, nil
}

// bootIDPath is where Linux publishes a random id generated at every boot; two
// processes see the same value iff they run under the same kernel instance.
const bootIDPath = "/proc/sys/kernel/random/boot_id"

func readBootID() ([16]byte, error) {
	var id [16]byte
	raw, err := os.ReadFile(bootIDPath)
	if err != nil {
		return id, fmt.Errorf("read %s: %w", bootIDPath, err)
	}
	return parseBootID(string(raw))
}

func parseBootID(s string) ([16]byte, error) {
	var id [16]byte
	h := strings.ReplaceAll(strings.TrimSpace(s), "-", "")
	b, err := hex.DecodeString(h)
	if err != nil || len(b) != 16 {
		return id, fmt.Errorf("boot id %q is not a UUID", strings.TrimSpace(s))
	}
	copy(id[:], b)
	return id, nil
}

func fmtBootID(id [16]byte) string {
	h := hex.EncodeToString(id[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// procStartTime returns field 22 (starttime, clock ticks after boot) of
// /proc/PID/stat. Together with the pid it names one process for the life of
// the host: a recycled pid has a later start time.
func procStartTime(pid int) (uint64, error) {
	raw, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// comm (field 2) may contain spaces and parentheses: fields after it start
	// after the last ')'.
	i := bytes.LastIndexByte(raw, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no ')' in %q", pid, raw)
	}
	f := strings.Fields(string(raw[i+1:]))
	// f[0] is field 3 (state); starttime is field 22 → f[19].
	if len(f) < 20 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields after comm, want >= 20", pid, len(f))
	}
	return strconv.ParseUint(f[19], 10, 64)
}
