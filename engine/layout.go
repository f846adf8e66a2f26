package engine

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// ModelConfig is the part of a model's configuration that shapes its KV cache.
// Values for the built-in models are the public Hugging Face config.json
// values; LoadHFConfig reads the same keys from any config.json.
type ModelConfig struct {
	// Name is the model's short name ("llama-3.1-8b") or the config path.
	Name string `json:"name"`
	// NumLayers is the number of attention layers (num_hidden_layers).
	NumLayers int `json:"num_layers"`
	// NumKVHeads is the total number of KV heads (num_key_value_heads); 1 for MLA.
	NumKVHeads int `json:"num_kv_heads"`
	// HeadDim is the elements per head (head_dim, or hidden_size /
	// num_attention_heads); for MLA it is KVLoraRank + QKRopeHeadDim.
	HeadDim int `json:"head_dim"`
	// DtypeBytes is the bytes per KV element (2 for bf16/fp16, 1 for fp8).
	DtypeBytes int `json:"dtype_bytes"`
	// MLA is true for multi-head latent attention (DeepSeek-V2/V3): one latent
	// buffer per layer, replicated on every TP rank (spec §6.2).
	MLA bool `json:"mla"`
	// KVLoraRank and QKRopeHeadDim are the MLA latent sizes (elements).
	KVLoraRank    int `json:"kv_lora_rank,omitempty"`
	QKRopeHeadDim int `json:"qk_rope_head_dim,omitempty"`
}

// builtinModels are well-known public configs (Hugging Face config.json of
// each model; bf16 KV cache).
var builtinModels = map[string]ModelConfig{
	"llama-3.1-8b":  {Name: "llama-3.1-8b", NumLayers: 32, NumKVHeads: 8, HeadDim: 128, DtypeBytes: 2},
	"llama-3.1-70b": {Name: "llama-3.1-70b", NumLayers: 80, NumKVHeads: 8, HeadDim: 128, DtypeBytes: 2},
	"qwen2.5-7b":    {Name: "qwen2.5-7b", NumLayers: 28, NumKVHeads: 4, HeadDim: 128, DtypeBytes: 2},
	"qwen3-32b":     {Name: "qwen3-32b", NumLayers: 64, NumKVHeads: 8, HeadDim: 128, DtypeBytes: 2},
	"deepseek-v3": {Name: "deepseek-v3", NumLayers: 61, NumKVHeads: 1, HeadDim: 576, DtypeBytes: 2,
		MLA: true, KVLoraRank: 512, QKRopeHeadDim: 64},
}

