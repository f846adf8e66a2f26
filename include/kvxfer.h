/*
 * kvxfer.h — the stable C ABI of kvxfer, a KV-cache transfer engine for
 * prefill/decode disaggregated LLM serving.
 *
 * Link with -lkvxfer (CMake: find_package(kvxfer) and kvxfer::kvxfer;
 * pkg-config: kvxfer). The library is built from the Go package capi/ with
 * `go build -buildmode=c-shared`; this header is written by hand and is the
 * contract. A test (capi/header_test.go, ctest "capi_exports") checks that every
 * `KVX_API` prototype below is exported by libkvxfer.so and that the library
 * exports no other kvx_ symbol.
 *
 * ------------------------------------------------------------------------
 * OWNERSHIP RULE (read this first)
 * ------------------------------------------------------------------------
 *  1. Handles (kvx_engine_t, kvx_segment_t, ...) are opaque 64-bit numbers
 *     owned by the library. They are never pointers. 0 is never a valid
 *     handle. A handle is valid from the call that returns it until the
 *     matching destroy/free/close call returns; handles are never reused, so
 *     a stale or doubly destroyed handle yields KVX_ERR_BAD_HANDLE, never a
 *     crash.
 *  2. Strings and arrays passed IN (const char *, const kvx_write_request *,
 *     const int32_t *pages, descriptor blobs, config structs) are read or copied before the
 *     call returns; the caller owns them and may free them right after.
 *  3. Memory ranges passed to kvx_register_memory (and all memory named by a
 *     WRITE request) are owned by the caller. They must stay mapped and valid
 *     until kvx_deregister_memory returns for that region AND every batch or
 *     room transfer that reads or writes them is terminal. Sending memory
 *     must not be modified until the transfer reading it is terminal.
 *  4. Memory returned by kvx_alloc_host is owned by the library through its
 *     kvx_hostbuf_t handle: valid until kvx_free_host; the caller must
 *     deregister it from every engine first. The KV pool from kvx_kv_pool is
 *     owned by its KV manager: valid until kvx_kv_destroy (or the engine's
 *     kvx_engine_destroy). KV, aux and state buffers given in kvx_kv_config
 *     (kv_data_ptrs, ...) stay owned by the caller: the manager registers
 *     them and never frees them; they must stay allocated until
 *     kvx_kv_destroy (or kvx_engine_destroy) returns. The pointer arrays
 *     themselves are copied by kvx_kv_create.
 *  5. Output buffers (char *buf, size_t cap) are owned by the caller; the
 *     library writes at most cap bytes and reports the needed size.
 *  6. Strings returned as `const char *` (kvx_version, kvx_strerror) are
 *     static and valid forever. kvx_last_error's string is thread-local and
 *     valid until the next kvx_ call on the same thread.
 *  7. The notification callback's event pointer is valid only during the
 *     callback; copy what you need.
 *
 * ------------------------------------------------------------------------
 * ERRORS AND THREADS
 * ------------------------------------------------------------------------
 * Every function that can fail returns an int from kvx_status: KVX_OK (0) on
 * success. On failure a human-readable message naming what was wrong and what
 * to do is available from kvx_last_error() on the same thread. Output
 * parameters are written only on success (exceptions: the *needed size of the
 * buffer-filling functions, and kvx_kv_wait's *state, are also written on
 * KVX_ERR_BUFFER_TOO_SMALL and KVX_ERR_TIMEOUT). Bad arguments (NULL handles and
 * pointers, zero lengths, unregistered addresses, destroyed handles) return an
 * error code and never crash the process.
 *
 * Unless a function says otherwise it is THREAD-SAFE: any thread may call it
 * on any handle at any time. Destroying a handle while another thread uses it
 * is safe (the other call fails with KVX_ERR_BAD_HANDLE or KVX_ERR_CLOSED).
 *
 * Logging: the library logs to stderr at level warn; set the environment
 * variable KVXFER_LOG_LEVEL=debug|info|warn|error (read once at load) to
 * change it.
 *
 * Unit conventions: lengths, offsets and strides are in bytes; timeouts in
 * milliseconds; page indices are in units of pages of the KV pool.
 */
#ifndef KVXFER_H
#define KVXFER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* KVX_API marks every exported function (and is what the export test parses).
 * KVX_TYPES_ONLY (used only inside the library's own cgo build, whose
 * generated prototypes drop `const`) hides the prototypes. */
#ifndef KVX_API
#define KVX_API __attribute__((visibility("default")))
#endif

/* Version of this header. kvx_version() returns the library's. They have the
 * same major version when the ABI is compatible. */
#define KVX_VERSION_MAJOR 0
#define KVX_VERSION_MINOR 1
#define KVX_VERSION_PATCH 0
#define KVX_VERSION_STRING "0.1.0"

/* ------------------------------------------------------------------------ */
/* Status codes. Values are stable: new codes are only ever appended.        */
/* ------------------------------------------------------------------------ */
typedef enum kvx_status {
    KVX_OK = 0,
    /* A pointer argument is NULL, a length/count is zero, a string is
     * malformed or a value is out of range. */
    KVX_ERR_INVALID_ARGUMENT = 1,
    /* The handle is 0, unknown, of the wrong kind or already destroyed. */
    KVX_ERR_BAD_HANDLE = 2,
    /* An output buffer is too small; the needed size was reported. */
    KVX_ERR_BUFFER_TOO_SMALL = 3,
    /* The transport (or device) cannot run on this host. */
    KVX_ERR_UNAVAILABLE = 4,
    /* The transport cannot register this kind of memory (e.g. cuda:N on a
     * transport without device-memory support). */
    KVX_ERR_UNSUPPORTED_MEMORY = 5,
    /* A local address range is not inside memory registered with the engine. */
    KVX_ERR_NOT_REGISTERED = 6,
    /* The region ID is not registered (or was deregistered). */
    KVX_ERR_UNKNOWN_REGION = 7,
    /* A write falls outside its remote region. */
    KVX_ERR_OUT_OF_BOUNDS = 8,
    /* The object is still in use (e.g. freeing a batch with pending requests,
     * or a batch that is full). */
    KVX_ERR_BUSY = 9,
    /* A deadline passed before the operation finished. */
    KVX_ERR_TIMEOUT = 10,
    /* The engine, segment or transport is closed. */
    KVX_ERR_CLOSED = 11,
    /* The peer closed the connection or vanished. */
    KVX_ERR_PEER_LOST = 12,
    /* The transfer was canceled or aborted. */
    KVX_ERR_CANCELED = 13,
    /* A transfer failed for another reason (see kvx_last_error). */
    KVX_ERR_TRANSFER_FAILED = 14,
    /* The bootstrap server refused or could not be reached. */
    KVX_ERR_BOOTSTRAP = 15,
    /* The received metadata record's bootstrap_room differs from the room
     * asked for, or the record is incomplete/corrupt. */
    KVX_ERR_ROOM_MISMATCH = 16,
    /* The feature is not available in this build. */
    KVX_ERR_NOT_SUPPORTED = 17,
    /* An internal error (a bug); kvx_last_error says where. */
    KVX_ERR_INTERNAL = 18,
    /* No engine publishes a segment under this name in the metadata store. */
    KVX_ERR_NOT_FOUND = 19,
    /* The metadata server (etcd or http) cannot be reached or refused the request;
     * kvx_last_error names its endpoints. */
    KVX_ERR_METADATA = 20
} kvx_status;

/* ------------------------------------------------------------------------ */
/* Handles                                                                   */
/* ------------------------------------------------------------------------ */
typedef uint64_t kvx_engine_t;    /* one engine: a transport instance + state */
typedef uint64_t kvx_segment_t;   /* a sender's connection to a receiver     */
typedef uint64_t kvx_batch_t;     /* a Mooncake-style transfer batch          */
typedef uint64_t kvx_hostbuf_t;   /* host memory from kvx_alloc_host          */
typedef uint64_t kvx_bootstrap_t; /* an embedded bootstrap server             */
typedef uint64_t kvx_metadata_server_t; /* an embedded HTTP metadata server */
typedef uint32_t kvx_region_t;    /* a registered region, per engine          */

/* ------------------------------------------------------------------------ */
/* Library                                                                   */
/* ------------------------------------------------------------------------ */

/* The library version, "MAJOR.MINOR.PATCH". Static string. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API const char *kvx_version(void);
#endif

/* A static one-line description of a status code ("unknown status" for
 * values not in kvx_status). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API const char *kvx_strerror(int status);
#endif

/* The detailed message of the last failed kvx_ call on THIS thread ("" if the
 * last call succeeded). Valid until the next kvx_ call on this thread.
 * Thread-safe (thread-local). */
#ifndef KVX_TYPES_ONLY
KVX_API const char *kvx_last_error(void);
#endif

/* ------------------------------------------------------------------------ */
/* Embedded bootstrap server (SGLang-compatible HTTP directory)              */
/* ------------------------------------------------------------------------ */

