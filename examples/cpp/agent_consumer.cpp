// kvx_agent_consumer — the NIXL-shaped agent through the C ABI, in vLLM's
// NixlConnector order: a prefill and a decode agent (argv[1]: the
// transport) register their KV (kvx_alloc_host memory, NUM_REGIONS regions
// of NUM_BLOCKS blocks), the decode loads the prefill's metadata, prepares
// the local and the remote block lists, READs scattered blocks with a
// notification and waits for DONE; the prefill gets the notification and
// the bytes are verified. Then the refusals the header promises (bad index,
// unknown agent, a removed agent) return their codes with a message.
#include <kvxfer.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

namespace {

int failures = 0;

#define REQUIRE_OK(call)                                                                  \
    do {                                                                                  \
        int rc_ = (call);                                                                 \
        if (rc_ != KVX_OK) {                                                              \
            std::fprintf(stderr, "%s:%d: %s = %d (%s): %s\n", __FILE__, __LINE__, #call,  \
                         rc_, kvx_strerror(rc_), kvx_last_error());                       \
            std::exit(1);                                                                 \
        }                                                                                 \
    } while (0)

#define EXPECT_RC(call, want)                                                             \
    do {                                                                                  \
        int rc_ = (call);                                                                 \
        if (rc_ != (want) || ((want) != KVX_OK && kvx_last_error()[0] == '\0')) {         \
            std::fprintf(stderr, "%s:%d: %s = %d (%s), want %d; last error: %s\n",        \
                         __FILE__, __LINE__, #call, rc_, kvx_strerror(rc_), (want),       \
                         kvx_last_error());                                               \
            ++failures;                                                                   \
        }                                                                                 \
    } while (0)

#define CHECK(cond)                                                                       \
    do {                                                                                  \
        if (!(cond)) {                                                                    \
            std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            ++failures;                                                                   \
        }                                                                                 \
    } while (0)

constexpr int kRegions = 4;
constexpr int kBlocks = 8;
constexpr uint64_t kBlockLen = 4096;

struct Side {
    kvx_agent_t agent = 0;
    kvx_hostbuf_t bufs[kRegions] = {};
    uint8_t *base[kRegions] = {};
    kvx_agent_reg_t reg = 0;
    std::vector<kvx_agent_desc> blocks;  // vLLM's blocks_data: region-major
};

void make_side(Side &s, const char *name, const char *transport, bool fill) {
    kvx_agent_config cfg{};
    cfg.struct_size = sizeof cfg;
    cfg.name = name;
    cfg.transport = transport;
    REQUIRE_OK(kvx_agent_create(&cfg, &s.agent));
    std::vector<kvx_agent_desc> regs;
    for (int r = 0; r < kRegions; r++) {
        void *p = nullptr;
        uint64_t len = 0;
        REQUIRE_OK(kvx_alloc_host(name, kBlocks * kBlockLen, &s.bufs[r], &p, &len));
        s.base[r] = static_cast<uint8_t *>(p);
        if (fill)
            for (uint64_t i = 0; i < kBlocks * kBlockLen; i++)
                s.base[r][i] = static_cast<uint8_t>(r * 31 + i / kBlockLen * 7 + i % 5 + 1);
        regs.push_back(kvx_agent_desc{reinterpret_cast<uint64_t>(p), kBlocks * kBlockLen, 0, 0});
        for (int b = 0; b < kBlocks; b++)
            s.blocks.push_back(kvx_agent_desc{reinterpret_cast<uint64_t>(p) + b * kBlockLen, kBlockLen, 0, 0});
    }
    REQUIRE_OK(kvx_agent_register(s.agent, KVX_AGENT_MEM_DRAM, regs.data(), regs.size(), &s.reg));
}

std::vector<int64_t> desc_ids(const std::vector<int> &blocks) {
    std::vector<int64_t> out;
    for (int r = 0; r < kRegions; r++)
        for (int b : blocks) out.push_back(r * kBlocks + b);
    return out;
}

}  // namespace

