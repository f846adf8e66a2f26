// kvx_consumer — the C++ consumer of libkvxfer that ctest runs.
//
// First in one process: an embedded bootstrap server, a prefill engine and a
// decode engine (two engines, each with its own transport listener). The
// decode engine registers a KV pool; the prefill engine writes a multi-page
// request into it through the Mooncake-style batch API (open remote segment,
// submit WRITEs, poll per-request status, free the batch) and the bytes are
// verified page by page; then KV managers on both engines move room 42
// through the KV-room API (and room 43 is aborted). Then KV managers built
// on buffers this program owns (per-layer K and V buffers and aux buffers,
// as a serving engine holds them: std::vector, kvx_alloc_host memory for
// shm, or cudaMalloc'ed memory where a GPU is usable) move a request with an
// aux row and a decode prefix, and every refusal the header promises for
// such buffers is checked. Then every bad-argument path the header promises is
// exercised: each must return its error code (with a message), never crash.
// Then in two processes: this process is the decode side and spawns itself
// as a prefill child that writes through both APIs. argv[1] names the
// transport (default tcp).
#include <kvxfer.h>

#include <dlfcn.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

namespace {

int failures = 0;
const char *g_transport = "tcp";  // argv[1]: the transport both engines use

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
    cfg.transport = g_transport;
    cfg.listen_host = "127.0.0.1";
    cfg.bootstrap_addr = bootstrap.c_str();
    kvx_engine_t e = 0;
    REQUIRE_OK(kvx_engine_create(&cfg, &e));
    return e;
}

// Named segments (Mooncake's P2PHANDSHAKE): the decode engine's segment is
// "127.0.0.1:rpc_port"; the prefill opens it by that name and writes by the
// decode's virtual addresses (KVX_REGION_PEER_ADDRESS).
void named_segments(kvx_engine_t prefill, kvx_engine_t decode, uint8_t *src, uint8_t *dst) {
    uint16_t port = 0;
    REQUIRE_OK(kvx_engine_rpc_port(decode, &port));
    CHECK(port != 0);
    size_t need = 0;
    EXPECT_RC(kvx_engine_segment_name(decode, nullptr, 0, &need), KVX_ERR_BUFFER_TOO_SMALL);
    std::string name(need, '\0');
    REQUIRE_OK(kvx_engine_segment_name(decode, name.data(), name.size(), &need));
    name.resize(need - 1);
    CHECK(name == "127.0.0.1:" + std::to_string(port));

    kvx_segment_t seg = 0;
    REQUIRE_OK(kvx_segment_open_name(prefill, name.c_str(), &seg));
    uint32_t n = 0;
    REQUIRE_OK(kvx_segment_regions(seg, nullptr, 0, &n));
    CHECK(n == 1);
    kvx_region_info info[4];
    REQUIRE_OK(kvx_segment_regions(seg, info, 4, &n));
    CHECK(info[0].addr == reinterpret_cast<uint64_t>(dst) && info[0].length == kPoolPages * kPageSize && info[0].kind == 0);

    auto dst_addr = [&](uint64_t page) { return reinterpret_cast<uint64_t>(dst + page * kPageSize); };
    kvx_batch_t b = 0;
    REQUIRE_OK(kvx_batch_alloc(seg, 8, &b));
    // Source page 6 -> decode page 30, by the decode's virtual address.
    kvx_write_request w = {reinterpret_cast<uint64_t>(src + 6 * kPageSize), dst_addr(30), kPageSize, 0, 0, KVX_REGION_PEER_ADDRESS, 1};
    REQUIRE_OK(kvx_batch_submit(b, &w, 1));
    REQUIRE_OK(kvx_batch_wait(b, 10000));
    for (uint64_t i = 0; i < kPageSize; i++)
        if (dst[30 * kPageSize + i] != pattern(6, i)) {
            std::fprintf(stderr, "peer-address write: decode page 30 byte %llu wrong\n", (unsigned long long)i);
            ++failures;
            break;
        }
    // A range that runs off the decode's region: refused, message names the peer.
    kvx_write_request off = {reinterpret_cast<uint64_t>(src), dst_addr(kPoolPages) - 8, 16, 0, 0, KVX_REGION_PEER_ADDRESS, 0};
    EXPECT_RC(kvx_batch_submit(b, &off, 1), KVX_ERR_OUT_OF_BOUNDS);
    CHECK(std::strstr(kvx_last_error(), name.c_str()) != nullptr);

    // Memory the decode registers after the open is found (one refresh).
    kvx_hostbuf_t late = 0;
    void *lp = nullptr;
    uint64_t llen = 0;
    REQUIRE_OK(kvx_alloc_host("late", 2 * kPageSize, &late, &lp, &llen));
    kvx_region_t lr = 0;
    REQUIRE_OK(kvx_register_memory(decode, lp, llen, "cpu", &lr));
    kvx_write_request lw = {reinterpret_cast<uint64_t>(src + 9 * kPageSize), reinterpret_cast<uint64_t>(lp) + kPageSize, kPageSize, 0, 0, KVX_REGION_PEER_ADDRESS, 0};
    REQUIRE_OK(kvx_batch_submit(b, &lw, 1));
    REQUIRE_OK(kvx_batch_wait(b, 10000));
    auto *l8 = static_cast<const uint8_t *>(lp);
    for (uint64_t i = 0; i < kPageSize; i++)
        if (l8[kPageSize + i] != pattern(9, i) || l8[i] != 0) {
            std::fprintf(stderr, "write into memory registered after the open: byte %llu wrong\n", (unsigned long long)i);
            ++failures;
            break;
        }
    REQUIRE_OK(kvx_segment_regions(seg, info, 4, &n));
    CHECK(n == 2);

    // READ (Mooncake's transfer_sync_read), on every transport: decode page
    // 30 back into source page 31, synchronously.
    kvx_write_request r = {reinterpret_cast<uint64_t>(src + 31 * kPageSize), dst_addr(30), kPageSize, 0, 0, KVX_REGION_PEER_ADDRESS, 0};
    std::memset(src + 31 * kPageSize, 0, kPageSize);
    REQUIRE_OK(kvx_segment_read(seg, &r, 1, 10000));
    CHECK(std::memcmp(src + 31 * kPageSize, dst + 30 * kPageSize, kPageSize) == 0);
    // Asynchronously (kvx_batch_submit_read): a strided read of 8 blocks of
    // 512 bytes from decode page 30 (every 512 bytes of it) packed into
    // source page 31, then status and wait as for writes.
    std::memset(src + 31 * kPageSize, 0, kPageSize);
    kvx_write_request sr = {reinterpret_cast<uint64_t>(src + 31 * kPageSize), dst_addr(30), 256, 256, 512, KVX_REGION_PEER_ADDRESS, 8};
    kvx_batch_t rb = 0;
    REQUIRE_OK(kvx_batch_alloc(seg, 4, &rb));
    REQUIRE_OK(kvx_batch_submit_read(rb, &sr, 1));
    REQUIRE_OK(kvx_batch_wait(rb, 10000));
    kvx_transfer_status rst{};
    REQUIRE_OK(kvx_batch_status(rb, 0, &rst));
    CHECK(rst.state == KVX_TRANSFER_COMPLETED && rst.bytes_done == 8 * 256);
    for (int k = 0; k < 8; k++)
        CHECK(std::memcmp(src + 31 * kPageSize + k * 256, dst + 30 * kPageSize + k * 512, 256) == 0);
    // A read past the decode's region: refused, nothing read.
    kvx_write_request bad = {reinterpret_cast<uint64_t>(src + 31 * kPageSize), dst_addr(kPoolPages) - 8, 16, 0, 0, KVX_REGION_PEER_ADDRESS, 0};
    EXPECT_RC(kvx_batch_submit_read(rb, &bad, 1), KVX_ERR_OUT_OF_BOUNDS);
    EXPECT_RC(kvx_segment_read(seg, &bad, 1, 10000), KVX_ERR_OUT_OF_BOUNDS);
    REQUIRE_OK(kvx_batch_free(rb));
    for (uint64_t i = 0; i < kPageSize; i++) src[31 * kPageSize + i] = pattern(31, i);
    REQUIRE_OK(kvx_batch_free(b));
    REQUIRE_OK(kvx_segment_close(seg));
    REQUIRE_OK(kvx_deregister_memory(decode, lr));
    REQUIRE_OK(kvx_free_host(late));

    // Nothing listens at this name / not a host:port name.
    EXPECT_RC(kvx_segment_open_name(prefill, "127.0.0.1:1", &seg), KVX_ERR_PEER_LOST);
    EXPECT_RC(kvx_segment_open_name(prefill, "prefill-0", &seg), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_segment_open_name(prefill, nullptr, &seg), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_engine_rpc_port(0, &port), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_segment_regions(0, info, 1, &n), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_segment_refresh(0), KVX_ERR_BAD_HANDLE);
    std::printf("named segments: opened %s by name, peer-address writes and reads (sync, async strided) verified\n", name.c_str());
}