// BuiltinModels lists the built-in model names, sorted.
func BuiltinModels() []string {
	names := make([]string, 0, len(builtinModels))
	for n := range builtinModels {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// LookupModel returns a built-in model by name (case-insensitive; "_" and
// "-" are equivalent) or, when nameOrPath names an existing file (or a
// directory holding config.json), loads it as a Hugging Face config.json.
// A name with a path separator or a .json suffix that does not exist is
// reported as a missing file; other errors list the built-in names.
func LookupModel(nameOrPath string) (ModelConfig, error) {
	key := strings.ReplaceAll(strings.ToLower(strings.TrimSpace(nameOrPath)), "_", "-")
	if m, ok := builtinModels[key]; ok {
		return m, nil
	}
	st, err := os.Stat(nameOrPath)
	if err == nil && st.IsDir() {
		// A model directory: its config.json.
		dir := nameOrPath
		nameOrPath = filepath.Join(dir, "config.json")
		if st, err = os.Stat(nameOrPath); err != nil {
			return ModelConfig{}, fmt.Errorf("engine: model %q is a directory without a config.json: give the path of a Hugging Face config.json or a built-in name (%s)", dir, strings.Join(BuiltinModels(), ", "))
		}
	}
	if err == nil && !st.IsDir() {
		return LoadHFConfig(nameOrPath)
	}
	if strings.ContainsRune(nameOrPath, '/') || strings.ContainsRune(nameOrPath, filepath.Separator) || strings.HasSuffix(strings.ToLower(nameOrPath), ".json") {
		// Meant as a path, not a name.
		return ModelConfig{}, fmt.Errorf("engine: model config %s: %w (give an existing Hugging Face config.json, or a built-in name: %s)", nameOrPath, err, strings.Join(BuiltinModels(), ", "))
	}
	return ModelConfig{}, fmt.Errorf("engine: unknown model %q: give a built-in name (%s) or the path of a Hugging Face config.json", nameOrPath, strings.Join(BuiltinModels(), ", "))
}

// hfConfig is the subset of config.json keys we read.
type hfConfig struct {
	NumHiddenLayers   int       `json:"num_hidden_layers"`
	NumAttentionHeads int       `json:"num_attention_heads"`
	NumKeyValueHeads  *int      `json:"num_key_value_heads"`
	HiddenSize        int       `json:"hidden_size"`
	HeadDim           *int      `json:"head_dim"`
	TorchDtype        string    `json:"torch_dtype"`
	KVLoraRank        *int      `json:"kv_lora_rank"`
	QKRopeHeadDim     *int      `json:"qk_rope_head_dim"`
	TextConfig        *hfConfig `json:"text_config"`
}

// LoadHFConfig reads a Hugging Face config.json: num_hidden_layers,
// num_key_value_heads (default num_attention_heads), head_dim (default
// hidden_size/num_attention_heads), torch_dtype (bf16/fp16 = 2 bytes, fp32 = 4,
// fp8 = 1; default 2), and kv_lora_rank + qk_rope_head_dim for MLA models. A
// nested "text_config" (multimodal models) is used when the top level has no
// layers. Errors name the file and the missing or invalid key.
func LoadHFConfig(path string) (ModelConfig, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return ModelConfig{}, fmt.Errorf("engine: read model config: %w", err)
	}
	var c hfConfig
	if err := json.Unmarshal(raw, &c); err != nil {
		return ModelConfig{}, fmt.Errorf("engine: model config %s: not valid JSON: %w", path, err)
	}
	if c.NumHiddenLayers == 0 && c.TextConfig != nil {
		c = *c.TextConfig
	}
	return c.toModel(path)
}

func (c hfConfig) toModel(name string) (ModelConfig, error) {
	bad := func(key string, v int) (ModelConfig, error) {
		return ModelConfig{}, fmt.Errorf("engine: model config %s: %q must be a positive integer, got %d", name, key, v)
	}
	m := ModelConfig{Name: name, NumLayers: c.NumHiddenLayers}
	if m.NumLayers <= 0 {
		return bad("num_hidden_layers", m.NumLayers)
	}
	switch strings.ToLower(c.TorchDtype) {
	case "", "bfloat16", "float16", "bf16", "fp16", "half":
		m.DtypeBytes = 2
	case "float32", "fp32", "float":
		m.DtypeBytes = 4
	case "float8_e4m3fn", "float8_e5m2", "fp8", "fp8_e4m3", "fp8_e5m2":
		m.DtypeBytes = 1
	default:
		return ModelConfig{}, fmt.Errorf("engine: model config %s: unsupported torch_dtype %q (want bfloat16, float16, float32 or a float8 type)", name, c.TorchDtype)
	}
	if c.KVLoraRank != nil && *c.KVLoraRank > 0 {
		rope := 0
		if c.QKRopeHeadDim != nil {
			rope = *c.QKRopeHeadDim
		}
		if rope < 0 {
			return bad("qk_rope_head_dim", rope)
		}
		m.MLA, m.KVLoraRank, m.QKRopeHeadDim = true, *c.KVLoraRank, rope
		m.NumKVHeads, m.HeadDim = 1, *c.KVLoraRank+rope
		return m, nil
	}
	if c.NumAttentionHeads <= 0 {
		return bad("num_attention_heads", c.NumAttentionHeads)
	}
	m.NumKVHeads = c.NumAttentionHeads
	if c.NumKeyValueHeads != nil {
		m.NumKVHeads = *c.NumKeyValueHeads
	}
	if m.NumKVHeads <= 0 {
		return bad("num_key_value_heads", m.NumKVHeads)
	}
	if c.HeadDim != nil && *c.HeadDim > 0 {
		m.HeadDim = *c.HeadDim
	} else {
		if c.HiddenSize <= 0 || c.HiddenSize%c.NumAttentionHeads != 0 {
			return ModelConfig{}, fmt.Errorf("engine: model config %s: no head_dim and hidden_size %d is not a positive multiple of num_attention_heads %d", name, c.HiddenSize, c.NumAttentionHeads)
		}
		m.HeadDim = c.HiddenSize / c.NumAttentionHeads
	}
	return m, nil
}

// LayoutOptions place one rank's KV pool.
type LayoutOptions struct {
	// PageSize is the page size in tokens (SGLang --page-size); 0 means
	// DefaultPageSize.
	PageSize int
	// TPSize and TPRank are the attention-TP size and this rank's TP rank.
	TPSize, TPRank int
	// PPSize and PPRank are the pipeline size and rank; the rank holds layers
	// [PPLayerRange).
	PPSize, PPRank int
	// NumPages is the pool capacity in pages (> 0).
	NumPages int
}

// DefaultPageSize is the page size (tokens) used when LayoutOptions.PageSize is 0.
const DefaultPageSize = 16

// Layout is one rank's KV pool geometry, as SGLang's KVArgs describe it
// (spec §6.1–6.2): MHA/GQA keeps 2×layers buffers [K_0…K_{L-1}, V_0…V_{L-1}],
// MLA keeps one latent buffer per layer. Each buffer is token-major: token
// slot t of page p starts at p×ItemLen + (t%PageSize)×TokenBytes, and the KV
// heads of a token are contiguous. All buffers live back to back in one pool
// region: buffer i starts at byte i×BufferLen.
type Layout struct {
	Model ModelConfig
	// PageSize is tokens per page.
	PageSize int
	// TPSize, TPRank, PPSize, PPRank place the rank.
	TPSize, TPRank, PPSize, PPRank int
	// HeadsPerRank is the KV heads this rank holds: max(1, total/TPSize) for
	// MHA/GQA (GQA heads are replicated when TPSize > total), 1 for MLA.
	HeadsPerRank int
	// StartLayer and EndLayer bound this rank's layers [StartLayer, EndLayer).
	StartLayer, EndLayer int
	// NumPages is the pool capacity in pages.
	NumPages int
}

// PPLayerRange returns the layers [start, end) that pipeline rank ppRank of
// ppSize holds: an even split with the remainder given to the first ranks.
func PPLayerRange(numLayers, ppSize, ppRank int) (start, end int) {
	base, rem := numLayers/ppSize, numLayers%ppSize
	start = ppRank*base + min(ppRank, rem)
	end = start + base
	if ppRank < rem {
		end++
	}
	return start, end
}

// NewLayout validates o against m. Errors name the bad option.
func NewLayout(m ModelConfig, o LayoutOptions) (*Layout, error) {
	if o.PageSize == 0 {
		o.PageSize = DefaultPageSize
	}
	if o.TPSize == 0 {
		o.TPSize = 1
	}
	if o.PPSize == 0 {
		o.PPSize = 1
	}
	switch {
	case m.NumLayers <= 0 || m.NumKVHeads <= 0 || m.HeadDim <= 0 || m.DtypeBytes <= 0:
		return nil, fmt.Errorf("engine: layout: model %q has a non-positive size (layers %d, kv heads %d, head_dim %d, dtype bytes %d)", m.Name, m.NumLayers, m.NumKVHeads, m.HeadDim, m.DtypeBytes)
	case o.PageSize < 0:
		return nil, fmt.Errorf("engine: layout: page size must be > 0 tokens, got %d", o.PageSize)
	case o.TPSize < 0 || o.TPRank < 0 || o.TPRank >= o.TPSize:
		return nil, fmt.Errorf("engine: layout: tp rank %d not in [0, tp size %d)", o.TPRank, o.TPSize)
	case o.PPSize < 0 || o.PPRank < 0 || o.PPRank >= o.PPSize:
		return nil, fmt.Errorf("engine: layout: pp rank %d not in [0, pp size %d)", o.PPRank, o.PPSize)
	case o.PPSize > m.NumLayers:
		return nil, fmt.Errorf("engine: layout: pp size %d exceeds the model's %d layers", o.PPSize, m.NumLayers)
	case o.NumPages <= 0:
		return nil, fmt.Errorf("engine: layout: pool must hold > 0 pages, got %d (raise the pool size)", o.NumPages)
	}
	l := &Layout{Model: m, PageSize: o.PageSize, TPSize: o.TPSize, TPRank: o.TPRank, PPSize: o.PPSize, PPRank: o.PPRank, NumPages: o.NumPages}
	l.HeadsPerRank = 1
	if !m.MLA {
		if m.NumKVHeads%o.TPSize != 0 && o.TPSize%m.NumKVHeads != 0 {
			return nil, fmt.Errorf("engine: layout: %d KV heads cannot be split over tp size %d (one must divide the other)", m.NumKVHeads, o.TPSize)
		}
		l.HeadsPerRank = max(1, m.NumKVHeads/o.TPSize)
	}
	l.StartLayer, l.EndLayer = PPLayerRange(m.NumLayers, o.PPSize, o.PPRank)
	return l, nil
}

// HeadBytes is the bytes of one KV head of one token (HeadDim × DtypeBytes).
func (l *Layout) HeadBytes() uint64 { return uint64(l.Model.HeadDim * l.Model.DtypeBytes) }

// TokenBytes is the bytes of one token slot in one layer buffer.
func (l *Layout) TokenBytes() uint64 { return uint64(l.HeadsPerRank) * l.HeadBytes() }

// ItemLen is SGLang's kv_item_len: bytes per page per layer buffer
// (page_size × heads per rank × head_dim × dtype bytes; spec §6.2).
func (l *Layout) ItemLen() uint64 { return uint64(l.PageSize) * l.TokenBytes() }

// Layers is the number of layers this rank holds.
func (l *Layout) Layers() int { return l.EndLayer - l.StartLayer }

// NumBuffers is the number of layer buffers: 2×Layers for MHA/GQA (K then V),
// Layers for MLA.
func (l *Layout) NumBuffers() int {
	if l.Model.MLA {
		return l.Layers()
	}
	return 2 * l.Layers()
}

// BufferLen is one layer buffer's size in bytes (NumPages × ItemLen).
func (l *Layout) BufferLen() uint64 { return uint64(l.NumPages) * l.ItemLen() }

// PoolBytes is the whole pool's size in bytes.
func (l *Layout) PoolBytes() uint64 { return uint64(l.NumBuffers()) * l.BufferLen() }

// BufferOffset returns the byte offset inside the pool of buffer i.
func (l *Layout) BufferOffset(i int) uint64 { return uint64(i) * l.BufferLen() }

// BufferIndex returns the local buffer index of (global layer, kv) where kv
// is 0 for K (or the MLA latent) and 1 for V; ok is false when this rank does
// not hold the layer or kv is 1 on an MLA pool.
func (l *Layout) BufferIndex(layer, kv int) (int, bool) {
	if layer < l.StartLayer || layer >= l.EndLayer || kv < 0 || kv > 1 || (l.Model.MLA && kv == 1) {
		return 0, false
	}
	return kv*l.Layers() + layer - l.StartLayer, true
}

// BufferLayer is the inverse of BufferIndex: the global layer and kv (0 = K
// or latent, 1 = V) of local buffer i.
func (l *Layout) BufferLayer(i int) (layer, kv int) {
	n := l.Layers()
	return l.StartLayer + i%n, i / n
}

// KVs is 2 for MHA/GQA (K and V) and 1 for MLA.
func (l *Layout) KVs() int {
	if l.Model.MLA {
		return 1
	}
	return 2
}

// PagesForTokens is ceil(tokens / PageSize) (SGLang kv_to_page_num).
func (l *Layout) PagesForTokens(tokens int) int { return (tokens + l.PageSize - 1) / l.PageSize }

// PagesForBytes returns how many pages a pool of poolBytes holds for this
// geometry (at least 0).
func PagesForBytes(m ModelConfig, o LayoutOptions, poolBytes uint64) (int, error) {
	o.NumPages = 1
	l, err := NewLayout(m, o)
	if err != nil {
		return 0, err
	}
	per := uint64(l.NumBuffers()) * l.ItemLen()
	if per == 0 {
		return 0, errors.New("engine: layout: zero bytes per page")
	}
	return int(poolBytes / per), nil
}

// HeadSlice is how one producer's rows map into one consumer's rows for one
// (prefill TP, decode TP) pairing (spec §6.4): per token slot, Length bytes
// from SrcOffset inside the producer's token row to DstOffset inside the
// consumer's token row. Equal TP and MLA give the whole row.
type HeadSlice struct {
	SrcOffset, DstOffset, Length uint64
	// SrcHeadStart, DstHeadStart and Heads are the same in heads.
	SrcHeadStart, DstHeadStart, Heads int
}

// SliceHeads computes the head slice from a producer (src) rank to a consumer
// (dst) rank by SGLang's send_kvcache_slice rules (spec §6.4). Both layouts
// must describe the same model. Errors name the mismatch.
func SliceHeads(src, dst *Layout) (HeadSlice, error) {
	if src.Model.MLA != dst.Model.MLA || src.HeadBytes() != dst.HeadBytes() || src.PageSize != dst.PageSize {
		return HeadSlice{}, fmt.Errorf("engine: prefill and decode layouts differ (mla %v/%v, head bytes %d/%d, page size %d/%d)", src.Model.MLA, dst.Model.MLA, src.HeadBytes(), dst.HeadBytes(), src.PageSize, dst.PageSize)
	}
	hb := src.HeadBytes()
	if src.Model.MLA || src.TPSize == dst.TPSize {
		if src.TokenBytes() != dst.TokenBytes() {
			return HeadSlice{}, fmt.Errorf("engine: token row sizes differ: prefill %d bytes, decode %d bytes", src.TokenBytes(), dst.TokenBytes())
		}
		return HeadSlice{Length: src.TokenBytes(), Heads: src.HeadsPerRank}, nil
	}
	total := src.Model.NumKVHeads
	P, D := src.TPSize, dst.TPSize
	srcHeads, dstHeads := max(1, total/P), max(1, total/D)
	var s HeadSlice
	if P > D {
		unique := (src.TPRank % P) / max(1, P/total)
		s = HeadSlice{SrcHeadStart: 0, Heads: srcHeads, DstHeadStart: (unique * srcHeads) % dstHeads}
	} else {
		uniqueDst := (dst.TPRank % D) / max(1, D/total)
		s = HeadSlice{SrcHeadStart: (uniqueDst * dstHeads) % srcHeads, Heads: dstHeads, DstHeadStart: 0}
	}
	s.SrcOffset, s.DstOffset, s.Length = uint64(s.SrcHeadStart)*hb, uint64(s.DstHeadStart)*hb, uint64(s.Heads)*hb
	if s.DstOffset+s.Length > dst.TokenBytes() || s.SrcOffset+s.Length > src.TokenBytes() {
		return HeadSlice{}, fmt.Errorf("engine: head slice of %d heads from head %d to head %d exceeds a token row (prefill tp %d, decode tp %d, %d KV heads)", s.Heads, s.SrcHeadStart, s.DstHeadStart, P, D, total)
	}
	return s, nil
}

// GlobalHead returns the model-wide KV head index that local head h of this
// rank holds (GQA replicas map to the same head).
func (l *Layout) GlobalHead(h int) int {
	if l.Model.MLA {
		return 0
	}
	total := l.Model.NumKVHeads
	if l.TPSize <= total {
		return l.TPRank*l.HeadsPerRank + h
	}
	return (l.TPRank / (l.TPSize / total)) % total
}

// KVCacheDtypes lists the --kv-cache-dtype strings kvxfer accepts, in the
// order help text shows them: SGLang's choices for --kv-cache-dtype ("auto" =
// the model's torch_dtype; the fp8 formats store one byte per element) plus
// the explicit 16- and 32-bit names. Prefill and decode compare the string
// itself (spec/sglang-bootstrap.md §4.2), so "bf16" and "bfloat16" do not match each other.
var KVCacheDtypes = []string{"auto", "fp8_e4m3", "fp8_e5m2", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32"}

// KVCacheDtypeBytes returns the bytes per KV element that --kv-cache-dtype s
// selects: 0 for "auto" (keep the model's torch_dtype size), 1 for the fp8
// formats, 2 for bf16/fp16, 4 for fp32. Any other string (the empty one
// included) is an error listing KVCacheDtypes.
func KVCacheDtypeBytes(s string) (int, error) {
	switch s {
	case "auto":
		return 0, nil
	case "fp8_e4m3", "fp8_e5m2":
		return 1, nil
	case "bf16", "bfloat16", "fp16", "float16":
		return 2, nil
	case "fp32", "float32":
		return 4, nil
	}
	return 0, fmt.Errorf("engine: kv cache dtype %q: want one of %s", s, strings.Join(KVCacheDtypes, ", "))
}
