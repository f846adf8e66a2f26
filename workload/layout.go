package workload

import (
	"errors"
	"fmt"
)

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

// Layout is one rank's KV geometry for a model, as a serving engine derives
// it before it allocates its KV buffers (SGLang's KVArgs, spec §6.1–6.2):
// MHA/GQA keeps 2×layers buffers [K_0…K_{L-1}, V_0…V_{L-1}], MLA keeps one
// latent buffer per layer. Each buffer is token-major: token slot t of page p
// starts at p×ItemLen + (t%PageSize)×TokenBytes, and the KV heads of a token
// are contiguous. NewKVBuffers allocates the buffers; the engine sees only
// the resulting kvargs.KVArgs.
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
		return nil, fmt.Errorf("workload: layout: model %q has a non-positive size (layers %d, kv heads %d, head_dim %d, dtype bytes %d)", m.Name, m.NumLayers, m.NumKVHeads, m.HeadDim, m.DtypeBytes)
	case o.PageSize < 0:
		return nil, fmt.Errorf("workload: layout: page size must be > 0 tokens, got %d", o.PageSize)
	case o.TPSize < 0 || o.TPRank < 0 || o.TPRank >= o.TPSize:
		return nil, fmt.Errorf("workload: layout: tp rank %d not in [0, tp size %d)", o.TPRank, o.TPSize)
	case o.PPSize < 0 || o.PPRank < 0 || o.PPRank >= o.PPSize:
		return nil, fmt.Errorf("workload: layout: pp rank %d not in [0, pp size %d)", o.PPRank, o.PPSize)
	case o.PPSize > m.NumLayers:
		return nil, fmt.Errorf("workload: layout: pp size %d exceeds the model's %d layers", o.PPSize, m.NumLayers)
	case o.NumPages <= 0:
		return nil, fmt.Errorf("workload: layout: pool must hold > 0 pages, got %d (raise the pool size)", o.NumPages)
	}
	l := &Layout{Model: m, PageSize: o.PageSize, TPSize: o.TPSize, TPRank: o.TPRank, PPSize: o.PPSize, PPRank: o.PPRank, NumPages: o.NumPages}
	l.HeadsPerRank = 1
	if !m.MLA {
		if m.NumKVHeads%o.TPSize != 0 && o.TPSize%m.NumKVHeads != 0 {
			return nil, fmt.Errorf("workload: layout: %d KV heads cannot be split over tp size %d (one must divide the other)", m.NumKVHeads, o.TPSize)
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

// PoolBytes is the size of all KV buffers together in bytes.
func (l *Layout) PoolBytes() uint64 { return uint64(l.NumBuffers()) * l.BufferLen() }

// BufferOffset returns the byte offset of buffer i when all buffers are
// allocated back to back in one block (BufferOptions.Contiguous).
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
		return 0, errors.New("workload: layout: zero bytes per page")
	}
	return int(poolBytes / per), nil
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