// A caller built against the 0.1 header passes the smaller struct.
void old_config_size() {
    kvx_engine_config cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.struct_size = KVX_ENGINE_CONFIG_SIZE_V1;
    cfg.role = KVX_ROLE_DECODE;
    cfg.transport = g_transport;
    cfg.metadata_server = "etcd://ignored:1";  // past struct_size: not read
    kvx_engine_t e = 0;
    REQUIRE_OK(kvx_engine_create(&cfg, &e));
    REQUIRE_OK(kvx_engine_destroy(e));
    cfg.struct_size = KVX_ENGINE_CONFIG_SIZE_V1 - 8;
    EXPECT_RC(kvx_engine_create(&cfg, &e), KVX_ERR_INVALID_ARGUMENT);
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

// KV-room API: SGLang-shaped per-rank KV managers on the prefill and decode
// engines. The prefill rank registers with the embedded bootstrap server; the
// decode receiver for bootstrap_room 42 resolves it, asks for 5 destination
// pages, and the sender pushes 5 source pages in two chunks. Both reach
// Success (the decode verified the room-tagged metadata record); every item
// of every layer buffer is compared with its source.
struct RoomNotes {
    std::atomic<int> room_events{0};
    std::atomic<int> success_events{0};
};

void on_room_event(void *user_data, const kvx_event *ev) {
    auto *n = static_cast<RoomNotes *>(user_data);
    if (ev->kind == KVX_EVENT_ROOM) {
        n->room_events++;
        if (ev->state == KVX_KVPOLL_SUCCESS && ev->room == 42) n->success_events++;
    }
}

void kv_rooms(kvx_engine_t prefill, kvx_engine_t decode, const std::string &bootstrap) {
    kvx_kv_config cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.struct_size = sizeof cfg;
    cfg.num_layers = 2;
    cfg.num_kv_heads = 2;
    cfg.head_dim = 64;
    cfg.dtype_bytes = 2;
    cfg.page_size = 4;
    cfg.num_pages = 32;
    cfg.checksum = 1;
    cfg.bootstrap_timeout_ms = 20000;
    cfg.waiting_timeout_ms = 20000;

    RoomNotes notes;
    REQUIRE_OK(kvx_engine_set_notify(decode, on_room_event, &notes));

    kvx_kv_t pkv = 0, dkv = 0;
    REQUIRE_OK(kvx_kv_create(prefill, &cfg, &pkv));
    REQUIRE_OK(kvx_kv_create(decode, &cfg, &dkv));
    kvx_kv_layout lay;
    REQUIRE_OK(kvx_kv_layout_get(pkv, &lay));
    CHECK(lay.num_buffers == 4);  // K and V of 2 layers
    CHECK(lay.item_len == 4 * 2 * 64 * 2);  // page_size x heads x head_dim x bytes
    CHECK(lay.pool_len == uint64_t(lay.num_buffers) * lay.num_pages * lay.item_len);

    void *pp = nullptr, *dp = nullptr;
    uint64_t plen = 0, dlen = 0;
    REQUIRE_OK(kvx_kv_pool(pkv, &pp, &plen));
    REQUIRE_OK(kvx_kv_pool(dkv, &dp, &dlen));
    CHECK(plen == lay.pool_len && dlen == lay.pool_len);
    auto *src = static_cast<uint8_t *>(pp);
    auto *dst = static_cast<const uint8_t *>(dp);
    auto item = [&](uint32_t buf, uint32_t page) { return uint64_t(buf) * lay.buffer_len + uint64_t(page) * lay.item_len; };
    for (uint32_t b = 0; b < lay.num_buffers; b++)
        for (uint32_t p = 0; p < lay.num_pages; p++)
            for (uint64_t i = 0; i < lay.item_len; i++) src[item(b, p) + i] = pattern(b * 1000 + p, i);

    // Bad arguments on the KV API.
    kvx_room_t bad = 0;
    EXPECT_RC(kvx_kv_sender_create(dkv, 1, &bad), KVX_ERR_INVALID_ARGUMENT);  // decode has no senders
    EXPECT_RC(kvx_kv_receiver_create(pkv, nullptr, 1, &bad), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_kv_receiver_create(dkv, "nope", 1, &bad), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_kv_sender_create(pkv, uint64_t(1) << 63, &bad), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_kv_sender_create(0, 1, &bad), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_kv_create(prefill, nullptr, &pkv), KVX_ERR_INVALID_ARGUMENT);
    kvx_kv_config zero;
    std::memset(&zero, 0, sizeof zero);
    zero.struct_size = sizeof zero;
    kvx_kv_t unused = 0;
    EXPECT_RC(kvx_kv_create(decode, &zero, &unused), KVX_ERR_INVALID_ARGUMENT);  // 0 pages
    EXPECT_RC(kvx_kv_poll(0, nullptr), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_kv_abort(0), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_kv_close(0), KVX_ERR_BAD_HANDLE);

    kvx_room_t rx = 0, tx = 0;
    REQUIRE_OK(kvx_kv_receiver_create(dkv, bootstrap.c_str(), 42, &rx));
    const int32_t dst_pages[5] = {3, 7, 8, 9, 20};
    const int32_t src_pages[5] = {0, 1, 2, 5, 6};
    EXPECT_RC(kvx_kv_receiver_init(rx, dst_pages, 0), KVX_ERR_INVALID_ARGUMENT);
    const int32_t out_of_range[1] = {32};
    EXPECT_RC(kvx_kv_receiver_init(rx, out_of_range, 1), KVX_ERR_INVALID_ARGUMENT);
    REQUIRE_OK(kvx_kv_receiver_init(rx, dst_pages, 5));

    REQUIRE_OK(kvx_kv_sender_create(pkv, 42, &tx));
    EXPECT_RC(kvx_kv_sender_create(pkv, 42, &bad), KVX_ERR_BUSY);  // room already active
    EXPECT_RC(kvx_kv_receiver_init(tx, dst_pages, 5), KVX_ERR_INVALID_ARGUMENT);  // a sender
    REQUIRE_OK(kvx_kv_sender_init(tx, 5));
    int32_t st = -1;
    REQUIRE_OK(kvx_kv_wait(tx, KVX_KVPOLL_WAITING_FOR_INPUT, 20000, &st));
    CHECK(st == KVX_KVPOLL_WAITING_FOR_INPUT);
    EXPECT_RC(kvx_kv_sender_send(tx, out_of_range, 1, 0), KVX_ERR_INVALID_ARGUMENT);
    REQUIRE_OK(kvx_kv_sender_send(tx, src_pages, 3, 0));
    REQUIRE_OK(kvx_kv_sender_send(tx, src_pages + 3, 2, 1));
    REQUIRE_OK(kvx_kv_wait(tx, KVX_KVPOLL_SUCCESS, 20000, &st));
    CHECK(st == KVX_KVPOLL_SUCCESS);
    REQUIRE_OK(kvx_kv_wait(rx, KVX_KVPOLL_SUCCESS, 20000, &st));
    CHECK(st == KVX_KVPOLL_SUCCESS);
    if (st != KVX_KVPOLL_SUCCESS) std::fprintf(stderr, "receiver failure: %d %s\n", kvx_kv_failure(rx), kvx_last_error());
    REQUIRE_OK(kvx_kv_poll(rx, &st));
    CHECK(st == KVX_KVPOLL_SUCCESS);
    REQUIRE_OK(kvx_kv_failure(rx));

    int bad_items = 0;
    for (uint32_t b = 0; b < lay.num_buffers; b++)
        for (int k = 0; k < 5; k++)
            if (std::memcmp(dst + item(b, dst_pages[k]), src + item(b, src_pages[k]), lay.item_len) != 0) {
                std::fprintf(stderr, "buffer %u: decode page %d differs from prefill page %d\n", b, dst_pages[k], src_pages[k]);
                ++bad_items;
            }
    CHECK(bad_items == 0);
    // A page that was not a destination stays zero.
    for (uint64_t i = 0; i < lay.item_len; i++)
        if (dst[item(0, 4) + i] != 0) { CHECK(!"decode page 4 was written"); break; }

    // Observability: the library's metrics count the room on both sides,
    // and its timeline is kept.
    {
        size_t need = 0;
        EXPECT_RC(kvx_metrics_text(nullptr, 0, &need), KVX_ERR_BUFFER_TOO_SMALL);
        std::string text(need + 4096, '\0');
        REQUIRE_OK(kvx_metrics_text(text.data(), text.size(), &need));
        text.resize(need - 1);
        CHECK(text.find("kvxfer_rooms_total{reason=\"none\",role=\"decode\",state=\"success\",step=\"none\"} 1") != std::string::npos);
        CHECK(text.find("kvxfer_rooms_total{reason=\"none\",role=\"prefill\",state=\"success\",step=\"none\"} 1") != std::string::npos);
        CHECK(text.find("kvxfer_transfer_bytes_total{") != std::string::npos);
        std::string tl(64, '\0');
        EXPECT_RC(kvx_room_timeline(42, tl.data(), tl.size(), &need), KVX_ERR_BUFFER_TOO_SMALL);
        tl.assign(need, '\0');
        REQUIRE_OK(kvx_room_timeline(42, tl.data(), tl.size(), &need));
        CHECK(tl.find("\"room\":42") != std::string::npos && tl.find("\"state\":\"Success\"") != std::string::npos);
        EXPECT_RC(kvx_room_timeline(4242424242ULL, tl.data(), tl.size(), &need), KVX_ERR_NOT_FOUND);
        uint16_t mport = 0;
        REQUIRE_OK(kvx_metrics_serve("127.0.0.1:0", &mport));
        CHECK(mport != 0);
        uint16_t again = 0;
        REQUIRE_OK(kvx_metrics_serve(nullptr, &again));
        CHECK(again == mport);
    }

    REQUIRE_OK(kvx_kv_close(tx));
    REQUIRE_OK(kvx_kv_close(rx));
    EXPECT_RC(kvx_kv_close(rx), KVX_ERR_BAD_HANDLE);
    EXPECT_RC(kvx_kv_poll(rx, &st), KVX_ERR_BAD_HANDLE);

    // Layer-wise: room 44 is sent layer by layer as a forward pass would
    // produce it, in two chunks of a chunked prefill: chunk A (2 pages)
    // layer 0, then layer 1; chunk B (1 page) both layers at once. After
    // chunk A the decode is still TRANSFERRING (its record comes only
    // with the last layer); then both sides reach Success and every byte
    // matches (CRC32C on: the sender takes it over the whole room).
    {
        kvx_room_t lrx = 0, ltx = 0;
        const int32_t ldst[3] = {12, 13, 14};
        const int32_t lsrc[3] = {3, 4, 10};
        REQUIRE_OK(kvx_kv_receiver_create(dkv, bootstrap.c_str(), 44, &lrx));
        REQUIRE_OK(kvx_kv_receiver_init(lrx, ldst, 3));
        REQUIRE_OK(kvx_kv_sender_create(pkv, 44, &ltx));
        REQUIRE_OK(kvx_kv_wait(ltx, KVX_KVPOLL_WAITING_FOR_INPUT, 20000, &st));
        EXPECT_RC(kvx_kv_sender_send_layers(ltx, lsrc, 2, 0, 2, nullptr), KVX_ERR_INVALID_ARGUMENT);  // 2 layers: 0..1
        CHECK(std::strstr(kvx_last_error(), "this rank holds layers 0") != nullptr);
        EXPECT_RC(kvx_kv_sender_send_layers(lrx, lsrc, 2, 0, 0, nullptr), KVX_ERR_INVALID_ARGUMENT);  // a receiver
        EXPECT_RC(kvx_kv_sender_flush(lrx, 10), KVX_ERR_INVALID_ARGUMENT);
        void *driver = std::getenv("KVXFER_LIBCUDA") ? nullptr : dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (driver != nullptr) dlclose(driver);
        else if (!std::getenv("KVXFER_LIBCUDA")) {  // no CUDA driver: an event cannot be waited for
            int fake_event = 0;
            EXPECT_RC(kvx_kv_sender_send_layers(ltx, lsrc, 2, 0, 0, &fake_event), KVX_ERR_NOT_SUPPORTED);
        }
        REQUIRE_OK(kvx_kv_sender_send_layers(ltx, lsrc, 2, 0, 0, nullptr));
        REQUIRE_OK(kvx_kv_sender_send_layers(ltx, lsrc, 2, 1, 1, nullptr));
        REQUIRE_OK(kvx_kv_sender_flush(ltx, 20000));
        REQUIRE_OK(kvx_kv_poll(lrx, &st));
        CHECK(st == KVX_KVPOLL_TRANSFERRING);
        REQUIRE_OK(kvx_kv_sender_send_layers(ltx, lsrc + 2, 1, 0, 1, nullptr));
        EXPECT_RC(kvx_kv_sender_send_layers(ltx, nullptr, 0, 0, 0, nullptr), KVX_ERR_INVALID_ARGUMENT);  // after the last
        REQUIRE_OK(kvx_kv_wait(lrx, KVX_KVPOLL_SUCCESS, 20000, &st));
        CHECK(st == KVX_KVPOLL_SUCCESS);
        REQUIRE_OK(kvx_kv_wait(ltx, KVX_KVPOLL_SUCCESS, 20000, &st));
        CHECK(st == KVX_KVPOLL_SUCCESS);
        int lbad = 0;
        for (uint32_t b = 0; b < lay.num_buffers; b++)
            for (int k = 0; k < 3; k++)
                if (std::memcmp(dst + item(b, ldst[k]), src + item(b, lsrc[k]), lay.item_len) != 0) ++lbad;
        CHECK(lbad == 0);
        REQUIRE_OK(kvx_kv_close(ltx));
        REQUIRE_OK(kvx_kv_close(lrx));
        std::printf("KV-room API: room 44 sent layer by layer (2 chunks x 2 layers), 3 pages x %u buffers verified\n", lay.num_buffers);
    }

    // Abort: a receiver for room 43 (no sender ever comes) is aborted and
    // reports Failed with KVX_ERR_CANCELED.
    kvx_room_t rx2 = 0;
    REQUIRE_OK(kvx_kv_receiver_create(dkv, bootstrap.c_str(), 43, &rx2));
    const int32_t one[1] = {10};
    REQUIRE_OK(kvx_kv_receiver_init(rx2, one, 1));
    REQUIRE_OK(kvx_kv_abort(rx2));
    REQUIRE_OK(kvx_kv_wait(rx2, KVX_KVPOLL_SUCCESS, 10000, &st));
    CHECK(st == KVX_KVPOLL_FAILED);
    EXPECT_RC(kvx_kv_failure(rx2), KVX_ERR_CANCELED);
    REQUIRE_OK(kvx_kv_close(rx2));

    for (int i = 0; i < 3000 && notes.success_events.load() < 1; i++)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    CHECK(notes.success_events.load() == 1);
    REQUIRE_OK(kvx_engine_set_notify(decode, nullptr, nullptr));

    REQUIRE_OK(kvx_kv_destroy(pkv));
    EXPECT_RC(kvx_kv_destroy(pkv), KVX_ERR_BAD_HANDLE);
    // dkv is left open on purpose: kvx_engine_destroy(decode) closes it.
    std::printf("KV-room API: room 42, 5 pages x %u buffers verified (%d room notifications); abort -> %s\n",
                lay.num_buffers, notes.room_events.load(), kvx_strerror(KVX_ERR_CANCELED));
}

// ---------------------------------------------------------------------------
// KV managers on the caller's own buffers (SGLang KVArgs).
// ---------------------------------------------------------------------------

// The CUDA runtime, loaded at run time so the consumer builds without a
// toolkit. usable() is false (with the reason) when there is no library or
// no device.
struct Cudart {
    void *lib = nullptr;
    int (*get_device_count)(int *) = nullptr;
    int (*malloc_)(void **, size_t) = nullptr;
    int (*free_)(void *) = nullptr;
    int (*memcpy_)(void *, const void *, size_t, int) = nullptr;
    std::string why;
    bool usable() {
        for (const char *name : {"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"})
            if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
        if (lib == nullptr) {
            why = "no libcudart";
            return false;
        }
        get_device_count = reinterpret_cast<int (*)(int *)>(dlsym(lib, "cudaGetDeviceCount"));
        malloc_ = reinterpret_cast<int (*)(void **, size_t)>(dlsym(lib, "cudaMalloc"));
        free_ = reinterpret_cast<int (*)(void *)>(dlsym(lib, "cudaFree"));
        memcpy_ = reinterpret_cast<int (*)(void *, const void *, size_t, int)>(dlsym(lib, "cudaMemcpy"));
        int n = 0;
        if (!get_device_count || !malloc_ || !free_ || !memcpy_ || get_device_count(&n) != 0 || n < 1) {
            why = "libcudart without a usable device";
            return false;
        }
        return true;
    }
};

constexpr uint32_t kLayers = 2, kHeads = 2, kHeadDim = 64, kElem = 2, kTokensPerPage = 4, kBufPages = 16;
constexpr uint64_t kItem = uint64_t(kTokensPerPage) * kHeads * kHeadDim * kElem;  // bytes per page per buffer
constexpr uint32_t kBuffers = 2 * kLayers;                                         // K of each layer, then V
constexpr uint64_t kAuxRows = 8;
const uint64_t kAuxItem[2] = {64, 512};  // SGLang's output_ids row and a top-logprobs row

// One rank's KV and aux memory, owned here: each buffer its own allocation.
struct OwnedKV {
    enum Kind { Vector, AllocHost, Device } kind;
    Cudart *cuda = nullptr;
    std::vector<std::vector<uint8_t>> vecs;  // Vector: KV buffers then aux buffers
    std::vector<kvx_hostbuf_t> hbs;          // AllocHost
    std::vector<void *> dev;                 // Device: KV buffers (aux stay in vecs)
    std::vector<uint64_t> ptrs, lens, items, aux_ptrs, aux_lens, aux_items;

    OwnedKV(Kind k, Cudart *c, const char *name) : kind(k), cuda(c) {
        auto host = [&](uint64_t len) -> uint64_t {
            if (kind == AllocHost) {
                kvx_hostbuf_t hb = 0;
                void *p = nullptr;
                uint64_t got = 0;
                REQUIRE_OK(kvx_alloc_host(name, len, &hb, &p, &got));
                hbs.push_back(hb);
                return reinterpret_cast<uint64_t>(p);
            }
            vecs.emplace_back(len, 0);
            return reinterpret_cast<uint64_t>(vecs.back().data());
        };
        vecs.reserve(kBuffers + 2);
        for (uint32_t b = 0; b < kBuffers; b++) {
            uint64_t p = 0;
            if (kind == Device) {
                void *d = nullptr;
                if (cuda->malloc_(&d, kBufPages * kItem) != 0) {
                    std::fprintf(stderr, "cudaMalloc failed\n");
                    std::exit(1);
                }
                std::vector<uint8_t> zero(kBufPages * kItem, 0);
                cuda->memcpy_(d, zero.data(), zero.size(), 1 /* cudaMemcpyHostToDevice */);
                dev.push_back(d);
                p = reinterpret_cast<uint64_t>(d);
            } else {
                p = host(kBufPages * kItem);
            }
            ptrs.push_back(p);
            lens.push_back(kBufPages * kItem);
            items.push_back(kItem);
        }
        Kind auxKind = kind == Device ? Vector : kind;  // aux rows live in host memory
        for (uint64_t it : kAuxItem) {
            Kind saved = kind;
            kind = auxKind;
            aux_ptrs.push_back(host(kAuxRows * it));
            kind = saved;
            aux_lens.push_back(kAuxRows * it);
            aux_items.push_back(it);
        }
    }
    ~OwnedKV() {
        for (void *d : dev) cuda->free_(d);
        for (kvx_hostbuf_t hb : hbs) kvx_free_host(hb);
    }
    void write(uint32_t buf, uint64_t off, const std::vector<uint8_t> &b) {
        if (kind == Device)
            cuda->memcpy_(static_cast<uint8_t *>(dev[buf]) + off, b.data(), b.size(), 1);
        else
            std::memcpy(reinterpret_cast<uint8_t *>(ptrs[buf]) + off, b.data(), b.size());
    }
    std::vector<uint8_t> read(uint32_t buf, uint64_t off, uint64_t n) {
        std::vector<uint8_t> b(n);
        if (kind == Device)
            cuda->memcpy_(b.data(), static_cast<uint8_t *>(dev[buf]) + off, n, 2 /* cudaMemcpyDeviceToHost */);
        else
            std::memcpy(b.data(), reinterpret_cast<uint8_t *>(ptrs[buf]) + off, n);
        return b;
    }
    uint8_t *aux_row(int i, uint64_t row) { return reinterpret_cast<uint8_t *>(aux_ptrs[i]) + row * aux_items[i]; }
    kvx_kv_config config(uint32_t naux) const {
        kvx_kv_config cfg;
        std::memset(&cfg, 0, sizeof cfg);
        cfg.struct_size = sizeof cfg;
        cfg.page_size = kTokensPerPage;
        cfg.tp_size = 1;
        cfg.checksum = 1;
        cfg.bootstrap_timeout_ms = 20000;
        cfg.waiting_timeout_ms = 20000;
        cfg.num_kv_buffers = kBuffers;
        cfg.kv_data_ptrs = ptrs.data();
        cfg.kv_data_lens = lens.data();
        cfg.kv_item_lens = items.data();
        cfg.num_aux_buffers = naux;
        cfg.aux_data_ptrs = aux_ptrs.data();
        cfg.aux_data_lens = aux_lens.data();
        cfg.aux_item_lens = aux_items.data();
        cfg.kv_head_num = kHeads;
        cfg.total_kv_head_num = kHeads;
        cfg.kv_location = kind == Device ? "cuda:0" : nullptr;
        return cfg;
    }
};

bool has_text(const char *what) { return std::strstr(kvx_last_error(), what) != nullptr; }

void owned_buffers() {
    Cudart cuda;
    OwnedKV::Kind kind = OwnedKV::Vector;
    std::string where = "std::vector per buffer";
    if (std::strcmp(g_transport, "shm") == 0) {
        kind = OwnedKV::AllocHost;  // shm shares memory by fd: kvx_alloc_host memory
        where = "kvx_alloc_host per buffer (shm shares memory by fd)";
    } else if (cuda.usable()) {
        kind = OwnedKV::Device;
        where = "cudaMalloc per buffer on cuda:0";
    } else {
        std::printf("owned buffers: GPU part skipped (%s); host buffers instead\n", cuda.why.c_str());
    }
    kvx_bootstrap_t bs = 0;
    REQUIRE_OK(kvx_bootstrap_start("127.0.0.1", 0, &bs));
    std::string addr = bootstrap_address(bs);
    kvx_engine_t prefill = make_engine(KVX_ROLE_PREFILL, addr);
    kvx_engine_t decode = make_engine(KVX_ROLE_DECODE, addr);
    auto pre = std::make_unique<OwnedKV>(kind, &cuda, "owned-prefill");
    auto dec = std::make_unique<OwnedKV>(kind, &cuda, "owned-decode");
    for (uint32_t b = 0; b < kBuffers; b++)
        for (uint32_t p = 0; p < kBufPages; p++) {
            std::vector<uint8_t> item(kItem);
            for (uint64_t i = 0; i < kItem; i++) item[i] = pattern(b * 1000 + p + 300, i);
            pre->write(b, p * kItem, item);
        }
    for (int a = 0; a < 2; a++)
        for (uint64_t i = 0; i < kAuxItem[a]; i++) pre->aux_row(a, 3)[i] = pattern(900 + a, i);

    kvx_kv_config pcfg = pre->config(2), dcfg = dec->config(2);
    kvx_kv_t pkv = 0, dkv = 0;
    REQUIRE_OK(kvx_kv_create(prefill, &pcfg, &pkv));
    REQUIRE_OK(kvx_kv_create(decode, &dcfg, &dkv));
    kvx_kv_layout lay;
    REQUIRE_OK(kvx_kv_layout_get(dkv, &lay));
    CHECK(lay.num_buffers == kBuffers && lay.num_pages == kBufPages && lay.item_len == kItem && lay.pool_len == 0);
    void *pool = nullptr;
    uint64_t plen = 0;
    EXPECT_RC(kvx_kv_pool(dkv, &pool, &plen), KVX_ERR_INVALID_ARGUMENT);  // the caller owns the buffers

    // Room 77: a 24-token prompt (6 pages) whose first 8 tokens (2 pages) the
    // decode already holds; aux row 3 of the prefill lands in row 5.
    kvx_room_t rx = 0, tx = 0;
    REQUIRE_OK(kvx_kv_receiver_create_dp(dkv, nullptr, 77, -1, &rx));
    const int32_t tail[4] = {9, 10, 11, 12};
    const int32_t beyond[1] = {int32_t(kBufPages)};
    EXPECT_RC(kvx_kv_receiver_send_metadata(rx, beyond, 1, 5, nullptr, 0, 8), KVX_ERR_INVALID_ARGUMENT);
    CHECK(has_text("beyond KV buffer"));
    EXPECT_RC(kvx_kv_receiver_send_metadata(rx, tail, 4, int64_t(kAuxRows), nullptr, 0, 8), KVX_ERR_INVALID_ARGUMENT);
    CHECK(has_text("aux index 8 is beyond aux buffer"));
    EXPECT_RC(kvx_kv_receiver_send_metadata(rx, tail, 4, 5, nullptr, 0, 6), KVX_ERR_INVALID_ARGUMENT);
    CHECK(has_text("whole pages"));
    const int32_t slot[1] = {0};
    EXPECT_RC(kvx_kv_receiver_send_metadata(rx, tail, 4, 5, slot, 1, 8), KVX_ERR_INVALID_ARGUMENT);  // no state buffers
    REQUIRE_OK(kvx_kv_receiver_send_metadata(rx, tail, 4, 5, nullptr, 0, 8));
    REQUIRE_OK(kvx_kv_sender_create(pkv, 77, &tx));
    int32_t st = -1;
    REQUIRE_OK(kvx_kv_wait(tx, KVX_KVPOLL_WAITING_FOR_INPUT, 20000, &st));
    uint32_t prefix = 0, npages = 0;
    REQUIRE_OK(kvx_kv_sender_prefix_len(tx, &prefix));
    CHECK(prefix == 8);
    EXPECT_RC(kvx_kv_sender_init_aux(tx, 4, int64_t(kAuxRows)), KVX_ERR_INVALID_ARGUMENT);
    REQUIRE_OK(kvx_kv_sender_init_tokens(tx, 24, 3, &npages));
    CHECK(npages == 4);
    const int32_t src[4] = {2, 3, 4, 5};  // the prompt's pages 2..5 on the prefill
    REQUIRE_OK(kvx_kv_sender_send(tx, src, 4, 1));
    REQUIRE_OK(kvx_kv_wait(rx, KVX_KVPOLL_SUCCESS, 20000, &st));
    if (st != KVX_KVPOLL_SUCCESS) std::fprintf(stderr, "receiver 77: state %d: %d %s\n", st, kvx_kv_failure(rx), kvx_last_error());
    CHECK(st == KVX_KVPOLL_SUCCESS);
    REQUIRE_OK(kvx_kv_wait(tx, KVX_KVPOLL_SUCCESS, 20000, &st));
    CHECK(st == KVX_KVPOLL_SUCCESS);
    int bad = 0;
    for (uint32_t b = 0; b < kBuffers; b++) {
        for (int k = 0; k < 4; k++)
            if (dec->read(b, uint64_t(tail[k]) * kItem, kItem) != pre->read(b, uint64_t(src[k]) * kItem, kItem)) ++bad;
        // Pages the decode did not ask for (its held prefix would be there) stay as they were.
        std::vector<uint8_t> rest = dec->read(b, 0, 9 * kItem);
        for (uint8_t c : rest) bad += c != 0;
    }
    CHECK(bad == 0);
    for (int a = 0; a < 2; a++) CHECK(std::memcmp(dec->aux_row(a, 5), pre->aux_row(a, 3), kAuxItem[a]) == 0);
    std::vector<uint8_t> row(512);
    size_t need = 0;
    EXPECT_RC(kvx_kv_receiver_aux_row(rx, 1, row.data(), 16, &need), KVX_ERR_BUFFER_TOO_SMALL);
    CHECK(need == 512);
    REQUIRE_OK(kvx_kv_receiver_aux_row(rx, 1, row.data(), row.size(), &need));
    CHECK(std::memcmp(row.data(), pre->aux_row(1, 3), 512) == 0);
    for (kvx_room_t h : {tx, rx}) {
        kvx_transfer_metric m;
        std::memset(&m, 0, sizeof m);
        m.struct_size = sizeof m;
        REQUIRE_OK(kvx_kv_metric(h, &m));
        CHECK(m.prefix_tokens == 8 && m.bytes == 4 * kBuffers * kItem && m.skipped_bytes == 2 * kBuffers * kItem &&
              m.aux_bytes == kAuxItem[0] + kAuxItem[1] && m.pages == 4 && m.latency_us > 0);
    }
    REQUIRE_OK(kvx_kv_close(tx));
    REQUIRE_OK(kvx_kv_close(rx));

    // Room 78: the decode states a 16-token prefix of a 12-token prompt;
    // both sides fail, naming both counts.
    REQUIRE_OK(kvx_kv_receiver_create(dkv, nullptr, 78, &rx));
    const int32_t one[1] = {13};
    REQUIRE_OK(kvx_kv_receiver_send_metadata(rx, one, 1, -1, nullptr, 0, 16));
    REQUIRE_OK(kvx_kv_sender_create(pkv, 78, &tx));
    REQUIRE_OK(kvx_kv_wait(tx, KVX_KVPOLL_WAITING_FOR_INPUT, 20000, &st));
    EXPECT_RC(kvx_kv_sender_init_tokens(tx, 12, -1, &npages), KVX_ERR_INVALID_ARGUMENT);
    CHECK(has_text("prefix of 16 tokens, longer than the prefill's prompt of 12 tokens"));
    REQUIRE_OK(kvx_kv_wait(rx, KVX_KVPOLL_SUCCESS, 20000, &st));
    CHECK(st == KVX_KVPOLL_FAILED);
    kvx_kv_failure(rx);
    CHECK(has_text("longer than the prefill's prompt"));
    REQUIRE_OK(kvx_kv_close(tx));
    REQUIRE_OK(kvx_kv_close(rx));

    // A decode whose aux list differs (one buffer, the prefill has two) is
    // refused at registration; both sides fail the room.
    kvx_engine_t decode2 = make_engine(KVX_ROLE_DECODE, addr);
    auto dec2 = std::make_unique<OwnedKV>(kind, &cuda, "owned-decode2");
    kvx_kv_config d2 = dec2->config(1);
    kvx_kv_t dkv2 = 0;
    REQUIRE_OK(kvx_kv_create(decode2, &d2, &dkv2));
    REQUIRE_OK(kvx_kv_receiver_create(dkv2, nullptr, 79, &rx));
    REQUIRE_OK(kvx_kv_receiver_send_metadata(rx, one, 1, 0, nullptr, 0, 0));
    REQUIRE_OK(kvx_kv_sender_create(pkv, 79, &tx));
    REQUIRE_OK(kvx_kv_wait(rx, KVX_KVPOLL_SUCCESS, 20000, &st));
    CHECK(st == KVX_KVPOLL_FAILED);
    kvx_kv_failure(rx);
    CHECK(has_text("aux buffer counts differ: prefill has 2, decode has 1"));
    REQUIRE_OK(kvx_kv_wait(tx, KVX_KVPOLL_SUCCESS, 20000, &st));
    CHECK(st == KVX_KVPOLL_FAILED);
    REQUIRE_OK(kvx_kv_close(tx));
    REQUIRE_OK(kvx_kv_close(rx));
    REQUIRE_OK(kvx_kv_destroy(dkv2));
    REQUIRE_OK(kvx_engine_destroy(decode2));
    dec2.reset();

    // Refusals at creation, naming the buffer.
    kvx_kv_t bad_kv = 0;
    std::vector<uint64_t> ptrs = dec->ptrs;
    kvx_kv_config c = dec->config(2);
    ptrs[1] = ptrs[0] + 100;
    c.kv_data_ptrs = ptrs.data();
    EXPECT_RC(kvx_kv_create(decode, &c, &bad_kv), KVX_ERR_INVALID_ARGUMENT);
    CHECK(has_text("overlaps KV buffer 0"));
    std::vector<uint64_t> lens = dec->lens;
    lens[2] = 0;
    c = dec->config(2);
    c.kv_data_lens = lens.data();
    EXPECT_RC(kvx_kv_create(decode, &c, &bad_kv), KVX_ERR_INVALID_ARGUMENT);
    CHECK(has_text("length 0"));
    c = dec->config(2);
    c.model = "llama-3.1-8b";
    EXPECT_RC(kvx_kv_create(decode, &c, &bad_kv), KVX_ERR_INVALID_ARGUMENT);
    c = dec->config(2);
    c.kv_data_ptrs = nullptr;
    EXPECT_RC(kvx_kv_create(decode, &c, &bad_kv), KVX_ERR_INVALID_ARGUMENT);
    // Device memory on a transport that cannot move it: fake device
    // addresses are refused before anything touches them.
    std::vector<uint64_t> fake;
    for (uint32_t b = 0; b < kBuffers; b++) fake.push_back(0x7f0000000000ull + uint64_t(b) * (1u << 20));
    c = dec->config(2);
    c.kv_data_ptrs = fake.data();
    c.kv_location = "cuda:0";
    int rc = kvx_kv_create(decode, &c, &bad_kv);
    CHECK(rc != KVX_OK && has_text("cannot register KV buffer 0 (layer 0 K)"));
    if (std::strcmp(g_transport, "shm") == 0) CHECK(rc == KVX_ERR_UNSUPPORTED_MEMORY);
    // Control-frame authentication and the peer bound (control_auth,
    // max_peers): refused values name the field; authentication needs the
    // deployment's token.
    c = dec->config(2);
    c.control_auth = 3;
    EXPECT_RC(kvx_kv_create(decode, &c, &bad_kv), KVX_ERR_INVALID_ARGUMENT);
    CHECK(has_text("control_auth is 3"));
    c = dec->config(2);
    c.control_auth = KVX_CONTROL_AUTH_ON;
    CHECK(kvx_kv_create(decode, &c, &bad_kv) != KVX_OK && has_text("BootstrapAuthToken"));
    c = dec->config(2);
    c.max_peers = (1u << 20) + 1;
    EXPECT_RC(kvx_kv_create(decode, &c, &bad_kv), KVX_ERR_INVALID_ARGUMENT);
    CHECK(has_text("max_peers is 1048577"));

    // A caller built against the 0.1 header: the smaller struct, the 0.1
    // model fields; what lies past struct_size is not read.
    kvx_kv_config old;
    std::memset(&old, 0, sizeof old);
    old.struct_size = KVX_KV_CONFIG_SIZE_V1;
    old.num_layers = 2;
    old.num_kv_heads = 2;
    old.head_dim = 64;
    old.dtype_bytes = 2;
    old.page_size = 4;
    old.num_pages = 8;
    old.num_kv_buffers = 99;  // past KVX_KV_CONFIG_SIZE_V1: ignored
    old.kv_data_ptrs = fake.data();
    kvx_kv_t okv = 0;
    REQUIRE_OK(kvx_kv_create(decode, &old, &okv));
    REQUIRE_OK(kvx_kv_layout_get(okv, &lay));
    CHECK(lay.num_buffers == 4 && lay.pool_len == 4 * 8 * lay.item_len);
    REQUIRE_OK(kvx_kv_destroy(okv));
    old.struct_size = KVX_KV_CONFIG_SIZE_V1 - 4;
    EXPECT_RC(kvx_kv_create(decode, &old, &okv), KVX_ERR_INVALID_ARGUMENT);

    REQUIRE_OK(kvx_kv_destroy(pkv));
    REQUIRE_OK(kvx_kv_destroy(dkv));
    REQUIRE_OK(kvx_engine_destroy(prefill));
    REQUIRE_OK(kvx_engine_destroy(decode));
    REQUIRE_OK(kvx_bootstrap_stop(bs));
    pre.reset();
    dec.reset();
    std::printf("owned buffers (%s): room 77 with a 2-page prefix and aux row verified; prefix too long, aux list mismatch, "
                "overlap, zero length, model+buffers, device memory, control_auth/max_peers and an old-size config checked\n",
                where.c_str());
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
    CHECK(std::strcmp(name, g_transport) == 0);
    CHECK(kvx_last_error()[0] == '\0');
    std::printf("bad arguments: every call returned its error code\n");
}

// ---------------------------------------------------------------------------
// Two processes: the decode side (this process: bootstrap server, decode
// engine, KV manager and receiver) spawns a prefill child (a separate
// process with its own copy of the library) that writes through both APIs.
// ---------------------------------------------------------------------------

kvx_kv_config small_kv_config() {
    kvx_kv_config cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.struct_size = sizeof cfg;
    cfg.num_layers = 2;
    cfg.num_kv_heads = 2;
    cfg.head_dim = 64;
    cfg.dtype_bytes = 2;
    cfg.page_size = 4;
    cfg.num_pages = 32;
    cfg.checksum = 1;
    cfg.bootstrap_timeout_ms = 30000;
    cfg.waiting_timeout_ms = 30000;
    return cfg;
}

constexpr uint64_t kChildRoom = 7;
const int32_t kChildSrc[4] = {0, 1, 2, 3};
const int32_t kChildDst[4] = {1, 3, 5, 7};

// The prefill child: argv = {self, "--prefill-child", transport, bootstrap, blob_path}.
int prefill_child(const char *transport, const char *bootstrap, const char *blob_path) {
    g_transport = transport;
    kvx_engine_t eng = make_engine(KVX_ROLE_PREFILL, bootstrap);

    // Batch API: 8 pages, one strided request, into the parent's region.
    kvx_hostbuf_t hb = 0;
    void *p = nullptr;
    uint64_t len = 0;
    REQUIRE_OK(kvx_alloc_host("child-src", 8 * kPageSize, &hb, &p, &len));
    auto *s8 = static_cast<uint8_t *>(p);
    for (uint64_t pg = 0; pg < 8; pg++)
        for (uint64_t i = 0; i < kPageSize; i++) s8[pg * kPageSize + i] = pattern(100 + pg, i);
    kvx_region_t r = 0;
    REQUIRE_OK(kvx_register_memory(eng, p, len, "cpu", &r));
    std::ifstream in(blob_path, std::ios::binary);
    std::vector<char> blob((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    kvx_segment_t seg = 0;
    REQUIRE_OK(kvx_segment_open(eng, blob.data(), blob.size(), &seg));
    kvx_batch_t b = 0;
    REQUIRE_OK(kvx_batch_alloc(seg, 1, &b));
    // Remote region ID: the only region the parent registered before export.
    uint32_t remote = 0;
    {
        std::ifstream rid(std::string(blob_path) + ".region");
        rid >> remote;
    }
    kvx_write_request w = {reinterpret_cast<uint64_t>(p), 0, kPageSize, kPageSize, 2 * kPageSize, remote, 8};
    REQUIRE_OK(kvx_batch_submit(b, &w, 1));
    REQUIRE_OK(kvx_batch_wait(b, 30000));
    REQUIRE_OK(kvx_batch_free(b));
    REQUIRE_OK(kvx_segment_close(seg));

    // KV-room API: register with the bootstrap server, send room 7.
    kvx_kv_config cfg = small_kv_config();
    kvx_kv_t kv = 0;
    REQUIRE_OK(kvx_kv_create(eng, &cfg, &kv));
    kvx_kv_layout lay;
    REQUIRE_OK(kvx_kv_layout_get(kv, &lay));
    void *pool = nullptr;
    uint64_t plen = 0;
    REQUIRE_OK(kvx_kv_pool(kv, &pool, &plen));
    auto *src = static_cast<uint8_t *>(pool);
    for (uint32_t bf = 0; bf < lay.num_buffers; bf++)
        for (uint32_t pg = 0; pg < lay.num_pages; pg++)
            for (uint64_t i = 0; i < lay.item_len; i++)
                src[uint64_t(bf) * lay.buffer_len + uint64_t(pg) * lay.item_len + i] = pattern(bf * 1000 + pg + 500, i);
    kvx_room_t tx = 0;
    REQUIRE_OK(kvx_kv_sender_create(kv, kChildRoom, &tx));
    REQUIRE_OK(kvx_kv_sender_init(tx, 4));
    int32_t st = -1;
    REQUIRE_OK(kvx_kv_wait(tx, KVX_KVPOLL_WAITING_FOR_INPUT, 30000, &st));
    REQUIRE_OK(kvx_kv_sender_send(tx, kChildSrc, 4, 1));
    REQUIRE_OK(kvx_kv_wait(tx, KVX_KVPOLL_SUCCESS, 30000, &st));
    if (st != KVX_KVPOLL_SUCCESS) {
        std::fprintf(stderr, "child: sender ended in state %d: %d %s\n", st, kvx_kv_failure(tx), kvx_last_error());
        return 1;
    }
    REQUIRE_OK(kvx_kv_close(tx));
    REQUIRE_OK(kvx_kv_destroy(kv));
    REQUIRE_OK(kvx_deregister_memory(eng, r));
    REQUIRE_OK(kvx_engine_destroy(eng));
    REQUIRE_OK(kvx_free_host(hb));
    return failures ? 1 : 0;
}

void two_processes(const char *self) {
    kvx_bootstrap_t bs = 0;
    REQUIRE_OK(kvx_bootstrap_start("127.0.0.1", 0, &bs));
    std::string addr = bootstrap_address(bs);
    kvx_engine_t dec = make_engine(KVX_ROLE_DECODE, addr);

    kvx_hostbuf_t hb = 0;
    void *p = nullptr;
    uint64_t len = 0;
    REQUIRE_OK(kvx_alloc_host("parent-dst", 16 * kPageSize, &hb, &p, &len));
    kvx_region_t r = 0;
    REQUIRE_OK(kvx_register_memory(dec, p, len, "cpu", &r));
    size_t need = 0;
    kvx_segment_export(dec, "child", nullptr, 0, &need);
    std::vector<char> blob(need);
    REQUIRE_OK(kvx_segment_export(dec, "child", blob.data(), blob.size(), &need));
    char dir[] = "/tmp/kvx_consumer.XXXXXX";
    if (mkdtemp(dir) == nullptr) {
        std::perror("mkdtemp");
        std::exit(1);
    }
    std::string blob_path = std::string(dir) + "/segment";
    std::ofstream(blob_path, std::ios::binary).write(blob.data(), std::streamsize(need));
    std::ofstream(blob_path + ".region") << r;

    kvx_kv_config cfg = small_kv_config();
    kvx_kv_t kv = 0;
    REQUIRE_OK(kvx_kv_create(dec, &cfg, &kv));
    kvx_kv_layout lay;
    REQUIRE_OK(kvx_kv_layout_get(kv, &lay));
    kvx_room_t rx = 0;
    REQUIRE_OK(kvx_kv_receiver_create(kv, nullptr, kChildRoom, &rx));
    REQUIRE_OK(kvx_kv_receiver_init(rx, kChildDst, 4));

    std::string t(g_transport);
    const char *args[] = {self, "--prefill-child", t.c_str(), addr.c_str(), blob_path.c_str(), nullptr};
    pid_t pid = 0;
    if (posix_spawn(&pid, self, nullptr, nullptr, const_cast<char **>(args), environ) != 0) {
        std::perror("posix_spawn");
        std::exit(1);
    }
    int32_t st = -1;
    int rc = kvx_kv_wait(rx, KVX_KVPOLL_SUCCESS, 60000, &st);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(rc == KVX_OK && st == KVX_KVPOLL_SUCCESS);
    if (st != KVX_KVPOLL_SUCCESS) std::fprintf(stderr, "receiver: state %d, %d %s\n", st, kvx_kv_failure(rx), kvx_last_error());

    // Batch API bytes: source page i landed at destination page 2i.
    auto *d8 = static_cast<const uint8_t *>(p);
    int bad = 0;
    for (uint64_t pg = 0; pg < 8; pg++)
        for (uint64_t i = 0; i < kPageSize; i++)
            if (d8[2 * pg * kPageSize + i] != pattern(100 + pg, i) || d8[(2 * pg + 1) * kPageSize + i] != 0) {
                ++bad;
                break;
            }
    CHECK(bad == 0);
    // KV bytes: every buffer's destination items match the child's pattern.
    void *pool = nullptr;
    uint64_t plen = 0;
    REQUIRE_OK(kvx_kv_pool(kv, &pool, &plen));
    auto *dst = static_cast<const uint8_t *>(pool);
    bad = 0;
    for (uint32_t bf = 0; bf < lay.num_buffers; bf++)
        for (int k = 0; k < 4; k++)
            for (uint64_t i = 0; i < lay.item_len; i++)
                if (dst[uint64_t(bf) * lay.buffer_len + uint64_t(kChildDst[k]) * lay.item_len + i] !=
                    pattern(bf * 1000 + kChildSrc[k] + 500, i)) {
                    ++bad;
                    break;
                }
    CHECK(bad == 0);

    REQUIRE_OK(kvx_kv_close(rx));
    REQUIRE_OK(kvx_kv_destroy(kv));
    REQUIRE_OK(kvx_deregister_memory(dec, r));
    REQUIRE_OK(kvx_engine_destroy(dec));
    REQUIRE_OK(kvx_free_host(hb));
    REQUIRE_OK(kvx_bootstrap_stop(bs));
    std::remove((blob_path + ".region").c_str());
    std::remove(blob_path.c_str());
    rmdir(dir);
    std::printf("two processes: prefill child wrote 8 pages (batch API) and room %llu (KV-room API); verified\n",
                (unsigned long long)kChildRoom);
}

}  // namespace

// The "prefill_complete" decode allocation policy on both roles (SGLang's
// --disaggregation-decode-allocation-policy): the decode's room stays
// BOOTSTRAPPING, reserving nothing, until the prefill marks the request
// computed (kvx_kv_sender_mark_prefill_complete); then the decode gives its
// pages and the room runs as under "early". The prefill also declares its
// HTTP port (prefill_http_port, after KVX_KV_CONFIG_SIZE_V5).
void prefill_complete_rooms() {
    Cudart cuda;
    OwnedKV::Kind kind = std::strcmp(g_transport, "shm") == 0 ? OwnedKV::AllocHost : OwnedKV::Vector;
    kvx_bootstrap_t bs = 0;
    REQUIRE_OK(kvx_bootstrap_start("127.0.0.1", 0, &bs));
    std::string addr = bootstrap_address(bs);
    kvx_engine_t prefill = make_engine(KVX_ROLE_PREFILL, addr);
    kvx_engine_t decode = make_engine(KVX_ROLE_DECODE, addr);
    auto pre = std::make_unique<OwnedKV>(kind, &cuda, "pc-prefill");
    auto dec = std::make_unique<OwnedKV>(kind, &cuda, "pc-decode");
    for (uint32_t b = 0; b < kBuffers; b++) {
        std::vector<uint8_t> item(kItem);
        for (uint64_t i = 0; i < kItem; i++) item[i] = pattern(b * 1000 + 500, i);
        pre->write(b, 4 * kItem, item);  // the prompt's one page: prefill page 4
    }
    kvx_kv_config pcfg = pre->config(2), dcfg = dec->config(2);
    pcfg.decode_allocation_policy = dcfg.decode_allocation_policy = "prefill_complete";
    pcfg.prefill_http_port = 30000;
    kvx_kv_t pkv = 0, dkv = 0;
    REQUIRE_OK(kvx_kv_create(prefill, &pcfg, &pkv));
    REQUIRE_OK(kvx_kv_create(decode, &dcfg, &dkv));
    kvx_room_t rx = 0, tx = 0;
    REQUIRE_OK(kvx_kv_receiver_create_dp(dkv, nullptr, 80, -1, &rx));
    REQUIRE_OK(kvx_kv_sender_create(pkv, 80, &tx));
    int32_t st = -1;
    // Not computed yet: the decode reserves nothing (its caller allocates
    // once the state is WAITING_FOR_INPUT).
    EXPECT_RC(kvx_kv_wait(rx, KVX_KVPOLL_WAITING_FOR_INPUT, 300, &st), KVX_ERR_TIMEOUT);
    CHECK(st == KVX_KVPOLL_BOOTSTRAPPING);
    REQUIRE_OK(kvx_kv_sender_mark_prefill_complete(tx));
    REQUIRE_OK(kvx_kv_sender_mark_prefill_complete(tx));  // a second call does nothing
    REQUIRE_OK(kvx_kv_wait(rx, KVX_KVPOLL_WAITING_FOR_INPUT, 20000, &st));
    CHECK(st == KVX_KVPOLL_WAITING_FOR_INPUT);
    const int32_t dst[1] = {7};
    REQUIRE_OK(kvx_kv_receiver_send_metadata(rx, dst, 1, 2, nullptr, 0, 0));
    REQUIRE_OK(kvx_kv_wait(tx, KVX_KVPOLL_WAITING_FOR_INPUT, 20000, &st));
    uint32_t npages = 0;
    REQUIRE_OK(kvx_kv_sender_init_tokens(tx, 4, 1, &npages));
    CHECK(npages == 1);
    const int32_t src[1] = {4};
    REQUIRE_OK(kvx_kv_sender_send(tx, src, 1, 1));
    REQUIRE_OK(kvx_kv_wait(rx, KVX_KVPOLL_SUCCESS, 20000, &st));
    CHECK(st == KVX_KVPOLL_SUCCESS);
    REQUIRE_OK(kvx_kv_wait(tx, KVX_KVPOLL_SUCCESS, 20000, &st));
    CHECK(st == KVX_KVPOLL_SUCCESS);
    int bad = 0;
    for (uint32_t b = 0; b < kBuffers; b++) bad += dec->read(b, 7 * kItem, kItem) != pre->read(b, 4 * kItem, kItem);
    CHECK(bad == 0);
    REQUIRE_OK(kvx_kv_close(tx));
    EXPECT_RC(kvx_kv_sender_mark_prefill_complete(tx), KVX_ERR_BAD_HANDLE);
    REQUIRE_OK(kvx_kv_close(rx));
    REQUIRE_OK(kvx_kv_destroy(pkv));
    REQUIRE_OK(kvx_kv_destroy(dkv));
    REQUIRE_OK(kvx_engine_destroy(prefill));
    REQUIRE_OK(kvx_engine_destroy(decode));
    REQUIRE_OK(kvx_bootstrap_stop(bs));
    std::printf("prefill_complete: the decode reserved nothing until the prefill marked room 80 computed; %u buffers verified\n", kBuffers);
}

int main(int argc, char **argv) {
    if (argc == 5 && std::strcmp(argv[1], "--prefill-child") == 0) return prefill_child(argv[2], argv[3], argv[4]);
    if (argc > 1) g_transport = argv[1];
    std::printf("kvxfer %s (header %s), transport %s\n", kvx_version(), KVX_VERSION_STRING, g_transport);
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
    named_segments(prefill, decode, s8, static_cast<uint8_t *>(dst));
    old_config_size();
    kv_rooms(prefill, decode, addr);
    owned_buffers();
    prefill_complete_rooms();
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

    two_processes("/proc/self/exe");

    if (failures) {
        std::fprintf(stderr, "kvx_consumer: %d check(s) failed\n", failures);
        return 1;
    }
    std::printf("kvx_consumer: all checks passed\n");
    return 0;
}
