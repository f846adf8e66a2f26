//go:build cgo

package main

import (
	"context"
	"encoding/binary"
	"errors"
	"os"
	"sort"
	"sync"

	"github.com/kvxfer/kvxfer/engine/agent"
	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// agents holds the kvx_agent_t handles.
var agents = newTable[*agentObj]()

// agentObj is one kvx_agent_t: an agent.Agent plus the notifications taken
// from it that the caller's buffer could not hold yet.
type agentObj struct {
	a *agent.Agent

	mu      sync.Mutex
	pending []byte // encoded records kvx_agent_get_notifs returns first
}

// takeNotifs returns the pending records, draining the agent's new
// notifications into them first when there are none.
func (o *agentObj) takeNotifs() []byte {
	if len(o.pending) > 0 {
		return o.pending
	}
	n := o.a.GetNotifs()
	names := make([]string, 0, len(n))
	for name := range n {
		names = append(names, name)
	}
	sort.Strings(names)
	var b []byte
	for _, name := range names {
		for _, m := range n[name] {
			b = binary.LittleEndian.AppendUint32(b, uint32(len(name)))
			b = append(b, name...)
			b = binary.LittleEndian.AppendUint32(b, uint32(len(m)))
			b = append(b, m...)
		}
	}
	o.pending = b
	return b
}

// agentCode maps the agent's sentinels to status codes (codeOf's fallback
// handles the transport's).
func agentCode(err error) (status, bool) {
	switch {
	case errors.Is(err, agent.ErrUnknownAgent):
		return stNotFound, true
	case errors.Is(err, agent.ErrBadHandle):
		return stBadHandle, true
	case errors.Is(err, agent.ErrBusy), errors.Is(err, agent.ErrNotifQueueFull):
		return stBusy, true
	case errors.Is(err, agent.ErrBadMetadata), errors.Is(err, agent.ErrBadIndex), errors.Is(err, segengine.ErrTransportMismatch):
		return stInvalidArgument, true
	case errors.Is(err, agent.ErrBadDescriptor) && errors.Is(err, transport.ErrOutOfBounds):
		return stOutOfBounds, true
	case errors.Is(err, agent.ErrBadDescriptor) && errors.Is(err, agent.ErrNotRegistered):
		return stNotRegistered, true
	case errors.Is(err, agent.ErrBadDescriptor):
		return stInvalidArgument, true
	case errors.Is(err, agent.ErrAgentUnreachable) && (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded)):
		return stTimeout, true
	case errors.Is(err, agent.ErrAgentUnreachable), errors.Is(err, agent.ErrRefused):
		return stPeerLost, true
	}
	return 0, false
}
