// Links against an installed libkvxfer found with find_package(kvxfer) and
// makes a few calls that need no peer: version, strerror, and a bad-handle
// error that must come back as a code with a message.
#include <kvxfer.h>

#include <cstdio>
#include <cstring>

int main() {
    const char *v = kvx_version();
    if (v == nullptr || std::strcmp(v, KVX_VERSION_STRING) != 0) {
        std::fprintf(stderr, "kvx_version() = %s, header says %s\n", v ? v : "(null)", KVX_VERSION_STRING);
        return 1;
    }
    int rc = kvx_engine_destroy(12345);
    if (rc != KVX_ERR_BAD_HANDLE || kvx_last_error()[0] == '\0') {
        std::fprintf(stderr, "kvx_engine_destroy(bogus) = %d (%s), want KVX_ERR_BAD_HANDLE with a message\n",
                     rc, kvx_strerror(rc));
        return 1;
    }
    std::printf("kvxfer %s found; bad handle -> %s: %s\n", v, kvx_strerror(rc), kvx_last_error());
    return 0;
}
