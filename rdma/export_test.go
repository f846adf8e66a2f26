package rdma

// RequireRDMA skips the calling test without a usable RDMA device, or fails
// it when $KVXFER_REQUIRE_RDMA is set (inside `make test-rdma`); for the
// package's external end-to-end tests.
var RequireRDMA = requireRDMA
