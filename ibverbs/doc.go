// Package ibverbs is a thin, faithful Go binding of libibverbs (rdma-core),
// linked through pkg-config: device list, context, device/port/GID queries
// (GID type from sysfs), PD, MR (host memory and dma-buf), CQ with optional
// completion channel, RC QP with INIT->RTR->RTS transitions, chained
// post send (RDMA WRITE, WRITE_WITH_IMM, SEND), post recv and batched CQ
// polling.
//
// Two layers: raw.go holds lowercase one-to-one wrappers around the C calls;
// verbs.go holds the exported types (Context, PD, MR, CompChannel, CQ, QP)
// with Go types and errors. Every failed verbs call returns an *Error{Op,
// Errno}: errno for calls that set it (ibv_reg_mr, ibv_create_qp, ...), the
// returned value for ibv_post_send/ibv_post_recv/ibv_modify_qp, and for
// ibv_poll_cq, whose negative return is no errno, that value in Ret. errors.Is matches both the syscall.Errno and
// the sentinels ErrOutOfMemory and ErrNotSupported.
//
// Lifetimes: every object has an idempotent Close; close children first
// (QP, MR, CQ before PD/channel before Context). LiveObjects lists what was
// never closed, for leak checks in TestMain. Memory the NIC touches (MRs,
// work request arrays) is C- or mmap-allocated, never Go heap.
//
// Built with CGO_ENABLED=0 the package compiles to stubs that return
// ErrNoCgo (Available is false).
package ibverbs
