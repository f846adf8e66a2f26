package server

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"
)

// BenchmarkGetRouteRank measures the per-rank GET /route handler in process
// (no sockets): routing, query parsing, the table lookup and the write.
func BenchmarkGetRouteRank(b *testing.B) {
	s := New(Options{Logger: quiet})
	for tp := range 8 {
		if err := s.Register(reg(8, tp, 9000+tp)); err != nil {
			b.Fatal(err)
		}
	}
	req := httptest.NewRequest(http.MethodGet, "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=3&target_pp_rank=0", nil)
	h := s.Handler()
	b.ReportAllocs()
	for b.Loop() {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code != 200 {
			b.Fatal(w.Code)
		}
	}
}

// BenchmarkQueryDPRanks10k measures one 10,000-room /query_dp_ranks answer in process.
func BenchmarkQueryDPRanks10k(b *testing.B) {
	s := New(Options{Logger: quiet})
	body := []byte(`{"bootstrap_rooms":[`)
	for i := range 10000 {
		if i > 0 {
			body = append(body, ',')
		}
		room := uint64(i) * 104729
		body = append(body, []byte(itoa(room))...)
		if i%2 == 0 {
			s.rooms[room] = roomEntry{dp: 1, at: nowForBench()}
		}
	}
	body = append(body, ']', '}')
	h := s.Handler()
	b.ReportAllocs()
	for b.Loop() {
		req := httptest.NewRequest(http.MethodPost, "/query_dp_ranks", bytesReader(body))
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code != 200 {
			b.Fatal(w.Code, w.Body.String())
		}
	}
}

func itoa(v uint64) string           { return strconv.FormatUint(v, 10) }
func nowForBench() time.Time         { return time.Now() }
func bytesReader(b []byte) io.Reader { return bytes.NewReader(b) }
