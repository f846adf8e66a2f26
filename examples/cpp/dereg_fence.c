/* Case 3 of the fencing issue, through the C ABI: writes into a region that
 * is deregistered while they are in flight must never land after
 * kvx_deregister_memory returns, and fail with the same status on every
 * transport (KVX_ERR_UNKNOWN_REGION).
 *
 *   kvx_dereg_fence tcp|shm
 *
 * One process, two engines (sender and receiver) over the named transport:
 * submit N x 4 MiB writes into the receiver's region, deregister it at once,
 * zero the buffer, register it again, wait for the batch. The batch must not
 * report success, and the zeroed buffer must stay zero: a byte of the old
 * batch appearing after the wipe is a write that outlived deregistration.
 * Exit status 0 on success, 1 with a message naming what went wrong. */
#define _DEFAULT_SOURCE 1
#include <kvxfer.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define N 64
#define BLOCK (4u << 20)

static int check(int rc, const char *what) {
    if (rc != KVX_OK) {
        fprintf(stderr, "FAIL: %s: %s (%d): %s\n", what, kvx_strerror(rc), rc, kvx_last_error());
        exit(1);
    }
    return rc;
}

static kvx_engine_t engine(const char *transport, int role) {
    kvx_engine_config c;
    memset(&c, 0, sizeof c);
    c.struct_size = sizeof c;
    c.role = role;
    c.transport = transport;
    kvx_engine_t e = 0;
    check(kvx_engine_create(&c, &e), "kvx_engine_create");
    return e;
}

static size_t nonzero(const unsigned char *b, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i += 4096) /* one byte per 4 KiB is enough */
        k += b[i] != 0;
    return k;
}

int main(int argc, char **argv) {
    const char *transport = argc > 1 ? argv[1] : "shm";
    kvx_engine_t snd = engine(transport, KVX_ROLE_PREFILL);
    kvx_engine_t rcv = engine(transport, KVX_ROLE_DECODE);
    uint64_t size = (uint64_t)N * BLOCK, got = 0;
    kvx_hostbuf_t sb = 0, rb = 0;
    void *src = NULL, *dst = NULL;
    check(kvx_alloc_host("dereg-src", size, &sb, &src, &got), "kvx_alloc_host src");
    check(kvx_alloc_host("dereg-dst", size, &rb, &dst, &got), "kvx_alloc_host dst");
    memset(src, 0x5a, size);
    kvx_region_t sreg = 0, dreg = 0, dreg2 = 0;
    check(kvx_register_memory(snd, src, size, "cpu", &sreg), "register src");
    check(kvx_register_memory(rcv, dst, size, "cpu", &dreg), "register dst");
    unsigned char blob[65536];
    size_t need = 0;
    check(kvx_segment_export(rcv, "dereg-sender", blob, sizeof blob, &need), "kvx_segment_export");
    kvx_segment_t seg = 0;
    check(kvx_segment_open(snd, blob, need, &seg), "kvx_segment_open");
    kvx_batch_t batch = 0;
    check(kvx_batch_alloc(seg, N, &batch), "kvx_batch_alloc");
    kvx_write_request reqs[N];
    memset(reqs, 0, sizeof reqs);
    for (int i = 0; i < N; i++) {
        reqs[i].local_addr = (uint64_t)(uintptr_t)src + (uint64_t)i * BLOCK;
        reqs[i].remote_offset = (uint64_t)i * BLOCK;
        reqs[i].length = BLOCK;
        reqs[i].remote_region = dreg;
        reqs[i].count = 1;
    }
    check(kvx_batch_submit(batch, reqs, N), "kvx_batch_submit");
    int drc = kvx_deregister_memory(rcv, dreg);
    memset(dst, 0, size); /* the caller reuses the memory */
    check(kvx_register_memory(rcv, dst, size, "cpu", &dreg2), "register dst again");
    int wrc = kvx_batch_wait(batch, 60000);
    usleep(200 * 1000); /* give a stray copy time to show */
    size_t dirty = nonzero(dst, size);
    int failed = 0;
    if (drc != KVX_OK)
        printf("%s: kvx_deregister_memory returned %s\n", transport, kvx_strerror(drc));
    if (wrc == KVX_OK) {
        fprintf(stderr, "FAIL: %s: kvx_batch_wait returned KVX_OK: every write into the deregistered region reported success\n", transport);
        failed = 1;
    } else if (wrc != KVX_ERR_UNKNOWN_REGION) {
        fprintf(stderr, "FAIL: %s: kvx_batch_wait returned %s, want KVX_ERR_UNKNOWN_REGION (what tcp reports)\n", transport, kvx_strerror(wrc));
        failed = 1;
    }
    if (dirty) {
        fprintf(stderr, "FAIL: %s: %zu of %zu sampled 4 KiB pages hold the old batch's bytes after the wipe: writes landed after kvx_deregister_memory returned\n",
                transport, dirty, (size_t)(size / 4096));
        failed = 1;
    }
    kvx_batch_free(batch);
    kvx_segment_close(seg);
    kvx_deregister_memory(rcv, dreg2);
    kvx_deregister_memory(snd, sreg);
    kvx_engine_destroy(snd);
    kvx_engine_destroy(rcv);
    kvx_free_host(sb);
    kvx_free_host(rb);
    if (!failed)
        printf("ok: %s: batch into a deregistered region failed with %s; nothing landed after deregistration\n", transport, kvx_strerror(wrc));
    return failed;
}
