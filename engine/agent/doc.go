// Package agent is kvxfer's NIXL-shaped transfer agent: the object NIXL's
// nixlAgent is to vLLM's NixlConnector, llm-d and Dynamo, on top of a
// segengine.TransferEngine and the transport SPI.
//
// An Agent has a unique name. Its caller registers memory (host or CUDA,
// as transport.Memory lists), exports its metadata (Metadata: a versioned
// byte string, never pickle) and hands it to peers out of band; a peer adds
// it (AddRemoteAgent) and can then prepare descriptor lists on both sides
// (PrepDlist with LocalAgent, or with the remote agent's name), make
// transfer requests addressed by descriptor index (MakeXfer: READ or WRITE,
// an optional notification message), post them (Post), poll them (State:
// PROC, DONE, ERR), read their telemetry and release them. Notifications
// travel over the agent's control channel and are read with GetNotifs.
//
// Guarantees kvxfer adds to NIXL's contract:
//
//   - A transfer's notification is sent only after its batch completed: for a
//     WRITE every byte landed in the remote memory, for a READ in local
//     memory. A transfer whose notification could not be delivered ends ERR,
//     so both agents report the same outcome (the data is there, but the
//     remote side was not told).
//   - A cancelled or released request moves no byte and sends no
//     notification once Cancel or Release returned: the batch is cancelled
//     and waited for (bounded by Config.DrainTimeout); a batch that does not
//     stop in time closes the segment to that agent, which fails it.
//   - RemoveRemoteAgent fences: this agent's requests to that agent are
//     cancelled, and that agent's data path into this agent's memory is cut
//     (transport.Fencer: tcp refuses its epoch, shm flags its sender slots,
//     rdma destroys its QPs), so its later WRITEs and READs fail, and its
//     notifications are refused, until this agent adds it again.
//
// The control channel (ZeroMQ ROUTER/DEALER, one request and one answer,
// bounded by Config.Timeout) carries HELLO (a peer that added this agent
// asks for its data path's peer id and epoch), OPENED (it finished the
// transport handshake) and NOTIF. Every frame decoder is fuzzed and rejects
// unknown versions. Like the segment RPC it is not authenticated: whoever
// holds an agent's metadata and reaches its ports can transfer to and from
// its registered memory, NIXL's trust model.
//
// An Agent is safe for concurrent use. Close it once done (idempotent); it
// cancels its requests and closes its engine and transport.
package agent
