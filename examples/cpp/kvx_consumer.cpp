// kvx_consumer — the C++ consumer of libkvxfer that ctest runs.
//
// In one process: an embedded bootstrap server, a prefill engine and a decode
// engine (two engines, each with its own transport listener). The decode
// engine registers a KV pool; the prefill engine writes a multi-page request
// into it through the Mooncake-style batch API (open remote segment, submit
// WRITEs, poll per-request status, free the batch) and the bytes are
// verified page by page. Then every bad-argument path the header promises is
// exercised: each must return its error code (with a message), never crash.
#include <kvxfer.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

int failures = 0;

#define EXPECT_RC(call, want)                                                                \
    do {                                                                                     \
        int rc_ = (call);                                                                    \
        if (rc_ != (want)) {                                                                 \
            std::fprintf(stderr, "%s:%d: %s = %d (%s), want %d (%s); last error: %s\n",      \
                         __FILE__, __LINE__, #call, rc_, kvx_strerror(rc_), (want),          \
                         kvx_strerror(want), kvx_last_error());                              \
            ++failures;                                                                      \
        } else if ((want) != KVX_OK && kvx_last_error()[0] == '\0') {                        \
            std::fprintf(stderr, "%s:%d: %s failed with no kvx_last_error message\n",        \
                         __FILE__, __LINE__, #call);                                         \
            ++failures;                                                                      \
        }                                                                                    \
    } while (0)

#define REQUIRE_OK(call)                                                                     \
    do {                                                                                     \
        int rc_ = (call);                                                                    \
        if (rc_ != KVX_OK) {                                                                 \
            std::fprintf(stderr, "%s:%d: %s = %d (%s): %s\n", __FILE__, __LINE__, #call,     \
                         rc_, kvx_strerror(rc_), kvx_last_error());                          \
            std::exit(1);                                                                    \
        }                                                                                    \
    } while (0)

#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);    \
            ++failures;                                                                      \
        }                                                                                    \
    } while (0)

constexpr uint64_t kPageSize = 4096;  // bytes per KV page in this test
constexpr uint64_t kPoolPages = 32;   // pages in each pool

// The byte at offset i of source page p: distinct per page and per offset.
uint8_t pattern(uint64_t page, uint64_t i) { return static_cast<uint8_t>(page * 131 + i * 7 + 1); }

struct Notes {
    kvx_engine_t engine = 0;
    std::atomic<int> batch_events{0};
    std::atomic<int> batch_ok{0};
};

void on_event(void *user_data, const kvx_event *ev) {
    auto *n = static_cast<Notes *>(user_data);
    if (ev->kind == KVX_EVENT_BATCH) {
        n->batch_events++;
        if (ev->status == KVX_OK && ev->state == KVX_TRANSFER_COMPLETED) n->batch_ok++;
        // Re-entrant calls that would deadlock are refused, not hung.
        int rc = kvx_engine_set_notify(n->engine, nullptr, nullptr);
        if (rc != KVX_ERR_BUSY) {
            std::fprintf(stderr, "set_notify inside the callback = %d, want KVX_ERR_BUSY\n", rc);
            ++failures;
        }
    }
}

kvx_engine_t make_engine(int role, const std::string &bootstrap) {
    kvx_engine_config cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.struct_size = sizeof cfg;
    cfg.role = role;
    cfg.transport = "tcp";
    cfg.listen_host = "127.0.0.1";
    cfg.bootstrap_addr = bootstrap.c_str();
    kvx_engine_t e = 0;
    REQUIRE_OK(kvx_engine_create(&cfg, &e));
    return e;
}

std::string bootstrap_address(kvx_bootstrap_t bs) {
    size_t need = 0;
    // Too-small buffer reports the size it needs.
    char tiny[2];
    EXPECT_RC(kvx_bootstrap_addr(bs, tiny, sizeof tiny, &need), KVX_ERR_BUFFER_TOO_SMALL);
    CHECK(need > 3);
    std::string s(need, '\0');
    REQUIRE_OK(kvx_bootstrap_addr(bs, s.data(), s.size(), &need));
    s.resize(need - 1);
    return s;
}

