package workload

import (
	"encoding/json"
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
			return ModelConfig{}, fmt.Errorf("workload: model %q is a directory without a config.json: give the path of a Hugging Face config.json or a built-in name (%s)", dir, strings.Join(BuiltinModels(), ", "))
		}
	}
	if err == nil && !st.IsDir() {
		return LoadHFConfig(nameOrPath)
	}
	if strings.ContainsRune(nameOrPath, '/') || strings.ContainsRune(nameOrPath, filepath.Separator) || strings.HasSuffix(strings.ToLower(nameOrPath), ".json") {
		// Meant as a path, not a name.
		return ModelConfig{}, fmt.Errorf("workload: model config %s: %w (give an existing Hugging Face config.json, or a built-in name: %s)", nameOrPath, err, strings.Join(BuiltinModels(), ", "))
	}
	return ModelConfig{}, fmt.Errorf("workload: unknown model %q: give a built-in name (%s) or the path of a Hugging Face config.json", nameOrPath, strings.Join(BuiltinModels(), ", "))
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
		return ModelConfig{}, fmt.Errorf("workload: read model config: %w", err)
	}
	var c hfConfig
	if err := json.Unmarshal(raw, &c); err != nil {
		return ModelConfig{}, fmt.Errorf("workload: model config %s: not valid JSON: %w", path, err)
	}
	if c.NumHiddenLayers == 0 && c.TextConfig != nil {
		c = *c.TextConfig
	}
	return c.toModel(path)
}

func (c hfConfig) toModel(name string) (ModelConfig, error) {
	bad := func(key string, v int) (ModelConfig, error) {
		return ModelConfig{}, fmt.Errorf("workload: model config %s: %q must be a positive integer, got %d", name, key, v)
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
		return ModelConfig{}, fmt.Errorf("workload: model config %s: unsupported torch_dtype %q (want bfloat16, float16, float32 or a float8 type)", name, c.TorchDtype)
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
			return ModelConfig{}, fmt.Errorf("workload: model config %s: no head_dim and hidden_size %d is not a positive multiple of num_attention_heads %d", name, c.HiddenSize, c.NumAttentionHeads)
		}
		m.HeadDim = c.HiddenSize / c.NumAttentionHeads
	}
	return m, nil
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
	return 0, fmt.Errorf("workload: kv cache dtype %q: want one of %s", s, strings.Join(KVCacheDtypes, ", "))
}