/* Start a bootstrap server on host:port (host NULL = "127.0.0.1"; port 0 =
 * any free port; SGLang's default is 8998). Returns once it is listening.
 * Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_bootstrap_start(const char *host, uint16_t port,
                                kvx_bootstrap_t *out);
#endif

/* Write the server's "host:port" (NUL-terminated) into buf. If cap is too
 * small returns KVX_ERR_BUFFER_TOO_SMALL; *needed (if not NULL) always gets
 * the size including the NUL. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_bootstrap_addr(kvx_bootstrap_t server, char *buf, size_t cap,
                               size_t *needed);
#endif

/* Stop the server and free the handle. Thread-safe; a second call returns
 * KVX_ERR_BAD_HANDLE. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_bootstrap_stop(kvx_bootstrap_t server);
#endif

/* ------------------------------------------------------------------------ */
/* Embedded HTTP metadata server (Mooncake's http://host:port/metadata)      */
/* ------------------------------------------------------------------------ */

/* Start an in-memory metadata server on host:port (host NULL = "127.0.0.1";
 * port 0 = any free port; Mooncake's default is 8080) serving
 * GET/PUT/DELETE /metadata?key=... and GET /health as Mooncake's
 * mooncake_http_metadata_server does. Engines use it with metadata_server
 * "http://host:port/metadata"; so do Mooncake's own engines. Returns once it
 * is listening. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_metadata_server_start(const char *host, uint16_t port,
                                      kvx_metadata_server_t *out);
#endif

/* Write the server's "host:port" (NUL-terminated) into buf; buffer rules as
 * kvx_bootstrap_addr. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_metadata_server_addr(kvx_metadata_server_t server, char *buf,
                                     size_t cap, size_t *needed);
#endif

/* Stop the server (what it stored is lost) and free the handle. Thread-safe;
 * a second call returns KVX_ERR_BAD_HANDLE. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_metadata_server_stop(kvx_metadata_server_t server);
#endif

/* ------------------------------------------------------------------------ */
/* Engines                                                                   */
/* ------------------------------------------------------------------------ */

typedef enum kvx_role {
    KVX_ROLE_PREFILL = 0, /* producer of KV: sends */
    KVX_ROLE_DECODE = 1   /* consumer of KV: receives */
} kvx_role;

/* Engine configuration. Zero-initialise it, set struct_size to
 * sizeof(kvx_engine_config), then set the fields you need. Strings are
 * copied; NULL means the default. Fields are only ever appended: a caller
 * built against an older header passes its smaller struct_size (at least
 * KVX_ENGINE_CONFIG_SIZE_V1) and gets the defaults of the newer fields.
 *
 * Every engine has a segment name and a segment RPC listener (Mooncake's
 * P2PHANDSHAKE): peers open its segment by name (kvx_segment_open_name) and
 * the listener hands them its segment descriptor (epoch, transport
 * endpoint, registered regions with their base addresses). */
typedef struct kvx_engine_config {
    uint32_t struct_size;       /* sizeof(kvx_engine_config) */
    int32_t role;               /* kvx_role */
    const char *transport;      /* "auto" (NULL), "tcp", "shm" (kvx_alloc_host
                                   memory only), "cma" (any host memory on
                                   this host), "rdma" */
    const char *listen_host;    /* data-plane bind host (an IP or a host name of
                                   this machine); NULL = 127.0.0.1 */
    const char *bootstrap_addr; /* "host:port" of the bootstrap server, or NULL */
    uint16_t listen_port;       /* data-plane port; 0 = any free port */
    uint16_t reserved0;
    uint32_t streams;           /* parallel connections per peer; 0 = default */
    /* --- end of KVX_ENGINE_CONFIG_SIZE_V1 (0.1.0) --- */
    /* Mooncake's local_hostname: "host" or "host:rpc_port". The segment RPC
     * listener binds there (0.0.0.0/:: = every interface, advertised as
     * loopback); no port or port 0 = a free port (kvx_engine_rpc_port).
     * A host name ("localhost", this machine's name) binds the first
     * address it resolves to that belongs to this machine (IPv4 first) and
     * is advertised as given, so the default segment name is "name:port".
     * NULL = listen_host, else 127.0.0.1. */
    const char *local_hostname;
    /* Where segment descriptors live. NULL: the environment variable
     * KVXFER_METADATA, else P2P. "" or "P2PHANDSHAKE": P2P (peers are named
     * "host:rpc_port" and answer over their RPC listener).
     * "etcd://host:port[,host:port...][/prefix]": publish this engine's
     * descriptor in etcd under a lease and resolve names there.
     * "http://host:port/metadata": Mooncake's HTTP metadata mode (a
     * kvx_metadata_server, `kvxfer metadata-server` or Mooncake's
     * mooncake_http_metadata_server): the descriptor is stored under
     * "kvxfer/segments/<name>", checked every 5 s and stored again when the
     * server lost it; with no lease, a crashed engine's entry stays until
     * its name is published again. */
    const char *metadata_server;
    /* The segment name peers open; NULL = "host:rpc_port" (required form in
     * P2P mode; with etcd or http any unique string). */
    const char *segment_name;
    /* Bound on each segment RPC / metadata request (open, refresh, submit's
     * address translation) in ms; 0 = 5000. */
    uint32_t rpc_timeout_ms;
    uint32_t reserved1;
    /* Mooncake's device_name: a comma-separated list of the devices a
     * hardware transport may use (RDMA: "mlx5_0,mlx5_1"); NULL or "" = every
     * device found. Ignored by tcp and shm. */
    const char *devices;
} kvx_engine_config;

/* struct_size of the 0.1.0 kvx_engine_config (fields up to streams). */
#define KVX_ENGINE_CONFIG_SIZE_V1 40

/* Create an engine: opens the transports cfg->transport names, as the CLI's
 * --transport does: "tcp", "shm", "cma", "rdma", a comma list, or "auto" (NULL) =
 * every transport that can run here. Segments (kvx_register_memory,
 * transfers) use the highest-priority one (for "auto", cma before shm: it
 * registers a caller's own memory as well as kvx_alloc_host's), which
 * kvx_engine_transport names;
 * KV managers offer them all, so a peer both sides can reach by shm uses
 * shm and another falls back to tcp/rdma. An unknown name is
 * KVX_ERR_INVALID_ARGUMENT. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_engine_create(const kvx_engine_config *cfg, kvx_engine_t *out);
#endif

/* Close the engine's KV managers (and their rooms), segments, batches and
 * transport, and free the handle. Pending transfers fail. Registered memory stays owned by the caller.
 * Thread-safe; a second call returns KVX_ERR_BAD_HANDLE. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_engine_destroy(kvx_engine_t engine);
#endif

/* Write the name of the engine's transport ("tcp", ...) into buf (same
 * buffer rules as kvx_bootstrap_addr). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_engine_transport(kvx_engine_t engine, char *buf, size_t cap,
                                 size_t *needed);
#endif

/* The port of the engine's segment RPC listener (Mooncake's get_rpc_port).
 * Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_engine_rpc_port(kvx_engine_t engine, uint16_t *port);
#endif

/* Write the engine's segment name (NUL-terminated; "host:rpc_port" unless
 * configured) into buf (same buffer rules as kvx_bootstrap_addr).
 * Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_engine_segment_name(kvx_engine_t engine, char *buf, size_t cap,
                                    size_t *needed);
#endif

/* ------------------------------------------------------------------------ */
/* Memory                                                                    */
/* ------------------------------------------------------------------------ */

/* Allocate size bytes (rounded up to the page size) of zeroed, shareable host
 * memory (memfd + mmap, so the shm transport can map it in a peer process).
 * *addr and *len (the rounded size) are written on success. The memory is
 * owned by the library until kvx_free_host. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_alloc_host(const char *name, uint64_t size, kvx_hostbuf_t *out,
                           void **addr, uint64_t *len);
#endif

/* Unmap memory from kvx_alloc_host. Deregister it from every engine first:
 * while an engine still has it registered the call returns KVX_ERR_BUSY
 * (naming the engine and region) and unmaps nothing. Thread-safe; a second
 * call returns KVX_ERR_BAD_HANDLE. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_free_host(kvx_hostbuf_t buf);
#endif

/* Register [addr, addr+len) with the engine's transport, for sending (local
 * reads) and receiving (remote writes). location is "cpu"/"host" for host
 * memory, "cuda:N" for device memory on GPU N, or NULL, "" or "*"
 * (Mooncake's wildcard) to detect it: where CUDA is present the driver's
 * cuPointerGetAttribute tells device memory (cuda:N) from host memory,
 * elsewhere it is host memory. Memory from
 * kvx_alloc_host is recognised and shared by file descriptor. *out is the
 * region ID to name in WRITE requests. KVX_ERR_INVALID_ARGUMENT for a NULL
 * addr or out, len 0, an unknown location or a range overlapping a region
 * already registered; KVX_ERR_UNSUPPORTED_MEMORY when the transport cannot
 * register that kind of memory. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_register_memory(kvx_engine_t engine, void *addr, uint64_t len,
                                const char *location, kvx_region_t *out);
#endif

/* Where the memory at addr lives, as kvx_register_memory detects it for a
 * NULL, empty or "*" location: *device is the CUDA device ordinal for
 * device memory (the driver's cuPointerGetAttribute), -1 for host memory
 * (also wherever CUDA is absent). A caller that touches registered memory
 * with the CPU (Python's read_bytes_from_buffer) asks this first.
 * KVX_ERR_INVALID_ARGUMENT for a NULL addr or device, or a CUDA driver
 * that cannot tell (the message names the address). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_pointer_device(void *addr, int *device);
#endif

/* Deregister a region; later writes to it are refused. A region this
 * engine does not have registered (never, or already deregistered) is
 * KVX_ERR_UNKNOWN_REGION. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_deregister_memory(kvx_engine_t engine, kvx_region_t region);
#endif

/* ------------------------------------------------------------------------ */
/* Segments and the batch API (Mooncake-style one-sided WRITEs)              */
/* ------------------------------------------------------------------------ */

