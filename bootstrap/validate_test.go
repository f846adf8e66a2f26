package bootstrap

import (
	"strings"
	"testing"
)

// TestRegisterIntWording: a registration integer that is not one says what
// is wrong with the value as written and what is accepted (a port: an
// integer port 1–65535), not "not in int64 range"; SGLang's integers still
// parse.
func TestRegisterIntWording(t *testing.T) {
	const good = `"attn_tp_size":2,"attn_tp_rank":1,"attn_cp_size":1,"attn_cp_rank":0,"attn_dp_size":1,"attn_dp_rank":0,"pp_size":1,"pp_rank":0,"system_dp_size":1,"system_dp_rank":0,"page_size":16,"kv_cache_dtype":"auto","rank_ip":"127.0.0.1"`
	for _, c := range []struct {
		extra string
		want  string // "" = accepted
	}{
		{`"rank_port":6001`, ""},
		{`"rank_port":1e3`, `rank_port: 1e3 is not written as a whole JSON integer (no fraction or exponent); want an integer port 1–65535`},
		{`"rank_port":6001.0`, `rank_port: 6001.0 is not written as a whole JSON integer`},
		{`"rank_port":99999999999999999999`, `rank_port: 99999999999999999999 is out of range; want an integer port 1–65535`},
		{`"rank_port":70000`, `rank_port: 70000 is out of range; want an integer port 1–65535`},
		{`"rank_port":"6001"`, `rank_port: is a string ("6001"); want an integer port 1–65535, as a JSON number without quotes`},
		{`"rank_port":null`, `rank_port: is null; want an integer port 1–65535`},
		{`"rank_port":true`, `rank_port: is true; want an integer port 1–65535`},
		{`"rank_port":6001,"prefill_http_port":8e3`, `prefill_http_port: 8e3 is not written as a whole JSON integer (no fraction or exponent); want an integer port 1–65535`},
		{`"rank_port":6001,"epoch":1E2`, `epoch: 1E2 is not written as a whole JSON integer (no fraction or exponent); want an integer in [0, 2^63-1]`},
		{`"rank_port":6001,"page_size":1.5`, `page_size: 1.5 is not written as a whole JSON integer (no fraction or exponent); want an integer in [1, 1073741824]`},
	} {
		_, err := ParseRegisterRequest([]byte("{" + good + "," + c.extra + "}"))
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s: %v, want accepted", c.extra, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%s: error %v\nwant one containing %q", c.extra, err, c.want)
		}
	}
}
