package bootstrap

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestClientRejectsUnusableRankIP: a decode resolving a rank from a server
// that stored an unreachable host (another implementation) gets an error
// naming rank_ip instead of an endpoint to dial.
func TestClientRejectsUnusableRankIP(t *testing.T) {
	for _, tc := range []struct{ ip, want string }{
		{"0.0.0.0", ""}, {"999.1.1.1", ""}, {"::", ""},
		{"10.1.2.3", "10.1.2.3"}, {"[fd00::1]", "fd00::1"},
	} {
		hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"rank_ip":"` + tc.ip + `","rank_port":7000}`))
		}))
		c, err := NewClient(strings.TrimPrefix(hs.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		ri, err := c.RankInfo(ctx, 0, 0, 0, 0)
		cancel()
		hs.Close()
		if tc.want == "" {
			if err == nil || !strings.Contains(err.Error(), "rank_ip") {
				t.Errorf("rank_ip %q: got %+v %v, want an error naming rank_ip", tc.ip, ri, err)
			}
		} else if err != nil || ri.RankIP != tc.want {
			t.Errorf("rank_ip %q: got %+v %v, want %q", tc.ip, ri, err, tc.want)
		}
	}
}