/* RECEIVER side: serialise what a sender needs to open a segment to this
 * engine (its transport endpoint, prepared for the named peer, and every
 * region registered so far) into buf. The blob is opaque; hand it to the
 * sender out of band. Buffer rules as kvx_bootstrap_addr. peer names the
 * sending node (any stable string; NULL = "peer"). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_segment_export(kvx_engine_t engine, const char *peer,
                               void *buf, size_t cap, size_t *needed);
#endif

/* SENDER side: open a segment to the receiver described by blob (from
 * kvx_segment_export). Fails with KVX_ERR_INVALID_ARGUMENT on a malformed
 * blob or a blob from a different transport. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_segment_open(kvx_engine_t engine, const void *blob,
                             size_t len, kvx_segment_t *out);
#endif

/* SENDER side: open the segment named name (Mooncake's openSegment). In P2P
 * mode name is the peer's "host:rpc_port" and its RPC listener answers; with
 * a metadata server the name is resolved there and the engine watches it:
 * when the peer restarts (new epoch) or vanishes (lease expired), the
 * segment's transfers fail with KVX_ERR_PEER_LOST and it must be reopened.
 * Bounded by rpc_timeout_ms. Errors: KVX_ERR_NOT_FOUND (no such name in the
 * metadata store), KVX_ERR_METADATA (store unreachable), KVX_ERR_PEER_LOST
 * (nothing answers at the name: connection refused), KVX_ERR_TIMEOUT (no
 * answer in time), KVX_ERR_INVALID_ARGUMENT (bad name, transports differ).
 * Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_segment_open_name(kvx_engine_t engine, const char *name,
                                  kvx_segment_t *out);
#endif

/* One region of a peer's segment descriptor. */
typedef struct kvx_region_info {
    uint64_t addr;   /* base virtual address in the peer process */
    uint64_t length; /* bytes */
    uint32_t region; /* kvx_region_t on the peer */
    int32_t kind;    /* 0 host, 1 cuda */
} kvx_region_info;

/* Copy up to cap regions of the peer's descriptor (as last fetched), in
 * registration order (ascending region ID), into out; *n gets the total
 * count (call with cap 0 to size the array). The first is Mooncake's
 * get_first_buffer_address. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_segment_regions(kvx_segment_t segment, kvx_region_info *out,
                                uint32_t cap, uint32_t *n);
#endif

/* Fetch the peer's descriptor again over its RPC listener (new regions
 * become writable; a restarted peer makes the segment fail with
 * KVX_ERR_PEER_LOST). Submits refresh on their own when an address or
 * region misses, once per call. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_segment_refresh(kvx_segment_t segment);
#endif


/* Close the segment; its pending batches fail and all its batch handles are
 * freed (later calls on them return KVX_ERR_BAD_HANDLE). Thread-safe; a
 * second call returns KVX_ERR_BAD_HANDLE. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_segment_close(kvx_segment_t segment);
#endif

/* One WRITE: length bytes from local_addr (inside memory registered with the
 * sending engine) to byte remote_offset of the receiver's region
 * remote_region. count > 1 makes it strided: count blocks of length bytes,
 * block i read at local_addr + i*local_stride and written at
 * remote_offset + i*remote_stride (count 0 means 1). 48 bytes.
 *
 * The same struct describes one READ (kvx_batch_submit_read,
 * kvx_segment_read), in the reverse direction: block i is copied FROM
 * remote_offset + i*remote_stride of the peer's region remote_region INTO
 * local_addr + i*local_stride (inside memory registered with the reading
 * engine).
 *
 * remote_region == KVX_REGION_PEER_ADDRESS addresses the peer by virtual
 * address (Mooncake's peer_buffer_address): remote_offset is then an address
 * in the peer process, translated to (region, offset) with the segment's
 * descriptor; all blocks must fall in one peer region. A range outside every
 * region the peer registered (after one refresh of the descriptor) fails
 * with KVX_ERR_OUT_OF_BOUNDS naming the peer, address and length. */
#define KVX_REGION_PEER_ADDRESS 0xFFFFFFFFu
typedef struct kvx_write_request {
    uint64_t local_addr;
    uint64_t remote_offset;
    uint64_t length;
    uint64_t local_stride;
    uint64_t remote_stride;
    uint32_t remote_region; /* kvx_region_t of the receiver */
    uint32_t count;
} kvx_write_request;

/* Per-request state, as in kvx_transfer_status.state. */
typedef enum kvx_transfer_state {
    KVX_TRANSFER_EMPTY = 0,     /* no request at this index yet */
    KVX_TRANSFER_PENDING = 1,
    KVX_TRANSFER_COMPLETED = 2,
    KVX_TRANSFER_FAILED = 3,
    KVX_TRANSFER_CANCELED = 4
} kvx_transfer_state;

typedef struct kvx_transfer_status {
    int32_t state;       /* kvx_transfer_state */
    int32_t error;       /* kvx_status of the failure (KVX_OK unless failed) */
    uint64_t bytes_done; /* bytes of this request known to have landed */
} kvx_transfer_status;

