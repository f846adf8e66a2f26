// Private declarations shared by the C and cgo parts of capi (not installed).
#ifndef KVXFER_CAPI_H
#define KVXFER_CAPI_H
#include <stddef.h>
#include "../include/kvxfer.h"

#define KVX_HIDDEN __attribute__((visibility("hidden")))

KVX_HIDDEN void kvx__set_last_error(const char *msg, size_t len);
KVX_HIDDEN int kvx__in_notify(void);
KVX_HIDDEN void kvx__call_notify(kvx_notify_fn fn, void *user_data, const kvx_event *ev);
#endif
