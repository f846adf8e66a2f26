package engine

import (
	"fmt"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvxfer/kvxfer/engine/internal/control"
)

// limitControlSocket sets ZMQ_MAXMSGSIZE on a socket that receives control
// frames: libzmq reads a larger frame's length, drops the connection and
// never allocates the frame (one 512 MiB frame once cost a rank 1.2 GB of
// RSS). what names the socket in the error.
func limitControlSocket(s *zmq.Socket, what string) error {
	if err := s.SetMaxmsgsize(control.MaxFrameBytes); err != nil {
		return fmt.Errorf("engine: zmq %s socket: ZMQ_MAXMSGSIZE %d: %w", what, control.MaxFrameBytes, err)
	}
	return nil
}

// recvControl receives one control message from s, frame by frame, keeping
// frames only while each fits what its type can need (control.FrameCheck).
// An oversize message is read to its end and dropped: the error wraps
// control.ErrFrameTooLarge and names the type, the frame and the sizes.
// Other errors are the socket's (EAGAIN on an empty inbox or a receive
// timeout, ETERM at shutdown).
func recvControl(s *zmq.Socket, flags zmq.Flag) ([][]byte, error) {
	var (
		parts   [][]byte
		check   control.FrameCheck
		tooBig  error
		dropped int
	)
	for i := 0; ; i++ {
		b, err := s.RecvBytes(flags)
		if err != nil {
			if i == 0 {
				return nil, err
			}
			// libzmq delivers a message's frames together: a failure
			// mid-message is the socket closing.
			return nil, fmt.Errorf("engine: control message cut after %d frames: %w", i, err)
		}
		if tooBig == nil {
			if tooBig = check.Check(i, b); tooBig == nil {
				parts = append(parts, b)
			} else {
				parts = nil
			}
		}
		if tooBig != nil {
			dropped += len(b)
		}
		more, err := s.GetRcvmore()
		if err != nil || !more {
			break
		}
	}
	if tooBig != nil {
		return nil, fmt.Errorf("%w (message dropped)", tooBig)
	}
	return parts, nil
}
