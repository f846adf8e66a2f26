package workload

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// ComputeShape is what a prefill's compute per layer depends on: a model's
// weights per layer and its attention width. Its FLOPs model (LayerFLOPs)
// is the usual dense-transformer estimate, enough to give a layer-wise
// transfer a realistic compute time to overlap with; it is not a profiler.
type ComputeShape struct {
	// Name is the model's name or config path.
	Name string
	// Layers is num_hidden_layers.
	Layers int
	// LayerParams is the weights one token multiplies through in one layer
	// (attention projections + MLP; for a mixture of experts the active
	// experts only), in parameters.
	LayerParams float64
	// AttnDim is the query heads × their head dim (the width of QKᵀ and PV).
	AttnDim int
}

// LayerFLOPs is the FLOPs of one layer of a prefill of tokens tokens:
// 2·T·LayerParams for the matrix products with the weights, plus
// 2·T²·AttnDim for QKᵀ and PV over the causal half of the T×T scores
// (2 FLOPs per multiply-add). Units: FLOPs.
func (c ComputeShape) LayerFLOPs(tokens int) float64 {
	t := float64(tokens)
	return 2*t*c.LayerParams + 2*t*t*float64(c.AttnDim)
}

// LayerTime is one layer's compute time for tokens tokens at tflops
// effective TFLOPS (1e12 FLOP/s) split over tp ranks (each rank computes
// 1/tp of the layer); 0 when tflops <= 0.
func (c ComputeShape) LayerTime(tokens int, tflops float64, tp int) time.Duration {
	if tflops <= 0 {
		return 0
	}
	return time.Duration(c.LayerFLOPs(tokens) / float64(max(tp, 1)) / (tflops * 1e12) * 1e9)
}

// dense is the weights per layer of a GQA transformer with a gated MLP:
// q and o projections (hidden × heads·headDim each), k and v (hidden ×
// kvHeads·headDim each), and gate, up and down (hidden × inter each).
func dense(hidden, heads, kvHeads, headDim, inter int) float64 {
	q := float64(hidden) * float64(heads*headDim)
	kv := 2 * float64(hidden) * float64(kvHeads*headDim)
	return 2*q + kv + 3*float64(hidden)*float64(inter)
}

// builtinCompute are the built-in models' compute shapes, from the same
// public Hugging Face config.json files as their KV shapes (hidden_size,
// num_attention_heads, num_key_value_heads, head_dim, intermediate_size).
// DeepSeek-V3 is a mixture of experts with MLA: its per-layer figure is the
// published 37 B activated parameters over 61 layers, its attention width
// 128 heads × 192 (qk_nope_head_dim 128 + qk_rope_head_dim 64).
var builtinCompute = map[string]ComputeShape{
	"llama-3.1-8b":  {Name: "llama-3.1-8b", Layers: 32, LayerParams: dense(4096, 32, 8, 128, 14336), AttnDim: 32 * 128},
	"llama-3.1-70b": {Name: "llama-3.1-70b", Layers: 80, LayerParams: dense(8192, 64, 8, 128, 28672), AttnDim: 64 * 128},
	"qwen2.5-7b":    {Name: "qwen2.5-7b", Layers: 28, LayerParams: dense(3584, 28, 4, 128, 18944), AttnDim: 28 * 128},
	"qwen3-32b":     {Name: "qwen3-32b", Layers: 64, LayerParams: dense(5120, 64, 8, 128, 25600), AttnDim: 64 * 128},
	"deepseek-v3":   {Name: "deepseek-v3", Layers: 61, LayerParams: 37e9 / 61, AttnDim: 128 * 192},
}

// hfCompute is the subset of config.json the compute shape reads.
type hfCompute struct {
	NumHiddenLayers     int        `json:"num_hidden_layers"`
	HiddenSize          int        `json:"hidden_size"`
	NumAttentionHeads   int        `json:"num_attention_heads"`
	NumKeyValueHeads    *int       `json:"num_key_value_heads"`
	HeadDim             *int       `json:"head_dim"`
	IntermediateSize    int        `json:"intermediate_size"`
	MoEIntermediateSize int        `json:"moe_intermediate_size"`
	NumExpertsPerTok    int        `json:"num_experts_per_tok"`
	NSharedExperts      int        `json:"n_shared_experts"`
	KVLoraRank          int        `json:"kv_lora_rank"`
	QLoraRank           int        `json:"q_lora_rank"`
	QKNopeHeadDim       int        `json:"qk_nope_head_dim"`
	QKRopeHeadDim       int        `json:"qk_rope_head_dim"`
	VHeadDim            int        `json:"v_head_dim"`
	TextConfig          *hfCompute `json:"text_config"`
}

