// The parts of the C ABI written in C: static strings, and the thread-local
// last-error buffer (the notification trampoline is in trampoline.c). Go sets the buffer with kvx__set_last_error during an
// exported call; that call runs on the caller's thread, so the buffer is the
// caller's.
#include <string.h>

#include "../include/kvxfer.h"
#include "capi.h"

static __thread char kvx__errbuf[1024];

KVX_HIDDEN void kvx__set_last_error(const char *msg, size_t len) {
    if (len >= sizeof(kvx__errbuf)) {
        len = sizeof(kvx__errbuf) - 1;
    }
    if (len > 0 && msg != NULL) {
        memcpy(kvx__errbuf, msg, len);
    }
    kvx__errbuf[len] = '\0';
}

const char *kvx_version(void) { return KVX_VERSION_STRING; }

const char *kvx_last_error(void) { return kvx__errbuf; }

const char *kvx_strerror(int status) {
    switch (status) {
    case KVX_OK: return "success";
    case KVX_ERR_INVALID_ARGUMENT: return "invalid argument (NULL pointer, zero length, malformed string or value out of range)";
    case KVX_ERR_BAD_HANDLE: return "bad handle (zero, unknown, wrong kind or already destroyed)";
    case KVX_ERR_BUFFER_TOO_SMALL: return "output buffer too small (the needed size was reported)";
    case KVX_ERR_UNAVAILABLE: return "transport or device unavailable on this host";
    case KVX_ERR_UNSUPPORTED_MEMORY: return "memory kind not supported by this transport";
    case KVX_ERR_NOT_REGISTERED: return "local address range is not inside registered memory";
    case KVX_ERR_UNKNOWN_REGION: return "unknown region";
    case KVX_ERR_OUT_OF_BOUNDS: return "write outside the registered remote region";
    case KVX_ERR_BUSY: return "object busy (transfers still pending, or full)";
    case KVX_ERR_TIMEOUT: return "timed out";
    case KVX_ERR_CLOSED: return "closed";
    case KVX_ERR_PEER_LOST: return "peer lost";
    case KVX_ERR_CANCELED: return "canceled";
    case KVX_ERR_TRANSFER_FAILED: return "transfer failed";
    case KVX_ERR_BOOTSTRAP: return "bootstrap server refused or unreachable";
    case KVX_ERR_ROOM_MISMATCH: return "bootstrap_room mismatch or corrupt metadata record";
    case KVX_ERR_NOT_SUPPORTED: return "not supported by this build";
    case KVX_ERR_INTERNAL: return "internal error (a bug in kvxfer; please report kvx_last_error)";
    }
    return "unknown status";
}