// Batch API: prefill writes pages {0,1,2,3} -> decode pages {10,11,12,13}
// (one contiguous run), page 4 -> 20, and pages {5,7,9} -> {25,26,27} as one
// strided request, in two submit calls.
void batch_transfer(kvx_engine_t prefill, kvx_engine_t decode, uint8_t *src, kvx_region_t dst_region,
                    const uint8_t *dst) {
    Notes notes;
    notes.engine = prefill;
    REQUIRE_OK(kvx_engine_set_notify(prefill, on_event, &notes));

    size_t need = 0;
    EXPECT_RC(kvx_segment_export(decode, "prefill-0", nullptr, 0, &need), KVX_ERR_BUFFER_TOO_SMALL);
    std::vector<char> blob(need);
    REQUIRE_OK(kvx_segment_export(decode, "prefill-0", blob.data(), blob.size(), &need));
    kvx_segment_t seg = 0;
    REQUIRE_OK(kvx_segment_open(prefill, blob.data(), need, &seg));

    kvx_batch_t batch = 0;
    REQUIRE_OK(kvx_batch_alloc(seg, 4, &batch));
    auto addr = [&](uint64_t page) { return reinterpret_cast<uint64_t>(src + page * kPageSize); };
    kvx_write_request first[2];
    std::memset(first, 0, sizeof first);
    first[0] = {addr(0), 10 * kPageSize, 4 * kPageSize, 0, 0, dst_region, 1};
    first[1] = {addr(4), 20 * kPageSize, kPageSize, 0, 0, dst_region, 0};
    REQUIRE_OK(kvx_batch_submit(batch, first, 2));
    kvx_write_request strided = {addr(5), 25 * kPageSize, kPageSize, 2 * kPageSize, kPageSize, dst_region, 3};
    REQUIRE_OK(kvx_batch_submit(batch, &strided, 1));
    // The batch holds 3 of 4; two more do not fit.
    kvx_write_request two[2] = {first[1], first[1]};
    EXPECT_RC(kvx_batch_submit(batch, two, 2), KVX_ERR_BUSY);

    // Poll per-request status until every request is terminal.
    const uint64_t want_bytes[3] = {4 * kPageSize, kPageSize, 3 * kPageSize};
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (uint32_t i = 0; i < 3; i++) {
        kvx_transfer_status st;
        for (;;) {
            REQUIRE_OK(kvx_batch_status(batch, i, &st));
            if (st.state != KVX_TRANSFER_PENDING) break;
            if (std::chrono::steady_clock::now() > deadline) {
                std::fprintf(stderr, "request %u still pending after 30 s\n", i);
                std::exit(1);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        CHECK(st.state == KVX_TRANSFER_COMPLETED);
        CHECK(st.error == KVX_OK);
        CHECK(st.bytes_done == want_bytes[i]);
    }
    kvx_transfer_status empty;
    REQUIRE_OK(kvx_batch_status(batch, 3, &empty));
    CHECK(empty.state == KVX_TRANSFER_EMPTY);
    EXPECT_RC(kvx_batch_status(batch, 4, &empty), KVX_ERR_INVALID_ARGUMENT);
    REQUIRE_OK(kvx_batch_wait(batch, 10000));

    // Verify every byte of every destination page, and that the pages in
    // between were not touched.
    struct Map { uint64_t src, dst; } maps[] = {{0, 10}, {1, 11}, {2, 12}, {3, 13}, {4, 20}, {5, 25}, {7, 26}, {9, 27}};
    std::vector<bool> written(kPoolPages, false);
    for (auto m : maps) {
        written[m.dst] = true;
        for (uint64_t i = 0; i < kPageSize; i++) {
            if (dst[m.dst * kPageSize + i] != pattern(m.src, i)) {
                std::fprintf(stderr, "decode page %llu byte %llu = %u, want %u (from prefill page %llu)\n",
                             (unsigned long long)m.dst, (unsigned long long)i, dst[m.dst * kPageSize + i],
                             pattern(m.src, i), (unsigned long long)m.src);
                ++failures;
                break;
            }
        }
    }
    for (uint64_t p = 0; p < kPoolPages; p++) {
        if (written[p]) continue;
        for (uint64_t i = 0; i < kPageSize; i++) {
            if (dst[p * kPageSize + i] != 0) {
                std::fprintf(stderr, "decode page %llu was not a destination but byte %llu is %u\n",
                             (unsigned long long)p, (unsigned long long)i, dst[p * kPageSize + i]);
                ++failures;
                break;
            }
        }
    }

    // Bad WRITEs: unregistered local memory, unknown remote region, out of
    // bounds, zero length. Nothing is sent.
    kvx_batch_t b2 = 0;
    REQUIRE_OK(kvx_batch_alloc(seg, 8, &b2));
    static uint8_t not_registered[kPageSize];
    kvx_write_request bad = {reinterpret_cast<uint64_t>(not_registered), 0, kPageSize, 0, 0, dst_region, 0};
    EXPECT_RC(kvx_batch_submit(b2, &bad, 1), KVX_ERR_NOT_REGISTERED);
    bad = {addr(0), 0, kPageSize, 0, 0, dst_region + 1000, 0};
    EXPECT_RC(kvx_batch_submit(b2, &bad, 1), KVX_ERR_UNKNOWN_REGION);
    bad = {addr(0), kPoolPages * kPageSize - 1, kPageSize, 0, 0, dst_region, 0};
    EXPECT_RC(kvx_batch_submit(b2, &bad, 1), KVX_ERR_OUT_OF_BOUNDS);
    bad = {addr(0), 0, 0, 0, 0, dst_region, 0};
    EXPECT_RC(kvx_batch_submit(b2, &bad, 1), KVX_ERR_INVALID_ARGUMENT);
    bad = {addr(kPoolPages - 1), 0, 2 * kPageSize, 0, 0, dst_region, 0};  // runs off the end of src
    EXPECT_RC(kvx_batch_submit(b2, &bad, 1), KVX_ERR_NOT_REGISTERED);
    EXPECT_RC(kvx_batch_submit(b2, nullptr, 1), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_batch_submit(b2, first, 0), KVX_ERR_INVALID_ARGUMENT);
    REQUIRE_OK(kvx_batch_free(b2));
    EXPECT_RC(kvx_batch_free(b2), KVX_ERR_BAD_HANDLE);

    REQUIRE_OK(kvx_batch_free(batch));
    EXPECT_RC(kvx_batch_free(batch), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_batch_status(batch, 0, &empty), KVX_ERR_BAD_HANDLE);

    // Both submit calls were reported to the callback, once each. Events are
    // delivered asynchronously: wait (bounded) for them.
    for (int i = 0; i < 3000 && notes.batch_events.load() < 2; i++)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    CHECK(notes.batch_events.load() == 2);
    CHECK(notes.batch_ok.load() == 2);
    REQUIRE_OK(kvx_engine_set_notify(prefill, nullptr, nullptr));

    REQUIRE_OK(kvx_segment_close(seg));
    EXPECT_RC(kvx_segment_close(seg), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_batch_alloc(seg, 1, &b2), KVX_ERR_BAD_HANDLE);
    std::printf("batch API: 8 pages in 3 requests (2 submits) verified; %d notifications\n",
                notes.batch_events.load());
}

void bad_arguments(kvx_engine_t eng) {
    kvx_engine_t e = 0;
    EXPECT_RC(kvx_engine_create(nullptr, &e), KVX_ERR_INVALID_ARGUMENT);
    kvx_engine_config cfg;
    std::memset(&cfg, 0, sizeof cfg);
    EXPECT_RC(kvx_engine_create(&cfg, &e), KVX_ERR_INVALID_ARGUMENT);  // struct_size 0
    cfg.struct_size = sizeof cfg;
    EXPECT_RC(kvx_engine_create(&cfg, nullptr), KVX_ERR_INVALID_ARGUMENT);
    cfg.role = 7;
    EXPECT_RC(kvx_engine_create(&cfg, &e), KVX_ERR_INVALID_ARGUMENT);
    cfg.role = KVX_ROLE_DECODE;
    cfg.transport = "carrier-pigeon";
    EXPECT_RC(kvx_engine_create(&cfg, &e), KVX_ERR_INVALID_ARGUMENT);
    cfg.transport = "tcp";
    cfg.bootstrap_addr = "no-port-here";
    EXPECT_RC(kvx_engine_create(&cfg, &e), KVX_ERR_INVALID_ARGUMENT);
    CHECK(e == 0);  // outputs are written only on success

    EXPECT_RC(kvx_engine_destroy(0), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_engine_destroy(0xdeadbeef), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_engine_transport(0, nullptr, 0, nullptr), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_engine_set_notify(0, nullptr, nullptr), KVX_ERR_BAD_HANDLE);

    kvx_region_t r = 0;
    static uint8_t mem[64];
    EXPECT_RC(kvx_register_memory(0, mem, sizeof mem, "cpu", &r), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_register_memory(eng, nullptr, 64, "cpu", &r), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_register_memory(eng, mem, 0, "cpu", &r), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_register_memory(eng, mem, sizeof mem, "cpu", nullptr), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_register_memory(eng, mem, sizeof mem, "tpu:0", &r), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_register_memory(eng, mem, sizeof mem, "cuda:x", &r), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_deregister_memory(eng, 987654), KVX_ERR_UNKNOWN_REGION);
    EXPECT_RC(kvx_deregister_memory(0, 1), KVX_ERR_BAD_HANDLE);

    kvx_hostbuf_t hb = 0;
    void *p = nullptr;
    uint64_t len = 0;
    EXPECT_RC(kvx_alloc_host("x", 0, &hb, &p, &len), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_alloc_host("x", 4096, nullptr, &p, &len), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_alloc_host("x", 4096, &hb, nullptr, &len), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_free_host(0), KVX_ERR_BAD_HANDLE);
    // A buffer that is still registered cannot be freed.
    REQUIRE_OK(kvx_alloc_host("busy", 1, &hb, &p, &len));
    CHECK(len >= 1);
    REQUIRE_OK(kvx_register_memory(eng, p, len, nullptr, &r));
    EXPECT_RC(kvx_register_memory(eng, p, len, "host", &r), KVX_ERR_INVALID_ARGUMENT);  // overlap
    EXPECT_RC(kvx_free_host(hb), KVX_ERR_BUSY);
    REQUIRE_OK(kvx_deregister_memory(eng, r));
    EXPECT_RC(kvx_deregister_memory(eng, r), KVX_ERR_UNKNOWN_REGION);
    REQUIRE_OK(kvx_free_host(hb));
    EXPECT_RC(kvx_free_host(hb), KVX_ERR_BAD_HANDLE);

    kvx_segment_t s = 0;
    size_t need = 0;
    EXPECT_RC(kvx_segment_open(eng, nullptr, 10, &s), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_segment_open(eng, "{}", 0, &s), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_segment_open(eng, "garbage", 7, &s), KVX_ERR_INVALID_ARGUMENT);
    const char wrong[] = "{\"v\":1,\"transport\":\"rdma\",\"endpoint\":\"AAAA\"}";
    EXPECT_RC(kvx_segment_open(eng, wrong, sizeof wrong - 1, &s), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_segment_open(0, wrong, sizeof wrong - 1, &s), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_segment_export(0, nullptr, nullptr, 0, &need), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_segment_close(0), KVX_ERR_BAD_HANDLE);
    kvx_batch_t b = 0;
    EXPECT_RC(kvx_batch_alloc(0, 1, &b), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_batch_submit(0, nullptr, 0), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_batch_status(0, 0, nullptr), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_batch_wait(0, 1), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_batch_cancel(0), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_batch_free(0), KVX_ERR_BAD_HANDLE);
    // An engine handle is not a batch handle.
    EXPECT_RC(kvx_batch_free(eng), KVX_ERR_BAD_HANDLE);

    kvx_bootstrap_t bs = 0;
    EXPECT_RC(kvx_bootstrap_start("127.0.0.1", 0, nullptr), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_bootstrap_start("256.0.0.1", 0, &bs), KVX_ERR_BOOTSTRAP);
    EXPECT_RC(kvx_bootstrap_addr(0, nullptr, 0, nullptr), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_bootstrap_stop(0), KVX_ERR_BAD_HANDLE);

    // A successful call clears the thread's last error.
    EXPECT_RC(kvx_engine_transport(eng, nullptr, 0, &need), KVX_ERR_BUFFER_TOO_SMALL);
    char name[16];
    REQUIRE_OK(kvx_engine_transport(eng, name, sizeof name, &need));
    CHECK(std::strcmp(name, "tcp") == 0);
    CHECK(kvx_last_error()[0] == '\0');
    std::printf("bad arguments: every call returned its error code\n");
}

}  // namespace

int main() {
    std::printf("kvxfer %s (header %s)\n", kvx_version(), KVX_VERSION_STRING);
    CHECK(std::strcmp(kvx_version(), KVX_VERSION_STRING) == 0);

    kvx_bootstrap_t bs = 0;
    REQUIRE_OK(kvx_bootstrap_start("127.0.0.1", 0, &bs));
    std::string addr = bootstrap_address(bs);
    std::printf("bootstrap server on %s\n", addr.c_str());

    kvx_engine_t prefill = make_engine(KVX_ROLE_PREFILL, addr);
    kvx_engine_t decode = make_engine(KVX_ROLE_DECODE, addr);

    // KV pools: library-allocated shareable host memory on both sides.
    kvx_hostbuf_t src_buf = 0, dst_buf = 0;
    void *src = nullptr, *dst = nullptr;
    uint64_t src_len = 0, dst_len = 0;
    REQUIRE_OK(kvx_alloc_host("prefill-kv", kPoolPages * kPageSize, &src_buf, &src, &src_len));
    REQUIRE_OK(kvx_alloc_host("decode-kv", kPoolPages * kPageSize, &dst_buf, &dst, &dst_len));
    CHECK(src_len == kPoolPages * kPageSize && dst_len == kPoolPages * kPageSize);
    auto *s8 = static_cast<uint8_t *>(src);
    for (uint64_t p = 0; p < kPoolPages; p++)
        for (uint64_t i = 0; i < kPageSize; i++) s8[p * kPageSize + i] = pattern(p, i);
    kvx_region_t src_region = 0, dst_region = 0;
    REQUIRE_OK(kvx_register_memory(prefill, src, src_len, "cpu", &src_region));
    REQUIRE_OK(kvx_register_memory(decode, dst, dst_len, "cpu", &dst_region));

    batch_transfer(prefill, decode, s8, dst_region, static_cast<const uint8_t *>(dst));
    bad_arguments(decode);

    REQUIRE_OK(kvx_deregister_memory(prefill, src_region));
    REQUIRE_OK(kvx_deregister_memory(decode, dst_region));
    REQUIRE_OK(kvx_engine_destroy(prefill));
    REQUIRE_OK(kvx_engine_destroy(decode));
    EXPECT_RC(kvx_engine_destroy(decode), KVX_ERR_BAD_HANDLE);  // double destroy
    EXPECT_RC(kvx_register_memory(decode, dst, dst_len, "cpu", &dst_region), KVX_ERR_BAD_HANDLE);
    REQUIRE_OK(kvx_free_host(src_buf));
    REQUIRE_OK(kvx_free_host(dst_buf));
    REQUIRE_OK(kvx_bootstrap_stop(bs));
    EXPECT_RC(kvx_bootstrap_stop(bs), KVX_ERR_BAD_HANDLE);

    if (failures) {
        std::fprintf(stderr, "kvx_consumer: %d check(s) failed\n", failures);
        return 1;
    }
    std::printf("kvx_consumer: all checks passed\n");
    return 0;
}