// LookupCompute returns the compute shape of a built-in model (as
// LookupModel names them) or of a Hugging Face config.json (a file, or a
// directory holding one): hidden_size, num_attention_heads,
// num_key_value_heads, head_dim, intermediate_size; for a mixture of
// experts moe_intermediate_size × (num_experts_per_tok + n_shared_experts)
// is the MLP width; for MLA (kv_lora_rank) the latent projections. Errors
// name the file and the missing key.
func LookupCompute(nameOrPath string) (ComputeShape, error) {
	key := strings.ReplaceAll(strings.ToLower(strings.TrimSpace(nameOrPath)), "_", "-")
	if c, ok := builtinCompute[key]; ok {
		return c, nil
	}
	path := nameOrPath
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		path = filepath.Join(path, "config.json")
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return ComputeShape{}, fmt.Errorf("workload: compute shape of %q: not a built-in model (%s) and no readable config.json: %w", nameOrPath, strings.Join(BuiltinModels(), ", "), err)
	}
	var h hfCompute
	if err := json.Unmarshal(raw, &h); err != nil {
		return ComputeShape{}, fmt.Errorf("workload: model config %s: not valid JSON: %w", path, err)
	}
	if h.NumHiddenLayers == 0 && h.TextConfig != nil {
		h = *h.TextConfig
	}
	return h.shape(path)
}

func (h hfCompute) shape(name string) (ComputeShape, error) {
	need := func(key string, v int) error {
		if v <= 0 {
			return fmt.Errorf("workload: model config %s: %q must be a positive integer for the compute model, got %d (or give the per-layer time: --prefill-layer-time)", name, key, v)
		}
		return nil
	}
	for _, k := range []struct {
		key string
		v   int
	}{{"num_hidden_layers", h.NumHiddenLayers}, {"hidden_size", h.HiddenSize}, {"num_attention_heads", h.NumAttentionHeads}} {
		if err := need(k.key, k.v); err != nil {
			return ComputeShape{}, err
		}
	}
	inter := h.IntermediateSize
	if h.MoEIntermediateSize > 0 && h.NumExpertsPerTok > 0 {
		inter = h.MoEIntermediateSize * (h.NumExpertsPerTok + h.NSharedExperts)
	}
	if err := need("intermediate_size", inter); err != nil {
		return ComputeShape{}, err
	}
	hid, heads := float64(h.HiddenSize), h.NumAttentionHeads
	mlp := 3 * hid * float64(inter)
	if h.KVLoraRank > 0 { // MLA: latent KV, per-head nope+rope queries, v heads
		qk := h.QKNopeHeadDim + h.QKRopeHeadDim
		if err := need("qk_nope_head_dim + qk_rope_head_dim", qk); err != nil {
			return ComputeShape{}, err
		}
		v := h.VHeadDim
		if v <= 0 {
			v = h.QKNopeHeadDim
		}
		q := hid * float64(heads*qk)
		if h.QLoraRank > 0 {
			q = hid*float64(h.QLoraRank) + float64(h.QLoraRank)*float64(heads*qk)
		}
		kva := hid * float64(h.KVLoraRank+h.QKRopeHeadDim)
		kvb := float64(h.KVLoraRank) * float64(heads*(h.QKNopeHeadDim+v))
		o := float64(heads*v) * hid
		return ComputeShape{Name: name, Layers: h.NumHiddenLayers, LayerParams: q + kva + kvb + o + mlp, AttnDim: heads * qk}, nil
	}
	kvHeads := heads
	if h.NumKeyValueHeads != nil && *h.NumKeyValueHeads > 0 {
		kvHeads = *h.NumKeyValueHeads
	}
	hd := 0
	if h.HeadDim != nil && *h.HeadDim > 0 {
		hd = *h.HeadDim
	} else if h.HiddenSize%heads == 0 {
		hd = h.HiddenSize / heads
	}
	if err := need("head_dim", hd); err != nil {
		return ComputeShape{}, err
	}
	return ComputeShape{Name: name, Layers: h.NumHiddenLayers, LayerParams: dense(h.HiddenSize, heads, kvHeads, hd, inter), AttnDim: heads * hd}, nil
}