int main(int argc, char **argv) {
    const char *transport = argc > 1 ? argv[1] : "tcp";
    Side p, d;
    make_side(p, "prefill", transport, true);
    make_side(d, "decode", transport, false);

    // Handshake: the prefill's metadata bytes travel out of band.
    size_t need = 0;
    EXPECT_RC(kvx_agent_metadata(p.agent, nullptr, 0, &need), KVX_ERR_BUFFER_TOO_SMALL);
    std::vector<uint8_t> md(need);
    REQUIRE_OK(kvx_agent_metadata(p.agent, md.data(), md.size(), &need));
    char name[300];
    REQUIRE_OK(kvx_agent_add_remote(d.agent, md.data(), md.size(), name, sizeof name, &need));
    CHECK(std::string(name) == "prefill");

    kvx_dlist_t local = 0, remote = 0;
    REQUIRE_OK(kvx_agent_prep_dlist(d.agent, KVX_AGENT_LOCAL, KVX_AGENT_MEM_DRAM, d.blocks.data(), d.blocks.size(), &local));
    REQUIRE_OK(kvx_agent_prep_dlist(d.agent, name, KVX_AGENT_MEM_DRAM, p.blocks.data(), p.blocks.size(), &remote));

    std::vector<int> lb = {1, 2, 6}, rb = {0, 5, 7};
    auto li = desc_ids(lb), ri = desc_ids(rb);
    const char notif[] = "req-7:1";
    kvx_xfer_t x = 0;
    REQUIRE_OK(kvx_agent_make_xfer(d.agent, KVX_XFER_READ, local, li.data(), remote, ri.data(), li.size(), notif, std::strlen(notif), &x));
    int32_t st = -1;
    EXPECT_RC(kvx_agent_xfer_state(d.agent, x, &st), KVX_ERR_INVALID_ARGUMENT);
    CHECK(st == KVX_XFER_NOT_POSTED);
    REQUIRE_OK(kvx_agent_post(d.agent, x, nullptr, 0, &st));
    CHECK(st == KVX_XFER_PROC);
    REQUIRE_OK(kvx_agent_xfer_wait(d.agent, x, 30000, &st));
    CHECK(st == KVX_XFER_DONE);

    // The prefill's notification: one record {name_len, name, msg_len, msg}.
    std::vector<uint8_t> nb;
    for (int i = 0; i < 3000 && nb.empty(); i++) {
        EXPECT_RC(kvx_agent_get_notifs(p.agent, nullptr, 0, &need), need ? KVX_ERR_BUFFER_TOO_SMALL : KVX_OK);
        if (need) {
            nb.resize(need);
            REQUIRE_OK(kvx_agent_get_notifs(p.agent, nb.data(), nb.size(), &need));
        } else {
            struct timespec ts{0, 10 * 1000 * 1000};
            nanosleep(&ts, nullptr);
        }
    }
    const std::string want_rec = std::string("\x06\0\0\0decode\x07\0\0\0req-7:1", 4 + 6 + 4 + 7);
    CHECK(std::string(nb.begin(), nb.end()) == want_rec);
    for (int r = 0; r < kRegions; r++)
        for (size_t i = 0; i < lb.size(); i++)
            CHECK(std::memcmp(d.base[r] + lb[i] * kBlockLen, p.base[r] + rb[i] * kBlockLen, kBlockLen) == 0);
    CHECK(d.base[0][0] == 0);  // block 0 was not a destination

    kvx_xfer_telemetry tel{};
    REQUIRE_OK(kvx_agent_xfer_telemetry(d.agent, x, &tel));
    CHECK(tel.total_bytes == kRegions * lb.size() * kBlockLen);
    CHECK(tel.desc_count == kRegions * lb.size());
    CHECK(tel.start_us > 0 && tel.xfer_us >= 0);

    // Refusals.
    int64_t bad = kRegions * kBlocks;
    kvx_xfer_t y = 0;
    EXPECT_RC(kvx_agent_make_xfer(d.agent, KVX_XFER_READ, local, &bad, remote, ri.data(), 1, nullptr, 0, &y), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_agent_make_xfer(d.agent, 7, local, li.data(), remote, ri.data(), 1, nullptr, 0, &y), KVX_ERR_INVALID_ARGUMENT);
    kvx_dlist_t nobody = 0;
    EXPECT_RC(kvx_agent_prep_dlist(d.agent, "nobody", KVX_AGENT_MEM_DRAM, p.blocks.data(), 1, &nobody), KVX_ERR_NOT_FOUND);
    EXPECT_RC(kvx_agent_send_notif(d.agent, "nobody", "x", 1), KVX_ERR_NOT_FOUND);
    kvx_agent_desc outside{reinterpret_cast<uint64_t>(p.base[0]) + kBlocks * kBlockLen * 64, kBlockLen, 0, 0};
    EXPECT_RC(kvx_agent_prep_dlist(d.agent, name, KVX_AGENT_MEM_DRAM, &outside, 1, &nobody), KVX_ERR_OUT_OF_BOUNDS);
    EXPECT_RC(kvx_agent_prep_dlist(d.agent, nullptr, KVX_AGENT_MEM_DRAM, &outside, 1, &nobody), KVX_ERR_NOT_REGISTERED);
    EXPECT_RC(kvx_agent_add_remote(d.agent, "junk", 4, name, sizeof name, &need), KVX_ERR_INVALID_ARGUMENT);
    EXPECT_RC(kvx_agent_xfer_release(d.agent, 12345), KVX_ERR_BAD_HANDLE);

    // A standalone notification, then the prefill removes the decode: its
    // later notifications are refused.
    REQUIRE_OK(kvx_agent_send_notif(d.agent, "prefill", "req-8:1", 7));
    REQUIRE_OK(kvx_agent_remove_remote(p.agent, "decode"));
    EXPECT_RC(kvx_agent_send_notif(d.agent, "prefill", "late", 4), KVX_ERR_PEER_LOST);

    // vLLM's shutdown order.
    REQUIRE_OK(kvx_agent_xfer_release(d.agent, x));
    REQUIRE_OK(kvx_agent_release_dlist(d.agent, local));
    REQUIRE_OK(kvx_agent_release_dlist(d.agent, remote));
    REQUIRE_OK(kvx_agent_remove_remote(d.agent, "prefill"));
    EXPECT_RC(kvx_agent_post(d.agent, x, nullptr, 0, &st), KVX_ERR_BAD_HANDLE);
    for (Side *s : {&p, &d}) {
        REQUIRE_OK(kvx_agent_deregister(s->agent, s->reg));
        REQUIRE_OK(kvx_agent_destroy(s->agent));
        EXPECT_RC(kvx_agent_destroy(s->agent), KVX_ERR_BAD_HANDLE);
        for (auto b : s->bufs) REQUIRE_OK(kvx_free_host(b));
    }
    if (failures) {
        std::fprintf(stderr, "kvx_agent_consumer %s: %d failures\n", transport, failures);
        return 1;
    }
    std::printf("kvx_agent_consumer %s: ok\n", transport);
    return 0;
}