/* Allocate a batch of up to capacity requests on a segment. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_batch_alloc(kvx_segment_t segment, uint32_t capacity,
                            kvx_batch_t *out);
#endif

/* Submit n WRITE requests; they get the next n request indices of the batch
 * (the first submit gets 0..n-1). reqs must hold n requests. n is checked
 * before reqs is read: 0 or more than the batch's capacity is
 * KVX_ERR_INVALID_ARGUMENT, more than its free indices (capacity minus the
 * requests already submitted) KVX_ERR_BUSY; then all are validated
 * (registered local memory: KVX_ERR_NOT_REGISTERED; known remote region,
 * bounds); on error nothing is sent. Requests of one submit call travel as
 * one transfer batch and complete (or fail) together. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_batch_submit(kvx_batch_t batch, const kvx_write_request *reqs,
                             uint32_t n);
#endif

/* Submit n READ requests (one-sided READs of the peer's registered memory
 * into local registered memory; see kvx_write_request), with the same
 * rules as kvx_batch_submit: the next n request indices, validation first
 * (nothing is read on error), one transfer batch that completes or fails
 * together, then kvx_batch_status / _wait / _cancel / _free as for writes.
 * Works on tcp (the peer's transport serves the read from its registered
 * region), rdma (RDMA READ work requests) and shm (a copy from the mapped
 * region). The peer refuses a read of a region it deregistered
 * (KVX_ERR_UNKNOWN_REGION, or KVX_ERR_OUT_OF_BOUNDS on rdma, whose NIC
 * reports both alike) or of a data path it fenced (KVX_ERR_PEER_LOST);
 * a peer lost mid-read fails the batch with KVX_ERR_PEER_LOST and the
 * local bytes of the requests are then unspecified. A batch may hold
 * write and read submits. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_batch_submit_read(kvx_batch_t batch, const kvx_write_request *reqs,
                                  uint32_t n);
#endif

/* Submit n WRITE requests given as three arrays (struct of arrays), the
 * shape Mooncake's batch_transfer_sync_write callers hold (buffers,
 * peer_buffer_addresses, lengths): request i moves lengths[i] bytes from
 * local_addrs[i] to remote_offsets[i] of region remote_region, or, with
 * remote_region == KVX_REGION_PEER_ADDRESS, to the peer process's address
 * remote_offsets[i]. One block per request (no strides). Otherwise as
 * kvx_batch_submit: the next n request indices, validation first (a zero
 * length: KVX_ERR_INVALID_ARGUMENT; local memory not registered:
 * KVX_ERR_NOT_REGISTERED; a peer range outside the peer's regions:
 * KVX_ERR_OUT_OF_BOUNDS; each naming the request's index; nothing is sent
 * on error), one transfer batch. The arrays are read during the call only.
 * As for every batch submit, the engine coalesces the requests before the
 * transport sees them: runs adjacent on both sides become one request, and
 * (tcp, shm) runs of equal length and equal strides one strided request,
 * the shape of per-token-slot head slices; the request indices, statuses
 * and bytes stay the caller's. The counts are the metrics
 * kvxfer_segment_requests_total and kvxfer_segment_descriptors_total
 * (kvx_metrics_text). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_batch_submit_soa(kvx_batch_t batch, uint32_t n,
                                 const uint64_t *local_addrs,
                                 const uint64_t *remote_offsets,
                                 const uint64_t *lengths,
                                 uint32_t remote_region);
#endif

/* READ requests as three arrays: kvx_batch_submit_soa's rules, in the
 * direction of kvx_batch_submit_read (lengths[i] bytes from the peer's
 * remote_offsets[i] into local_addrs[i]). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_batch_submit_read_soa(kvx_batch_t batch, uint32_t n,
                                      const uint64_t *local_addrs,
                                      const uint64_t *remote_offsets,
                                      const uint64_t *lengths,
                                      uint32_t remote_region);
#endif

/* Synchronous WRITE of three arrays (Mooncake's batch_transfer_sync_write
 * in one call): kvx_batch_submit_soa's entries and rules, sent as one batch
 * to `segment` and waited for; returns once every byte landed (KVX_OK) or
 * with the error of the batch (kvx_batch_wait's codes). It is
 * kvx_batch_alloc + kvx_batch_submit_soa + kvx_batch_wait + kvx_batch_free
 * in one call into the library (no batch handle, no KVX_EVENT_BATCH
 * notification): the cheaper path for many small synchronous calls from
 * many threads. Bounded by timeout_ms (0 = rpc_timeout_ms): KVX_ERR_TIMEOUT
 * then, with the batch canceled (as kvx_batch_cancel: bytes already in
 * flight may still land).
 * n at most 1,048,576. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_segment_write_soa(kvx_segment_t segment, uint32_t n,
                                  const uint64_t *local_addrs,
                                  const uint64_t *remote_offsets,
                                  const uint64_t *lengths,
                                  uint32_t remote_region, uint32_t timeout_ms);
#endif

/* Synchronous READ of three arrays: kvx_segment_write_soa in the direction
 * of kvx_batch_submit_read_soa (lengths[i] bytes from the peer's
 * remote_offsets[i] into local_addrs[i]). On KVX_ERR_TIMEOUT the read
 * was canceled and waited for (up to 10 s more; last_error says when it
 * had not stopped by then), so no byte lands after it returns. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_segment_read_soa(kvx_segment_t segment, uint32_t n,
                                 const uint64_t *local_addrs,
                                 const uint64_t *remote_offsets,
                                 const uint64_t *lengths,
                                 uint32_t remote_region, uint32_t timeout_ms);
#endif

/* Non-blocking: the status of request `index` (KVX_TRANSFER_EMPTY for an
 * index not submitted yet; an index at or past the batch's capacity is
 * KVX_ERR_INVALID_ARGUMENT). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_batch_status(kvx_batch_t batch, uint32_t index,
                             kvx_transfer_status *out);
#endif

/* Block until every submitted request is terminal or timeout_ms passes
 * (KVX_ERR_TIMEOUT; timeout_ms 0 polls: requests already terminal never
 * time out). Returns KVX_OK if all completed, else the error of the first
 * failed request (KVX_ERR_CANCELED for a canceled one). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_batch_wait(kvx_batch_t batch, uint32_t timeout_ms);
#endif

/* Ask every pending request to stop (best effort; poll until terminal).
 * Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_batch_cancel(kvx_batch_t batch);
#endif

/* Free a batch whose requests are all terminal (KVX_ERR_BUSY otherwise).
 * Thread-safe; a second call returns KVX_ERR_BAD_HANDLE. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_batch_free(kvx_batch_t batch);
#endif

/* Synchronous one-sided READ (Mooncake's transfer_sync_read): the n
 * requests as one read batch (see kvx_batch_submit_read; strided requests
 * allowed), returning once every byte landed in local memory. The remote
 * side is named like a WRITE (remote_region + remote_offset, or
 * KVX_REGION_PEER_ADDRESS). Works on tcp, rdma and shm. Bounded by
 * timeout_ms (0 = rpc_timeout_ms): KVX_ERR_TIMEOUT then, after the read was
 * canceled and has stopped. Errors: KVX_ERR_NOT_REGISTERED (local memory
 * not registered with this engine), KVX_ERR_OUT_OF_BOUNDS /
 * KVX_ERR_UNKNOWN_REGION (a range or region the peer did not register, or
 * deregistered; nothing is read), KVX_ERR_PEER_LOST (peer gone or the data
 * path fenced). KVX_ERR_NOT_SUPPORTED only from a transport that cannot
 * read (none of the built-in ones). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_segment_read(kvx_segment_t segment, const kvx_write_request *reqs,
                             uint32_t n, uint32_t timeout_ms);
#endif

/* ------------------------------------------------------------------------ */
/* Notifications                                                             */
/* ------------------------------------------------------------------------ */

typedef enum kvx_event_kind {
    KVX_EVENT_BATCH = 1, /* one submit call of a batch became terminal */
    KVX_EVENT_ROOM = 2   /* a KV room changed KVPoll state */
} kvx_event_kind;

typedef struct kvx_event {
    int32_t kind;        /* kvx_event_kind */
    int32_t status;      /* kvx_status of the outcome (KVX_OK on success) */
    uint64_t handle;     /* the kvx_batch_t (or room sender/receiver handle) */
    uint32_t first;      /* BATCH: first request index of the submit call */
    uint32_t count;      /* BATCH: number of requests in it */
    uint64_t room;       /* ROOM: bootstrap_room */
    int32_t state;       /* ROOM: kvx_kvpoll; BATCH: kvx_transfer_state */
    int32_t reserved;
} kvx_event;

/* Called from a library-owned thread, never concurrently for one engine,
 * in the order the events happened. The callback may call kvx_ functions
 * (except kvx_engine_set_notify and kvx_engine_destroy, which return
 * KVX_ERR_BUSY there) but must not block for long: it holds up the engine's
 * later events. Events that occur while no callback is installed are
 * dropped. */
typedef void (*kvx_notify_fn)(void *user_data, const kvx_event *event);

/* Install (fn != NULL) or remove (fn == NULL) the engine's notification
 * callback. After removal returns, the old callback is not running and will
 * not be called again. user_data is passed back unchanged and is owned by the
 * caller. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_engine_set_notify(kvx_engine_t engine, kvx_notify_fn fn,
                                  void *user_data);
#endif

/* ------------------------------------------------------------------------ */
/* KV-room API (SGLang-shaped: one KV manager per rank, one sender or         */
/* receiver per bootstrap_room)                                               */
/* ------------------------------------------------------------------------ */

typedef uint64_t kvx_kv_t;   /* a rank's KV manager (on the caller's buffers, or owning its pool) */
typedef uint64_t kvx_room_t; /* a KV sender (prefill) or receiver (decode) */

/* KVPoll states, SGLang's values (base/conn.py KVPoll). States only move
 * forward; Failed is sticky. A TP group may all-reduce them with MIN. */
typedef enum kvx_kvpoll {
    KVX_KVPOLL_FAILED = 0,
    KVX_KVPOLL_BOOTSTRAPPING = 1,
    KVX_KVPOLL_WAITING_FOR_INPUT = 2,
    KVX_KVPOLL_TRANSFERRING = 3,
    KVX_KVPOLL_SUCCESS = 4
} kvx_kvpoll;

/* KV manager configuration. Zero-initialise it, set struct_size to
 * sizeof(kvx_kv_config), then set the fields you need. Fields are only ever
 * appended: a caller built against an older header passes its smaller
 * struct_size (at least KVX_KV_CONFIG_SIZE_V1) and the newer fields read as
 * 0 / NULL.
 *
 * The KV memory is SGLang's KVArgs: MHA/GQA keeps 2 x layers buffers
 * (K_0..K_{L-1}, V_0..V_{L-1}), MLA one per layer; each buffer holds pages of
 * item_len bytes, token slot t of a page at t x item_len/page_size, the
 * kv_head_num heads of a token back to back.
 *
 * Two ways to give it:
 *  - the caller's own buffers (a serving engine's per-layer tensors): set
 *    num_kv_buffers and the kv_data_ptrs/kv_data_lens/kv_item_lens arrays
 *    (and aux_*, state_* when used), kv_head_num, total_kv_head_num, is_mla,
 *    prefill_start_layer; model, num_layers, num_kv_heads, head_dim,
 *    dtype_bytes and num_pages must then be 0/NULL and the library allocates
 *    nothing. Buffers must not overlap.
 *  - (0.1) a model: model (or num_layers/num_kv_heads/head_dim/dtype_bytes)
 *    and num_pages; the library allocates one pool (kvx_kv_pool). */
