// The notification trampoline: Go cannot call a C function pointer, so the
// notifier (trampoline.go) passes the pointer here. While the callback runs,
// the thread is marked as inside a callback so that re-entrant kvx_ calls that
// would deadlock (kvx_engine_set_notify, kvx_engine_destroy) fail with
// KVX_ERR_BUSY instead.
#include "capi.h"

static __thread int kvx__in_callback;

KVX_HIDDEN int kvx__in_notify(void) { return kvx__in_callback; }

KVX_HIDDEN void kvx__call_notify(kvx_notify_fn fn, void *user_data, const kvx_event *ev) {
    kvx__in_callback = 1;
    fn(user_data, ev);
    kvx__in_callback = 0;
}

