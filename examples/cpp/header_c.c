/* Compiles kvxfer.h as C99 and checks the struct layouts that are part of
 * the ABI (sizes and offsets must never change within a major version). */
#include <kvxfer.h>

#include <stddef.h>
#include <stdio.h>
#include <string.h>

#define CHECK(cond)                                                  \
    do {                                                             \
        if (!(cond)) {                                               \
            fprintf(stderr, "header_c: check failed: %s\n", #cond); \
            return 1;                                                \
        }                                                            \
    } while (0)

int main(void) {
    CHECK(sizeof(kvx_write_request) == 48);
    CHECK(offsetof(kvx_write_request, remote_region) == 40);
    CHECK(offsetof(kvx_write_request, count) == 44);
    CHECK(sizeof(kvx_transfer_status) == 16);
    CHECK(sizeof(kvx_event) == 40);
    CHECK(sizeof(kvx_engine_config) == 80);
    CHECK(offsetof(kvx_engine_config, devices) == 72);
    CHECK(offsetof(kvx_engine_config, local_hostname) == KVX_ENGINE_CONFIG_SIZE_V1);
    CHECK(offsetof(kvx_engine_config, rpc_timeout_ms) == 64);
    CHECK(sizeof(kvx_region_info) == 24);
    CHECK(sizeof(kvx_meta_record) == KVX_RECORD_SIZE);
    CHECK(offsetof(kvx_meta_record, generation) == 8);
    CHECK(offsetof(kvx_meta_record, page_count) == 16);
    CHECK(offsetof(kvx_meta_record, producer) == 20);
    CHECK(offsetof(kvx_meta_record, byte_count) == 24);
    CHECK(offsetof(kvx_meta_record, checksum) == 32);
    CHECK(offsetof(kvx_meta_record, flags) == 36);
    CHECK(offsetof(kvx_meta_record, token_count) == 40);
    CHECK(offsetof(kvx_meta_record, layer_count) == 44);
    CHECK(offsetof(kvx_meta_record, epoch) == 48);
    CHECK(offsetof(kvx_meta_record, commit) == 56);
    CHECK(sizeof(kvx_kv_layout) == 40);
    CHECK(KVX_KVPOLL_FAILED == 0 && KVX_KVPOLL_SUCCESS == 4);
    CHECK(strcmp(kvx_version(), KVX_VERSION_STRING) == 0);
    CHECK(strcmp(kvx_strerror(KVX_OK), "success") == 0);
    CHECK(strcmp(kvx_strerror(-7), "unknown status") == 0);
    puts("header_c: ok");
    return 0;
}