typedef struct kvx_kv_config {
    uint32_t struct_size;     /* sizeof(kvx_kv_config) */
    uint32_t page_size;       /* tokens per page; 0 = 16 */
    const char *model;        /* built-in model name or a config.json path;
                                 NULL = the explicit sizes below */
    uint32_t num_layers;      /* with model == NULL: num_hidden_layers */
    uint32_t num_kv_heads;    /* with model == NULL: num_key_value_heads */
    uint32_t head_dim;        /* with model == NULL: elements per head */
    uint32_t dtype_bytes;     /* with model == NULL: bytes per element */
    uint32_t num_pages;       /* pool capacity in pages (> 0) */
    uint32_t tp_size;         /* attention TP size; 0 = 1 */
    uint32_t tp_rank;
    uint32_t pp_size;         /* 0 = 1 */
    uint32_t pp_rank;
    uint32_t dp_size;         /* prefill: instance DP size; 0 = 1 */
    uint32_t dp_rank;
    uint32_t checksum;        /* decode: 1 = verify a CRC32C of the bytes */
    const char *kv_cache_dtype; /* --kv-cache-dtype; NULL = "auto" */
    const char *control_host;   /* ZMQ control bind/advertise host; NULL = 127.0.0.1 */
    uint16_t control_port;      /* 0 = any free port */
    uint16_t reserved0;
    uint32_t bootstrap_timeout_ms; /* 0 = env SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT or 300 s */
    uint32_t waiting_timeout_ms;   /* 0 = env SGLANG_DISAGGREGATION_WAITING_TIMEOUT or 300 s */
    uint32_t reserved1;
    /* --- end of KVX_KV_CONFIG_SIZE_V1 (0.1.0) --- */
    /* Caller-owned buffers (SGLang KVArgs). Three parallel arrays per list:
     * address, length in bytes, item length in bytes (KV: one page; aux: one
     * request row, indexed by aux_index; state: one slot). The engine rank is
     * tp_rank, the TP size tp_size, the PP place pp_rank/pp_size. */
    uint32_t num_kv_buffers;        /* > 0 selects this way */
    uint32_t num_aux_buffers;       /* 0 = no aux rows */
    const uint64_t *kv_data_ptrs;   /* MHA: K of each layer, then V; MLA: one per layer */
    const uint64_t *kv_data_lens;
    const uint64_t *kv_item_lens;
    const uint64_t *aux_data_ptrs;  /* host memory (SGLang's MetadataBuffers) */
    const uint64_t *aux_data_lens;
    const uint64_t *aux_item_lens;
    uint32_t num_state_buffers;     /* 0 = no state (Mamba, SWA, ...) */
    uint32_t kv_head_num;           /* heads per token row on this rank; 0 with
                                       total_kv_head_num set = max(1, total / tp_size);
                                       both 0 on a non-MLA decode (SGLang's decode sets
                                       neither) = unknown: taken from the prefill's
                                       geometry at registration */
    const uint64_t *state_data_ptrs; /* same memory as the KV buffers */
    const uint64_t *state_data_lens;
    const uint64_t *state_item_lens;
    uint32_t total_kv_head_num;     /* the model's KV heads; 0 = kv_head_num x tp_size
                                       (see kv_head_num for both 0) */
    uint32_t is_mla;                /* 1: one latent buffer per layer, never head-sliced */
    uint32_t prefill_start_layer;   /* model layer of KV buffer 0 (a PP stage's first) */
    uint32_t system_dp_rank;        /* SGLang system_dp_rank (kept for the caller) */
    const char *kv_location;        /* KV and state buffers: NULL/"host"/"cpu", or
                                       "cuda:N" (device memory on GPU N = gpu_id; the
                                       engine's transport must move device memory) */
    const char *ib_device;          /* SGLang ib_device (informational); NULL = none */
    /* --- end of KVX_KV_CONFIG_SIZE_V2 (0.2.0) --- */
    const char *bootstrap_auth_token; /* bearer token the bootstrap directory requires on
                                         PUT/DELETE /route (SGLang's newest server always
                                         does); NULL/"" = env KVXFER_BOOTSTRAP_AUTH_TOKEN,
                                         then SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN,
                                         else none (a 401 then says the token is missing).
                                         With control_auth it also keys an HMAC on every
                                         control frame: frames without a valid tag are
                                         dropped (every rank needs it) */
    const char *advertise_host;     /* host peers are told to connect to (rank_ip and
                                       endpoints); NULL/"" = env KVXFER_ADVERTISE_HOST,
                                       else control_host, and for a wildcard control_host
                                       (0.0.0.0, ::) the default-route interface's address */
    /* --- end of KVX_KV_CONFIG_SIZE_V3 (up to the directory token, advertise host) --- */
    uint32_t control_auth;          /* control-frame authentication (KVX_CONTROL_AUTH_*):
                                       0 = env KVXFER_CONTROL_AUTH ("1" = on, "0" = off;
                                       unset = on when the rank has a bootstrap token:
                                       bootstrap_auth_token or its environment);
                                       1 = on: every control frame this rank sends carries
                                       an HMAC-SHA256 tag keyed by bootstrap_auth_token
                                       (required: KVX_ERR_INVALID_ARGUMENT without one),
                                       frames without a valid tag, or replayed, are
                                       dropped (kvxfer_control_frames_dropped_total);
                                       every prefill and decode rank of the deployment
                                       needs it and the same token; 2 = off (the
                                       environment is not read) */
    uint32_t max_peers;             /* control peers this rank keeps a socket and state
                                       for; beyond it the least recently used idle one is
                                       closed, with none idle a new peer is refused naming
                                       the limit. 0 = env KVXFER_MAX_PEERS, else 1024 */
    /* --- end of KVX_KV_CONFIG_SIZE_V4 (up to max_peers) --- */
    const char *decode_allocation_policy; /* SGLang's
                                       --disaggregation-decode-allocation-policy, both
                                       roles: "early" or "prefill_complete"; NULL/"" =
                                       "early". A prefill declares it in its directory
                                       registration (every rank of the instance must
                                       declare the same: the directory refuses another
                                       with 400) and under "prefill_complete" answers the
                                       decodes once kvx_kv_sender_mark_prefill_complete
                                       is called. A decode under "prefill_complete"
                                       reserves nothing for a room (its state stays
                                       BOOTSTRAPPING: allocate the pages once it is
                                       WAITING_FOR_INPUT) until every prefill rank of the
                                       room computed it, within the waiting timeout, and
                                       fails rooms of a prefill declaring "early" */
    const char *dsv41_spec_layout;  /* prefill: the DeepSeek-V4.1 DSpark KV layout this
                                       rank declares, JSON object text (SGLang's
                                       get_dsv41_spec_layout); NULL/"" = none. Every rank
                                       must declare the same */
    /* --- end of KVX_KV_CONFIG_SIZE_V5 (up to dsv41_spec_layout) --- */
    uint32_t prefill_http_port;     /* prefill: the serving engine's HTTP API port
                                       (SGLang's --port) this rank declares in its
                                       directory registration (prefill_http_port): an
                                       SGLang decode POSTs a retracted request to
                                       http://{bootstrap host}:{port}/generate there (PD
                                       rebootstrap). 0 = none; at most 65535 */
    uint32_t reserved2;
} kvx_kv_config;

/* kvx_kv_config.control_auth values. */
#define KVX_CONTROL_AUTH_ENV 0 /* env KVXFER_CONTROL_AUTH (1 on, 0 off); unset: on with a token */
#define KVX_CONTROL_AUTH_ON 1
#define KVX_CONTROL_AUTH_OFF 2

/* struct_size of the 0.1.0 kvx_kv_config (fields up to reserved1). */
#define KVX_KV_CONFIG_SIZE_V1 96
/* struct_size of a 0.2 kvx_kv_config (up to ib_device). */
#define KVX_KV_CONFIG_SIZE_V2 216
/* struct_size of a kvx_kv_config up to advertise_host (before control_auth). */
#define KVX_KV_CONFIG_SIZE_V3 232
/* struct_size of a kvx_kv_config up to max_peers (before decode_allocation_policy). */
#define KVX_KV_CONFIG_SIZE_V4 240
/* struct_size of a kvx_kv_config up to dsv41_spec_layout (before prefill_http_port). */
#define KVX_KV_CONFIG_SIZE_V5 256

/* Geometry reported by kvx_kv_layout_get. For a library-allocated pool, item
 * (buffer b, page p) is the item_len bytes at pool + b*buffer_len +
 * p*item_len. With caller buffers: item_len is KV buffer 0's, num_pages the
 * pages every KV buffer holds, buffer_len = num_pages x item_len, pool_len 0. */
typedef struct kvx_kv_layout {
    uint64_t item_len;    /* bytes per page per buffer (SGLang kv_item_len) */
    uint64_t buffer_len;  /* bytes per buffer = num_pages * item_len */
    uint64_t pool_len;    /* bytes of the whole pool */
    uint32_t num_buffers;
    uint32_t num_pages;
    uint32_t page_size;   /* tokens */
    uint32_t reserved;
} kvx_kv_layout;

/* Create the rank's KV manager on an engine: registers the caller's buffers
 * (or allocates the 0.1 pool, shareable host memory) with the engine's
 * transport, binds the control socket and, for a prefill engine, registers
 * the rank with the engine's bootstrap_addr (retrying until the bootstrap
 * timeout). Refusals (KVX_ERR_INVALID_ARGUMENT, kvx_last_error says which
 * buffer and why): zero-length or overlapping buffers, item lengths that are
 * not whole head rows, both a model and buffers; KVX_ERR_UNSUPPORTED_MEMORY
 * when the transport cannot move the buffers (e.g. shm and device memory, or
 * shm and host memory not from kvx_alloc_host). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_create(kvx_engine_t engine, const kvx_kv_config *cfg,
                          kvx_kv_t *out);
#endif

/* Close every room, the control socket and free the KV pool (kvx_engine_destroy
 * does this for managers still open on the engine). Thread-safe; a second call returns
 * KVX_ERR_BAD_HANDLE. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_destroy(kvx_kv_t kv);
#endif

/* The KV pool's address and size: owned by the manager, valid until
 * kvx_kv_destroy. The caller writes (prefill) or reads (decode) KV there.
 * KVX_ERR_INVALID_ARGUMENT for a manager on caller buffers. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_pool(kvx_kv_t kv, void **addr, uint64_t *len);
#endif

/* The pool geometry. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_layout_get(kvx_kv_t kv, kvx_kv_layout *out);
#endif

/* Write the transports this KV manager registered its buffers with, in
 * selection order and comma-separated ("shm,cma,tcp"; "cma,tcp" when shm
 * cannot share the caller's buffers), into buf (same buffer rules as
 * kvx_bootstrap_addr). A transfer uses the first one both ranks have that
 * reaches the peer. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_transports(kvx_kv_t kv, char *buf, size_t cap, size_t *needed);
#endif

/* PREFILL: create the sender of one request (bootstrap_room < 2^63).
 * KVX_ERR_BUSY if a sender for the room is active on this rank.
 * Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_sender_create(kvx_kv_t kv, uint64_t room, kvx_room_t *out);
#endif

/* PREFILL: declare the request's page count (optional; SGLang sender.init
 * without an aux row). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_sender_init(kvx_room_t sender, uint32_t num_pages);
#endif

/* PREFILL: SGLang sender.init(num_kv_indices, aux_index): num_pages pages
 * will be sent (those after the decode's prefix) and aux_index is this
 * rank's aux row of the request (< 0: none); with the last chunk row
 * aux_index of every aux buffer is written to the decode's row, after the KV
 * and before the metadata record's commit word. Call before the first
 * kvx_kv_sender_send. KVX_ERR_INVALID_ARGUMENT: aux_index beyond the aux
 * buffers. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_sender_init_aux(kvx_room_t sender, uint32_t num_pages,
                                   int64_t aux_index);
#endif

/* PREFILL: kvx_kv_sender_init_aux for a prompt of prompt_tokens tokens:
 * sends ceil((prompt_tokens - decode prefix) / page_size) pages, returned in
 * *num_pages. Call once the state is WAITING_FOR_INPUT. A decode prefix
 * longer than the prompt fails the room on both sides (the error names both
 * counts). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_sender_init_tokens(kvx_room_t sender, uint32_t prompt_tokens,
                                      int64_t aux_index, uint32_t *num_pages);
#endif

/* PREFILL: SGLang pop_decode_prefix_len: the prompt tokens the decode
 * already holds (0 when it stated none); only the pages after them are sent.
 * Valid once the state is WAITING_FOR_INPUT. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_sender_prefix_len(kvx_room_t sender, uint32_t *tokens);
#endif

/* PREFILL: SGLang's KVSender.mark_prefill_complete: this rank finished
 * computing the request's KV. Under the "prefill_complete" decode allocation
 * policy (kvx_kv_config.decode_allocation_policy on both roles) the decodes
 * that subscribed to the room are told now (a later one at once) and only
 * then reserve their pages and send their destinations, so the state becomes
 * WAITING_FOR_INPUT after this call; the room's bootstrap timeout counts from
 * it. Under "early" it only records the time. Call it once the KV is in the
 * source pages, before kvx_kv_sender_send; a second call does nothing. Errors:
 * the room already failed (its failure, kvx_last_error), or was closed.
 * Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_sender_mark_prefill_complete(kvx_room_t sender);
#endif

/* PREFILL: this rank's state slots of the request (SGLang send(...,
 * state_indices)): with the last chunk, slot state_indices[k] of every state
 * buffer is copied to the decode's slot k. Call before the last
 * kvx_kv_sender_send. The list is copied. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_sender_state(kvx_room_t sender, const int32_t *state_indices,
                                uint32_t n);
#endif

/* PREFILL: queue n source pages (pool page indices, request order); they map
 * one-to-one onto the decode's next destination pages. last != 0 marks the
 * final chunk, after which the metadata record and the status follow. Call
 * once the state is WAITING_FOR_INPUT. Returns at once; the page list is
 * copied. pages must hold n entries; n is checked before it is read: more
 * pages than the KV buffers hold is KVX_ERR_INVALID_ARGUMENT, as is a page
 * index beyond them. Thread-safe, but chunks of one room must come from one thread (or
 * be ordered by the caller): their order is the page order. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_sender_send(kvx_room_t sender, const int32_t *pages,
                               uint32_t n, int last);
#endif

/* PREFILL, layer-wise: queue the KV of model layers first_layer..last_layer
 * (inclusive; within this rank's layers, [prefill_start_layer,
 * prefill_start_layer + layers)) for n source pages (pool page indices, in
 * request order, after the decode's prefix). Each layer has its own cursor:
 * the pages map onto the next destination pages of those layers, which must
 * all have been sent the same number of pages so far, so a chunked prefill
 * may go chunk by chunk and layer by layer in either order; the source page
 * at a position must be the same for every layer. Call it as the forward
 * pass finishes each layer (range) of each chunk (vLLM save_kv_layer). The
 * call that completes every page of every layer is the last: the aux row,
 * the state slots and the metadata record (which states the pages and the
 * layers it covers) follow it; the decode accepts the room only whole. A
 * room with no page to send (the decode holds the prompt, or this rank only
 * has dummy destinations) names every layer once with n = 0. It may be
 * mixed with kvx_kv_sender_send (= every layer of this rank).
 *
 * cuda_event: NULL to send at once, or the cudaEvent_t (the driver's
 * CUevent; PyTorch's torch.cuda.Event().cuda_event) the caller recorded on
 * its compute stream right after writing these layers' KV: the writes are
 * posted once the event completed (cudaEventQuery, polled by the library
 * on the rank's GPU: kvx_kv_config.gpu_id, else the device of the KV
 * buffers, else 0), so the compute stream never waits for kvxfer. The event
 * is the caller's: it must stay valid until kvx_kv_sender_flush returned
 * OK for a later point, or kvx_kv_close returned. An event whose query
 * fails (a failed kernel) fails the room on both sides.
 *
 * Returns at once (the queue is unbounded); the page list is copied.
 * KVX_ERR_INVALID_ARGUMENT: a layer outside this rank, a page beyond the
 * pool or a call after the last refuse the call; layers of the range at
 * different pages, more pages than the decode asked for, or another source
 * page than an earlier layer sent at that position also fail the room (the
 * decode is told why);
 * KVX_ERR_NOT_SUPPORTED: an event was given but CUDA cannot be loaded.
 * Thread-safe; calls of one room must be ordered by the caller. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_sender_send_layers(kvx_room_t sender, const int32_t *pages,
                                      uint32_t n, uint32_t first_layer,
                                      uint32_t last_layer, void *cuda_event);
#endif

/* PREFILL: block until every chunk queued by kvx_kv_sender_send and
 * kvx_kv_sender_send_layers before this call has been written to every
 * decode destination (their events completed, their writes acknowledged),
 * so what they read may be reused (vLLM wait_for_save). KVX_OK;
 * KVX_ERR_TIMEOUT after timeout_ms; the room's failure status once it
 * failed (kvx_kv_failure says why). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_sender_flush(kvx_room_t sender, uint32_t timeout_ms);
#endif

/* DECODE: create the receiver of one request whose prefill instance registers
 * at bootstrap_addr ("host:port"; NULL = the engine's bootstrap_addr). It
 * starts resolving its producers at once. KVX_ERR_BUSY if a receiver for the
 * room is active on this rank. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_receiver_create(kvx_kv_t kv, const char *bootstrap_addr,
                                   uint64_t room, kvx_room_t *out);
#endif

/* DECODE: kvx_kv_receiver_create with the prefill DP rank the router chose
 * (SGLang KVReceiver.init(prefill_dp_rank)); prefill_dp_rank < 0 resolves it
 * through the bootstrap server. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_receiver_create_dp(kvx_kv_t kv, const char *bootstrap_addr,
                                      uint64_t room, int32_t prefill_dp_rank,
                                      kvx_room_t *out);
#endif

/* DECODE: give the n destination pages (pool page indices in token order,
 * may be non-contiguous); the receiver then asks its producers for the KV.
 * The list is copied; n is checked before it is read (0, or more pages than
 * the KV buffers hold, is KVX_ERR_INVALID_ARGUMENT, as is a page index
 * beyond them). Once per receiver (= kvx_kv_receiver_send_metadata
 * with no aux row, no state, no prefix). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_receiver_init(kvx_room_t receiver, const int32_t *pages,
                                 uint32_t n);
#endif

/* DECODE: SGLang send_metadata(kv_indices, aux_index, state_indices,
 * decode_prefix_len): pages are the destination pages of the prompt tokens
 * after prefix_tokens (the tokens this rank already holds: whole pages; n may
 * be 0 when only the aux row is missing), aux_index the row the request's aux
 * data lands in (< 0: none), state_indices the state slots (NULL/0: none).
 * Lists are copied. Once per receiver. KVX_ERR_INVALID_ARGUMENT names the
 * index beyond a buffer or the prefix that is not whole pages. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_receiver_send_metadata(kvx_room_t receiver, const int32_t *pages,
                                          uint32_t n, int64_t aux_index,
                                          const int32_t *state_indices,
                                          uint32_t n_state, uint32_t prefix_tokens);
#endif

/* DECODE: copy row aux_index of aux buffer `buffer` into buf once the state
 * is SUCCESS (the aux row is also in the caller's own aux buffer).
 * KVX_ERR_BUFFER_TOO_SMALL when cap is short; *needed (if not NULL) always
 * gets the row size. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_receiver_aux_row(kvx_room_t receiver, uint32_t buffer,
                                    void *buf, size_t cap, size_t *needed);
#endif

/* A room's transfer figures (SGLang get_transfer_metric). Set struct_size to
 * sizeof(kvx_transfer_metric); fields are only ever appended. */
typedef struct kvx_transfer_metric {
    uint32_t struct_size;
    uint32_t prefix_tokens;  /* decode_prefix_len: tokens not sent */
    uint64_t latency_us;     /* sender: first send -> SUCCESS; receiver:
                                send_metadata -> SUCCESS; 0 before SUCCESS */
    uint64_t bytes;          /* KV bytes moved (all destinations / producers) */
    uint64_t aux_bytes;      /* aux-row and state bytes moved */
    uint64_t skipped_bytes;  /* KV bytes the prefix saved */
    uint32_t pages;          /* pages moved per destination */
    uint32_t reserved;
} kvx_transfer_metric;

/* Sender or receiver: the room's transfer figures so far. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_metric(kvx_room_t room, kvx_transfer_metric *out);
#endif

/* Sender or receiver: declare the request's token count (prompt length,
 * >= 1). The prefill writes it into the metadata record (token_count) and the
 * decode sends it in TRANSFER; when both sides declared one and they differ
 * the room fails on both sides, the error naming both counts. Call it before
 * kvx_kv_sender_send / kvx_kv_receiver_init (or _send_metadata). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_set_tokens(kvx_room_t room, uint32_t tokens);
#endif

/* A room has one outcome on both sides: a prefill sender reaches SUCCESS
 * only after every decode destination verified the room and said so; any
 * failure on either side reaches the other (ABORT / STATUS) and fails the
 * room there too ("aborted by decode: <reason>").
 * Sender or receiver: the current KVPoll state (kvx_kvpoll) in *state.
 * Non-blocking. When the state is FAILED, the return value is still KVX_OK
 * and kvx_kv_failure tells why. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_poll(kvx_room_t room, int32_t *state);
#endif

/* Block until the state is at least want (or FAILED) or timeout_ms passes;
 * *state gets the state reached. KVX_ERR_TIMEOUT on timeout. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_wait(kvx_room_t room, int32_t want, uint32_t timeout_ms,
                        int32_t *state);
#endif

/* Why the room failed: KVX_OK if it has not failed, else the failure's
 * status (KVX_ERR_ROOM_MISMATCH when the metadata record named another
 * bootstrap_room or was corrupt, KVX_ERR_CANCELED on abort, KVX_ERR_TIMEOUT,
 * KVX_ERR_PEER_LOST, ...) with the reason in kvx_last_error. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_failure(kvx_room_t room);
#endif

/* Abort the request (the peer is told; the state becomes FAILED).
 * Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_abort(kvx_room_t room);
#endif

/* Forget the room (aborting it if not terminal) and free the handle.
 * DECODE: when it returns, the room's destination pages may be reused (and
 * its metadata slot is released). After SUCCESS that is at once. After a
 * failure it waits until every producer that was asked for the room is
 * fenced: it acknowledged the abort after its last write (normally within
 * milliseconds), or, when no clean acknowledgement came within the fence
 * timeout (5 s), its data path was cut by the transport (tcp: connections
 * closed; rdma: QPs moved to the error state; shm: waits until the producer
 * has no copy in progress or has exited, so a producer stopped with SIGSTOP
 * in the middle of a copy holds the pages until it is continued or killed).
 * Do not hand the pages back to your allocator before it returns; call it
 * from a thread that may block that long. PREFILL: returns once no transfer
 * batch of the room reads its source pages (about 2 s at most).
 * Thread-safe; a second call returns KVX_ERR_BAD_HANDLE. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_kv_close(kvx_room_t room);
#endif

/* ------------------------------------------------------------------------ */
/* Observability. Every KV manager of the process counts into one library   */
/* registry (kvxfer_* metrics, engine/metrics.go) and keeps the timelines of */
/* its active rooms and its last 1024 finished ones (engine/timeline.go).    */
/* KVXFER_NO_PROBE=1 in the environment makes prefill KV managers refuse     */
/* kvxfer doctor probes.                                                      */
/* ------------------------------------------------------------------------ */

/* Write the library's metrics in the Prometheus text exposition format
 * (NUL-terminated) into buf, same buffer rules as kvx_bootstrap_addr (call
 * with cap 0 to learn *needed; the text grows as peers and rooms are seen,
 * so allow some slack). Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_metrics_text(char *buf, size_t cap, size_t *needed);
#endif

/* Serve the library's metrics (GET /metrics) and room timelines
 * (GET /debug/rooms, GET /debug/rooms/ROOM) over HTTP on addr ("host:port";
 * NULL or "" = "127.0.0.1:0", port 0 = a free port); *port (if not NULL)
 * gets the bound port. One server per process: a later call returns the
 * running server's port and ignores addr. KVX_ERR_UNAVAILABLE when addr
 * cannot be bound. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_metrics_serve(const char *addr, uint16_t *port);
#endif

/* Write the timeline of bootstrap_room `room` as JSON (NUL-terminated; the
 * fields of engine.RoomTimeline: room, role, rank, state, step, reason,
 * error, events[{at, step, done, peer, detail, error}]) into buf, same buffer
 * rules as kvx_bootstrap_addr. The newest one among the process's KV
 * managers; KVX_ERR_NOT_FOUND when none has the room. Thread-safe. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_room_timeline(uint64_t room, char *buf, size_t cap,
                              size_t *needed);
#endif

/* ------------------------------------------------------------------------ */
/* NIXL-shaped agent (package engine/agent): what NIXL's nixlAgent is to     */
/* vLLM's NixlConnector. Register memory, hand kvx_agent_metadata to peers   */
/* out of band, add them (kvx_agent_add_remote), prepare descriptor lists    */
/* for the local side and for a remote agent, make READ/WRITE requests by    */
/* descriptor index with an optional notification, post and poll them.      */
/* A notification is sent only once the data landed (READ: here; WRITE: in   */
/* the remote memory); one that cannot be delivered makes the transfer ERR.  */
/* A cancelled or released request moves no byte and sends no notification  */
/* once the call returned. kvx_agent_remove_remote fences: the removed       */
/* agent's transfers into this agent's memory fail and its notifications    */
/* are refused until it is added again. Handles are opaque and per agent.    */
/* Every function is thread-safe. Strings and arrays are copied before the   */
/* call returns; memory named by descriptors stays the caller's and must     */
/* stay valid while it is registered.                                        */
/* Status codes: an unknown or removed remote agent is KVX_ERR_NOT_FOUND; a  */
/* descriptor index out of range, lists of different lengths or a bad       */
/* metadata blob KVX_ERR_INVALID_ARGUMENT; a local descriptor outside        */
/* registered memory KVX_ERR_NOT_REGISTERED, a remote one                    */
/* KVX_ERR_OUT_OF_BOUNDS; a request in progress KVX_ERR_BUSY; a peer that    */
/* refused this agent (it removed it) or vanished KVX_ERR_PEER_LOST, one     */
/* that did not answer in time KVX_ERR_TIMEOUT.                              */
/* ------------------------------------------------------------------------ */
typedef uint64_t kvx_agent_t;     /* one agent: transport, engine, control channel */
typedef uint64_t kvx_agent_reg_t; /* one kvx_agent_register call's regions        */
typedef uint64_t kvx_dlist_t;     /* a prepared descriptor list                    */
typedef uint64_t kvx_xfer_t;      /* a transfer request                            */

/* Memory kinds (NIXL's DRAM and VRAM). */
#define KVX_AGENT_MEM_DRAM 0u
#define KVX_AGENT_MEM_VRAM 1u

/* Operations. */
#define KVX_XFER_WRITE 0u
#define KVX_XFER_READ 1u

/* Transfer states. NIXL's Python API calls PROC "PROC", DONE "DONE" and
 * every other state "ERR". */
#define KVX_XFER_NOT_POSTED 0
#define KVX_XFER_PROC 1
#define KVX_XFER_DONE 2
#define KVX_XFER_ERR 3
#define KVX_XFER_CANCELED 4

/* Well-known name of the local side in kvx_agent_prep_dlist. */
#define KVX_AGENT_LOCAL "NIXL_INIT_AGENT"

typedef struct kvx_agent_config {
    uint32_t struct_size;  /* sizeof(kvx_agent_config) */
    uint32_t control_port; /* control channel port; 0 = a free port */
    const char *name;      /* the agent's name (required, 1..256 bytes) */
    /* "tcp" (NULL), "shm", "rdma", or "auto": the highest-priority one
     * usable here that reaches other hosts (rdma, else tcp). */
    const char *transport;
    /* "host" or "host:rpc_port" the segment RPC and the control channel
     * bind; NULL = "127.0.0.1". */
    const char *local_hostname;
    uint32_t timeout_ms;          /* each control/RPC request; 0 = 5000 */
    uint32_t drain_timeout_ms;    /* cancel/release wait before closing the segment; 0 = 10000 */
    uint32_t transfer_timeout_ms; /* one posted transfer, data + notification; 0 = 120000 */
    uint32_t max_notifs;          /* unread notifications kept per sender; 0 = 65536 */
} kvx_agent_config;

/* One descriptor: NIXL's (addr, len, dev_id). */
typedef struct kvx_agent_desc {
    uint64_t addr;  /* first byte (a device pointer for VRAM) */
    uint64_t len;   /* bytes, > 0 */
    int32_t device; /* GPU ordinal for VRAM; ignored for DRAM */
    uint32_t reserved;
} kvx_agent_desc;

/* A transfer's last post (NIXL's nixlXferTelemetry). Times in microseconds. */
typedef struct kvx_xfer_telemetry {
    int64_t start_us;     /* post time, microseconds since the Unix epoch */
    int64_t post_us;      /* time the post call took */
    int64_t xfer_us;      /* post to DONE/ERR (to now while PROC) */
    uint64_t total_bytes; /* payload bytes */
    uint64_t desc_count;  /* descriptor pairs of the request */
} kvx_xfer_telemetry;

/* Create an agent on a newly opened transport. KVX_ERR_INVALID_ARGUMENT for
 * a missing name, an unknown transport or a bad local_hostname. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_create(const kvx_agent_config *cfg, kvx_agent_t *out);
#endif

/* Cancel the agent's requests and close it (transport, engine, control
 * channel). A second call returns KVX_ERR_BAD_HANDLE. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_destroy(kvx_agent_t agent);
#endif

/* Write the agent's metadata (a versioned byte string, at most 2 KiB) into
 * buf (same buffer rules as kvx_segment_export; not NUL-terminated). */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_metadata(kvx_agent_t agent, void *buf, size_t cap,
                               size_t *needed);
#endif

/* Register n ranges of kind mem_kind, all or nothing. Memory from
 * kvx_alloc_host is shared by file descriptor (the shm transport needs it). */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_register(kvx_agent_t agent, uint32_t mem_kind,
                               const kvx_agent_desc *descs, uint32_t n,
                               kvx_agent_reg_t *out);
#endif

/* Deregister one kvx_agent_register call's ranges. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_deregister(kvx_agent_t agent, kvx_agent_reg_t reg);
#endif

/* Load a peer's metadata: connect to it and write its name (NUL-terminated,
 * buffer rules of kvx_engine_segment_name) into name. Adding the same peer
 * again returns its name. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_add_remote(kvx_agent_t agent, const void *metadata,
                                 size_t len, char *name, size_t cap,
                                 size_t *needed);
#endif

/* Remove (and fence) a remote agent; see the section comment. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_remove_remote(kvx_agent_t agent, const char *name);
#endif

/* Prepare a descriptor list: remote_agent NULL, "" or KVX_AGENT_LOCAL for
 * this agent's registered memory, else an added remote agent's name (the
 * descriptors must lie in memory it registered). */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_prep_dlist(kvx_agent_t agent, const char *remote_agent,
                                 uint32_t mem_kind, const kvx_agent_desc *descs,
                                 uint32_t n, kvx_dlist_t *out);
#endif

/* Forget a prepared list (requests made from it keep working). */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_release_dlist(kvx_agent_t agent, kvx_dlist_t dlist);
#endif

/* Make a request: local[local_idx[i]] pairs with remote[remote_idx[i]] for
 * i < n (same lengths); op KVX_XFER_READ or KVX_XFER_WRITE; notif (len
 * bytes, at most 64 KiB; NULL/0 = none) is delivered to the remote agent
 * once the data landed. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_make_xfer(kvx_agent_t agent, uint32_t op,
                                kvx_dlist_t local, const int64_t *local_idx,
                                kvx_dlist_t remote, const int64_t *remote_idx,
                                uint32_t n, const void *notif, size_t len,
                                kvx_xfer_t *out);
#endif

/* Post a request (again, once it is not PROC). notif replaces the request's
 * notification when not NULL. *state is KVX_XFER_PROC on success. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_post(kvx_agent_t agent, kvx_xfer_t xfer, const void *notif,
                           size_t len, int32_t *state);
#endif

/* Write a request's state to *state. For KVX_XFER_ERR, KVX_XFER_CANCELED and
 * KVX_XFER_NOT_POSTED the return value is the failure's status code and
 * kvx_last_error says why; a bad handle is KVX_ERR_BAD_HANDLE. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_xfer_state(kvx_agent_t agent, kvx_xfer_t xfer,
                                 int32_t *state);
#endif

/* Wait up to timeout_ms (0 = the transfer timeout) for the current post to
 * end; then as kvx_agent_xfer_state (KVX_ERR_TIMEOUT while still PROC). */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_xfer_wait(kvx_agent_t agent, kvx_xfer_t xfer,
                                uint32_t timeout_ms, int32_t *state);
#endif

/* Cancel an in-flight request; *state is the final state (CANCELED, or
 * DONE/ERR when it ended first). */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_xfer_cancel(kvx_agent_t agent, kvx_xfer_t xfer,
                                  int32_t *state);
#endif

/* Release a request, cancelling it first when in flight. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_xfer_release(kvx_agent_t agent, kvx_xfer_t xfer);
#endif

/* The request's last post's telemetry. KVX_ERR_INVALID_ARGUMENT if never
 * posted. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_xfer_telemetry(kvx_agent_t agent, kvx_xfer_t xfer,
                                     kvx_xfer_telemetry *out);
#endif

/* Send a notification on its own to an added remote agent; returns once it
 * queued it. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_send_notif(kvx_agent_t agent, const char *remote_agent,
                                 const void *msg, size_t len);
#endif

/* Take the notifications received since the last call into buf, as records
 * {uint32 name_len, name bytes, uint32 msg_len, msg bytes} (little-endian),
 * grouped by sending agent, each agent's in arrival order; *needed is the
 * size. With a buffer too small (KVX_ERR_BUFFER_TOO_SMALL) nothing is lost:
 * the next call returns the same records first. 0 bytes = none. */
#ifndef KVX_TYPES_ONLY
KVX_API int kvx_agent_get_notifs(kvx_agent_t agent, void *buf, size_t cap,
                                 size_t *needed);
#endif

/* ------------------------------------------------------------------------ */
/* Metadata record (one ring slot), as written by the producer into the     */
/* decode's metadata ring. Little-endian, 64 bytes, one cache line. The      */
/* producer writes bytes 0-55 and commit (= KVX_RECORD_COMMIT_MAGIC ^       */
/* generation) last, once every byte of that batch landed: as the batch's    */
/* ordered last write on shm and tcp, in a batch of its own on rdma. A       */
/* reader that sees commit sees the record and the pages. The decode accepts */
/* a record only when commit matches the slot's generation AND room, epoch,  */
/* producer, page/byte counts, layer_count (all the producer's layers) and   */
/* (when both sides declared it) token_count are the ones it expects, so a   */
/* record from another room, from a fenced data path (older epoch) or of a   */
/* room sent layer by layer short of its last layer never commits a slot.    */
/* Layout from engine/ring.go; layer_count is protocol version 6 (before:    */
/* reserved, zero).                                                          */
/* ------------------------------------------------------------------------ */
#define KVX_RECORD_SIZE 64
#define KVX_RECORD_COMMIT_MAGIC 0x4B5658434F4D4954ULL /* "KVXCOMIT" */
#define KVX_RECORD_FLAG_CHECKSUM 1u
#define KVX_RECORD_FLAG_LAYERWISE 2u /* sent layer range by layer range */

typedef struct kvx_meta_record {
    uint64_t room;        /*  0: bootstrap_room of the request */
    uint64_t generation;  /*  8: slot generation the decode gave in TRANSFER */
    uint32_t page_count;  /* 16: pages this producer wrote to this decode rank */
    uint32_t producer;    /* 20: producer rank */
    uint64_t byte_count;  /* 24: payload bytes this producer wrote */
    uint32_t checksum;    /* 32: CRC32C (Castagnoli) of those bytes */
    uint32_t flags;       /* 36: bit 0: checksum is set; bit 1: sent layer by layer; others 0 */
    uint32_t token_count; /* 40: tokens (prompt length) the producer covered; 0 = undeclared */
    uint32_t layer_count; /* 44: the producer's layers every page of which it wrote */
    uint64_t epoch;       /* 48: segment epoch of the producer's data path (REGISTER epoch) */
    uint64_t commit;      /* 56: KVX_RECORD_COMMIT_MAGIC ^ generation; written last */
} kvx_meta_record;

#ifdef __cplusplus
}
#endif

#endif /* KVXFER_H */
