// Package kvargs holds a rank's KV arguments as data: SGLang's KVArgs (the
// caller-owned KV, aux and state buffers with their item lengths and the
// rank's placement), their validation into the Geometry a peer needs
// (KVArgs.Geometry, errors wrapping ErrBadKVArgs), and the pure pairing of
// a producer's and a consumer's buffers with their head slices
// (PairBuffers, spec §6.4), which both sides compute from the exchanged
// geometries so that they agree on every byte. It has no manager logic:
// package engine's Manager registers the buffers and moves the bytes; the
// control codec carries Geometry in REGISTER and REGISTER_ACK.
package kvargs

import (
	"errors"
	"fmt"
	"slices"
	"sort"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// Buffer is one caller-owned buffer of a rank's KV arguments: a memory range
// (host or CUDA device memory, never Go heap) and its item length. The
// caller keeps ownership: the KV manager registers the range with each
// transport, never frees it, and deregisters it on Close; the range must stay
// allocated until then.
type Buffer struct {
	transport.Memory
	// ItemLen is the bytes of one item: for a KV buffer one page (SGLang
	// kv_item_len = page_size × heads per rank × head_dim × dtype bytes), for
	// an aux buffer one request row (aux_item_len), for a state buffer one
	// state slot (state_item_len).
	ItemLen uint64
}

// Items is how many whole items the buffer holds (Length / ItemLen; 0 when
// ItemLen is 0).
func (b Buffer) Items() uint64 {
	if b.ItemLen == 0 {
		return 0
	}
	return b.Length / b.ItemLen
}

// KVArgs are one rank's KV arguments, SGLang's KVArgs (base/conn.py; spec
// §6.1–6.2 and spec/kv-backend-apis.md): the caller's buffers and where the
// rank sits. The geometry the engine uses (pages, layers, bytes per token and
// per head) is derived from them; kvxfer knows no model.
type KVArgs struct {
	// KVBuffers are kv_data_ptrs/kv_data_lens/kv_item_lens: MHA/GQA the K
	// buffers of the rank's layers then the V buffers (2 × layers entries),
	// MLA one latent buffer per layer. Each holds Length/ItemLen pages; a
	// page's token slot t starts at t × ItemLen/PageSize and holds KVHeadNum
	// heads back to back. At least one.
	KVBuffers []Buffer
	// AuxBuffers are aux_data_ptrs/lens/item_lens (SGLang's MetadataBuffers):
	// row aux_index of each belongs to one request. Optional; prefill and
	// decode must have the same list (count and item lengths).
	AuxBuffers []Buffer
	// StateBuffers are state_data_ptrs/lens/item_lens (Mamba, SWA, …): slot
	// indices per request, whole slots copied with the last chunk. Optional;
	// prefill and decode must have the same list; not supported across
	// different TP sizes (as SGLang).
	StateBuffers []Buffer
	// PageSize is tokens per page (SGLang page_size, > 0).
	PageSize int
	// KVHeadNum is the KV heads each token row of a KV buffer holds on this
	// rank (SGLang kv_head_num; 1 for MLA). 0 with TotalKVHeadNum set means
	// max(1, TotalKVHeadNum / TPSize); 0 with TotalKVHeadNum 0 on a non-MLA
	// rank means unknown (see Geometry.HeadsUnknown). On an MLA rank 0
	// means 1.
	KVHeadNum int
	// TotalKVHeadNum is the model's KV heads (SGLang total_kv_head_num); 0
	// means KVHeadNum × TPSize, as SGLang assumes. Head slicing across TP
	// sizes uses it (spec §6.4). SGLang's decode fills neither count: with
	// both 0 the rank's head geometry is taken from its peer's
	// (ResolveHeads), as both sides compute it alike.
	TotalKVHeadNum int
	// EngineRank is the rank's attention-TP rank (SGLang engine_rank) and
	// TPSize the attention-TP size (0 means 1).
	EngineRank, TPSize int
	// SystemDPRank is SGLang's system_dp_rank (kept for the caller; the
	// bootstrap registration uses ManagerConfig.DPRank/DPSize).
	SystemDPRank int
	// PPRank and PPSize place the rank in the pipeline (PPSize 0 means 1).
	PPRank, PPSize int
	// PrefillStartLayer is the model layer of the first KV buffer (SGLang
	// prefill_start_layer): a PP stage holds layers [PrefillStartLayer,
	// PrefillStartLayer + layers). A decode normally holds every layer (0).
	PrefillStartLayer int
	// MLA marks multi-head latent attention (SGLang is_mla_backend): one
	// buffer per layer, replicated on every TP rank, never head-sliced.
	MLA bool
	// GPUID is the rank's GPU (SGLang gpu_id; -1 or any value when the
	// buffers are host memory). Device buffers must be on this GPU.
	GPUID int
	// IBDevice is the rank's RDMA device (SGLang ib_device; informational:
	// the caller opens the rdma transport on it).
	IBDevice string
}

// Geometry is a rank's KV geometry as its peer needs it, derived from KVArgs:
// it travels in REGISTER (decode → prefill) and REGISTER_ACK (prefill →
// decode), and both sides pair buffers and compute head slices from it with
// the same function, so they agree on every byte.
type Geometry struct {
	// TPRank, TPSize, PPRank, PPSize place the rank.
	TPRank, TPSize, PPRank, PPSize int
	// StartLayer and EndLayer are the layers held, [StartLayer, EndLayer).
	StartLayer, EndLayer int
	// MLA: one buffer per layer, never sliced.
	MLA bool
	// PageSize is tokens per page.
	PageSize int
	// KVHeadNum is the heads per token row on this rank; TotalKVHeadNum the
	// model's KV heads. Both are 0 on a non-MLA rank whose KV arguments
	// gave neither (HeadsUnknown): the peer's geometry supplies them
	// (ResolveHeads).
	KVHeadNum, TotalKVHeadNum int
	// KVItemLens and KVItems are, per KV buffer, the bytes per page and the
	// pages the buffer holds.
	KVItemLens, KVItems []uint64
	// AuxItemLens and AuxItems are, per aux buffer, the bytes per row and the
	// rows the buffer holds.
	AuxItemLens, AuxItems []uint64
	// StateItemLens and StateItems are, per state buffer, the bytes per slot
	// and the slots the buffer holds.
	StateItemLens, StateItems []uint64
}

// HeadsUnknown reports whether the rank stated no KV head counts (a non-MLA
// rank with KVHeadNum and TotalKVHeadNum 0, as SGLang's decode fills its
// KVArgs): its heads per token row are derived from a peer's geometry by
// ResolveHeads.
func (g *Geometry) HeadsUnknown() bool {
	return !g.MLA && g.KVHeadNum == 0 && g.TotalKVHeadNum == 0
}

// Layers is the number of layers held.
func (g *Geometry) Layers() int { return g.EndLayer - g.StartLayer }

// NumPages is the pages every KV buffer holds (the smallest buffer's count).
func (g *Geometry) NumPages() int { return minItems(g.KVItems) }

// AuxRows is the rows every aux buffer holds (0 without aux buffers).
func (g *Geometry) AuxRows() int { return minItems(g.AuxItems) }

// StateSlots is the slots every state buffer holds (0 without state buffers).
func (g *Geometry) StateSlots() int { return minItems(g.StateItems) }

func minItems(xs []uint64) int {
	if len(xs) == 0 {
		return 0
	}
	m := slices.Min(xs)
	if m > 1<<31-1 {
		m = 1<<31 - 1
	}
	return int(m)
}

// BufferLayer returns the model layer and kv (0 = K or the MLA latent, 1 = V)
// of KV buffer i.
func (g *Geometry) BufferLayer(i int) (layer, kv int) {
	n := g.Layers()
	return g.StartLayer + i%n, i / n
}

// BufferIndex is the inverse of BufferLayer; ok is false when the layer is
// not held or kv is 1 on an MLA rank.
func (g *Geometry) BufferIndex(layer, kv int) (int, bool) {
	if layer < g.StartLayer || layer >= g.EndLayer || kv < 0 || kv > 1 || (g.MLA && kv == 1) {
		return 0, false
	}
	return kv*g.Layers() + layer - g.StartLayer, true
}

// BufferName names KV buffer i for error messages: "KV buffer i (layer L
// K)", "(layer L V)" or, on an MLA rank, "(layer L latent)".
func (g *Geometry) BufferName(i int) string {
	layer, kv := g.BufferLayer(i)
	switch {
	case g.MLA:
		return fmt.Sprintf("KV buffer %d (layer %d latent)", i, layer)
	case kv == 1:
		return fmt.Sprintf("KV buffer %d (layer %d V)", i, layer)
	}
	return fmt.Sprintf("KV buffer %d (layer %d K)", i, layer)
}

// MaxBuffers is the most buffers one list of KVArgs (KV, aux or state) may
// hold; Geometry refuses more, and so does the control codec in the
// REGISTER and REGISTER_ACK it decodes.
const MaxBuffers = 1 << 16

// ErrBadKVArgs is wrapped by every KVArgs validation error.
var ErrBadKVArgs = errors.New("engine: invalid KV arguments")

// bufRef names one buffer of a KVArgs for overlap checks and errors.
type bufRef struct {
	list string
	i    int
	b    Buffer
}

// Geometry validates the arguments and derives the rank's geometry. Errors
// wrap ErrBadKVArgs and name the field or buffer and what is accepted:
// no KV buffers, an odd MHA buffer count, zero-length or zero-item-length
// buffers, a buffer smaller than one item, item lengths that are not whole
// token rows and heads, overlapping buffers, placement out of range, or a
// head count that does not match TotalKVHeadNum over TPSize.
func (a *KVArgs) Geometry() (*Geometry, error) {
	bad := func(format string, v ...any) (*Geometry, error) {
		return nil, fmt.Errorf("%w: %s", ErrBadKVArgs, fmt.Sprintf(format, v...))
	}
	tp, pp := max(a.TPSize, 1), max(a.PPSize, 1)
	heads, total := a.KVHeadNum, a.TotalKVHeadNum
	unknown := !a.MLA && heads == 0 && total == 0
	switch {
	case a.MLA:
		heads = max(heads, 1)
	case heads == 0 && total > 0:
		heads = max(1, total/tp)
	}
	if total == 0 && !unknown {
		total = heads * tp
	}
	switch {
	case len(a.KVBuffers) == 0:
		return bad("no KV buffers (kv_data_ptrs is empty): give one buffer per layer for K and one for V, or one per layer for MLA")
	case len(a.KVBuffers) > MaxBuffers:
		return bad("%d KV buffers, more than %d", len(a.KVBuffers), MaxBuffers)
	case !a.MLA && len(a.KVBuffers)%2 != 0:
		return bad("%d KV buffers: an MHA/GQA rank gives K buffers then V buffers (an even count); set MLA for one buffer per layer", len(a.KVBuffers))
	case len(a.AuxBuffers) > MaxBuffers || len(a.StateBuffers) > MaxBuffers:
		return bad("%d aux and %d state buffers, more than %d", len(a.AuxBuffers), len(a.StateBuffers), MaxBuffers)
	case a.PageSize <= 0 || a.PageSize > 1<<20:
		return bad("page_size %d: want 1 … 2^20 tokens", a.PageSize)
	case a.TPSize < 0 || a.EngineRank < 0 || a.EngineRank >= tp:
		return bad("engine_rank %d not in [0, tp size %d)", a.EngineRank, tp)
	case a.PPSize < 0 || a.PPRank < 0 || a.PPRank >= pp:
		return bad("pp_rank %d not in [0, pp size %d)", a.PPRank, pp)
	case a.KVHeadNum < 0 || a.TotalKVHeadNum < 0 || a.PrefillStartLayer < 0:
		return bad("kv_head_num %d, total_kv_head_num %d and prefill_start_layer %d must be >= 0", a.KVHeadNum, a.TotalKVHeadNum, a.PrefillStartLayer)
	case a.MLA && heads != 1:
		return bad("kv_head_num %d on an MLA rank: MLA keeps one latent row per token (kv_head_num 1)", heads)
	case unknown:
	case !a.MLA && heads != max(1, total/tp):
		return bad("kv_head_num %d, but total_kv_head_num %d over tp size %d gives %d heads per rank", heads, total, tp, max(1, total/tp))
	case !a.MLA && total%tp != 0 && tp%total != 0:
		return bad("%d KV heads cannot be split over tp size %d (one must divide the other)", total, tp)
	}
	layers := len(a.KVBuffers)
	if !a.MLA {
		layers /= 2
	}
	g := &Geometry{TPRank: a.EngineRank, TPSize: tp, PPRank: a.PPRank, PPSize: pp, StartLayer: a.PrefillStartLayer,
		EndLayer: a.PrefillStartLayer + layers, MLA: a.MLA, PageSize: a.PageSize, KVHeadNum: heads, TotalKVHeadNum: total}
	var all []bufRef
	check := func(list string, bs []Buffer, kv bool) error {
		for i, b := range bs {
			name := fmt.Sprintf("%s buffer %d", list, i)
			if kv {
				name = g.BufferName(i)
			}
			switch {
			case b.Addr == 0 || b.Length == 0:
				return fmt.Errorf("%w: %s: address %#x, length %d: a buffer needs a non-zero address and length", ErrBadKVArgs, name, b.Addr, b.Length)
			case uint64(b.Addr)+b.Length < uint64(b.Addr):
				return fmt.Errorf("%w: %s: [%#x, +%d) wraps the address space", ErrBadKVArgs, name, b.Addr, b.Length)
			case b.ItemLen == 0:
				return fmt.Errorf("%w: %s: item length is 0 (bytes per page, row or slot)", ErrBadKVArgs, name)
			case b.Length < b.ItemLen:
				return fmt.Errorf("%w: %s: %d bytes hold no item of %d bytes", ErrBadKVArgs, name, b.Length, b.ItemLen)
			case b.Kind != transport.MemoryHost && b.Kind != transport.MemoryCUDA:
				return fmt.Errorf("%w: %s: unknown memory kind %d", ErrBadKVArgs, name, b.Kind)
			case b.Kind == transport.MemoryCUDA && b.Device < 0:
				return fmt.Errorf("%w: %s: CUDA device %d: want an ordinal >= 0", ErrBadKVArgs, name, b.Device)
			case b.Kind == transport.MemoryCUDA && a.GPUID >= 0 && b.Device != a.GPUID:
				return fmt.Errorf("%w: %s is on cuda:%d, but the rank's gpu_id is %d", ErrBadKVArgs, name, b.Device, a.GPUID)
			}
			if kv {
				tok := b.ItemLen / uint64(a.PageSize)
				switch {
				case unknown && b.ItemLen%uint64(a.PageSize) != 0:
					return fmt.Errorf("%w: %s: item length %d bytes is not page_size %d whole token rows", ErrBadKVArgs, name, b.ItemLen, a.PageSize)
				case !unknown && (b.ItemLen%uint64(a.PageSize) != 0 || tok%uint64(heads) != 0):
					return fmt.Errorf("%w: %s: item length %d bytes is not page_size %d × kv_head_num %d whole head rows", ErrBadKVArgs, name, b.ItemLen, a.PageSize, heads)
				}
			}
			all = append(all, bufRef{list, i, b})
		}
		return nil
	}
	if err := check("KV", a.KVBuffers, true); err != nil {
		return nil, err
	}
	if err := check("aux", a.AuxBuffers, false); err != nil {
		return nil, err
	}
	if err := check("state", a.StateBuffers, false); err != nil {
		return nil, err
	}
	if err := overlaps(all, g); err != nil {
		return nil, err
	}
	for _, b := range a.KVBuffers {
		g.KVItemLens, g.KVItems = append(g.KVItemLens, b.ItemLen), append(g.KVItems, b.Items())
	}
	for _, b := range a.AuxBuffers {
		g.AuxItemLens, g.AuxItems = append(g.AuxItemLens, b.ItemLen), append(g.AuxItems, b.Items())
	}
	for _, b := range a.StateBuffers {
		g.StateItemLens, g.StateItems = append(g.StateItemLens, b.ItemLen), append(g.StateItems, b.Items())
	}
	return g, nil
}

// overlaps refuses two buffers sharing a byte (same memory kind and device).
func overlaps(all []bufRef, g *Geometry) error {
	s := slices.Clone(all)
	sort.Slice(s, func(i, j int) bool {
		if s[i].b.Kind != s[j].b.Kind || s[i].b.Device != s[j].b.Device {
			return s[i].b.Kind < s[j].b.Kind || (s[i].b.Kind == s[j].b.Kind && s[i].b.Device < s[j].b.Device)
		}
		return s[i].b.Addr < s[j].b.Addr
	})
	name := func(r bufRef) string {
		if r.list == "KV" {
			return g.BufferName(r.i)
		}
		return fmt.Sprintf("%s buffer %d", r.list, r.i)
	}
	for k := 1; k < len(s); k++ {
		p, c := s[k-1], s[k]
		if p.b.Kind == c.b.Kind && p.b.Device == c.b.Device && uint64(c.b.Addr) < uint64(p.b.Addr)+p.b.Length {
			return fmt.Errorf("%w: %s [%#x, +%d) overlaps %s [%#x, +%d): every buffer needs its own memory", ErrBadKVArgs, name(c), c.b.Addr, c.b.Length, name(p), p.b.Addr, p.b.Length)
		}
	}
	return nil
}

// HeadSlice is how one producer's token rows map into one consumer's token
// rows for one buffer pair (spec §6.4): per token slot, Length bytes from
// SrcOffset inside the producer's row to DstOffset inside the consumer's
// row. Equal TP sizes and MLA give the whole row.
type HeadSlice struct {
	SrcOffset, DstOffset, Length uint64
	// SrcHeadStart, DstHeadStart and Heads are the same in heads.
	SrcHeadStart, DstHeadStart, Heads int
}

// BufferPair is one producer KV buffer and the consumer KV buffer it writes.
type BufferPair struct {
	// Src and Dst are the buffer indices on the producer and the consumer.
	Src, Dst int
	// SrcItem and DstItem are their item lengths (bytes per page); SrcToken
	// and DstToken their token-row bytes.
	SrcItem, DstItem, SrcToken, DstToken uint64
	// Slice is the head slice; Full is true when whole pages move (equal TP
	// or MLA), so runs of pages are one contiguous write.
	Slice HeadSlice
	Full  bool
}

// PageBytes is the bytes the pair moves per page.
func (p BufferPair) PageBytes(pageSize int) uint64 {
	if p.Full {
		return p.SrcItem
	}
	return uint64(pageSize) * p.Slice.Length
}

// pairError names both ranks of a pairing in an error.
func pairError(srcName, dstName, format string, v ...any) error {
	return fmt.Errorf("engine: prefill %s and decode %s: %s", srcName, dstName, fmt.Sprintf(format, v...))
}

// ResolveHeads returns the producer's (prefill, src) and the consumer's
// (decode, dst) geometries with their KV head counts known: a side whose KV
// arguments stated none (HeadsUnknown, as SGLang's decode fills its KVArgs)
// takes the model's KV heads from the other side, and its heads per token
// row are max(1, total / its TP size); its KV buffers' token rows must then
// be a whole number of the other side's heads, exactly that many. The
// inputs are not modified; a side that needs nothing is returned as given.
// Both sides of a pairing call it (inside PairBuffers) with the same
// geometries, so they agree. With neither side stating heads, equal TP sizes
// need none (whole pages move) and different ones are refused. Errors name
// both ranks (srcName, dstName) and the counts involved.
func ResolveHeads(src, dst *Geometry, srcName, dstName string) (*Geometry, *Geometry, error) {
	su, du := src.HeadsUnknown(), dst.HeadsUnknown()
	switch {
	case src.MLA || dst.MLA || (!su && !du):
		return src, dst, nil
	case su && du:
		if src.TPSize == dst.TPSize {
			return src, dst, nil
		}
		return nil, nil, pairError(srcName, dstName, "neither side states its KV head count (kv_head_num, total_kv_head_num), and prefill tp %d and decode tp %d differ, so the heads must be sliced: give the prefill's KVArgs its head counts (SGLang's prefill fills them)", src.TPSize, dst.TPSize)
	}
	known, unk, kname, uname := src, dst, "prefill", "decode"
	if su {
		known, unk, kname, uname = dst, src, "decode", "prefill"
	}
	total := known.TotalKVHeadNum
	if total < 1 || known.KVHeadNum < 1 || unk.TPSize < 1 {
		return nil, nil, pairError(srcName, dstName, "the %s states %d KV heads per rank and %d in total, and the %s tp size is %d: cannot derive the %s's heads", kname, known.KVHeadNum, total, uname, unk.TPSize, uname)
	}
	if total%unk.TPSize != 0 && unk.TPSize%total != 0 {
		return nil, nil, pairError(srcName, dstName, "the %s's KVArgs give no KV head counts, so the %s's %d KV heads are taken, and they cannot be split over %s tp size %d (one must divide the other); run both with the same model", uname, kname, total, uname, unk.TPSize)
	}
	heads := max(1, total/unk.TPSize)
	ps := uint64(known.PageSize)
	if ps == 0 || uint64(unk.PageSize) != ps {
		return nil, nil, pairError(srcName, dstName, "page size differs: prefill %d tokens, decode %d tokens", src.PageSize, dst.PageSize)
	}
	for i, item := range unk.KVItemLens {
		layer, kv := unk.BufferLayer(i)
		k, ok := known.BufferIndex(layer, kv)
		if !ok {
			continue // a layer the other side lacks: the pairing refuses it, naming the layers
		}
		ktok, utok := known.KVItemLens[k]/ps, item/ps
		hb := ktok / uint64(known.KVHeadNum)
		if utok != uint64(heads)*hb {
			return nil, nil, pairError(srcName, dstName, "the %s's KVArgs give no KV head counts, so they are taken from the %s: %d KV heads over %s tp %d is %d heads per token row of %d bytes each (%s %s: %d bytes over %d heads), but %s %s holds %d bytes per token (%s); run both with the same model, or give the %s's kv_head_num and total_kv_head_num",
				uname, kname, total, uname, unk.TPSize, heads, hb, kname, known.BufferName(k), ktok, known.KVHeadNum, uname, unk.BufferName(i), utok, wholeHeads(utok, hb), uname)
		}
	}
	r := *unk
	r.KVHeadNum, r.TotalKVHeadNum = heads, total
	if su {
		return &r, dst, nil
	}
	return src, &r, nil
}

// wholeHeads says how many heads of hb bytes a token row of tok bytes is.
func wholeHeads(tok, hb uint64) string {
	if hb == 0 || tok%hb != 0 {
		return fmt.Sprintf("not a whole number of %d-byte heads", hb)
	}
	return fmt.Sprintf("%d heads", tok/hb)
}

// PairBuffers matches a producer's (prefill, src) KV buffers to a consumer's
// (decode, dst) and computes each pair's head slice by SGLang's
// send_kvcache_slice rules (spec §6.4), per buffer. Both sides call it with
// the same geometries (exchanged in REGISTER / REGISTER_ACK), so they agree;
// a side that stated no KV head counts takes them from the other
// (ResolveHeads). srcName and dstName name the ranks in errors, which say
// what differs on which side: MLA, page size, total KV heads, a layer the
// consumer does not hold, item lengths that differ at equal TP sizes,
// per-head bytes that differ, aux or state lists that differ, or state
// buffers across TP sizes.
func PairBuffers(src, dst *Geometry, srcName, dstName string) ([]BufferPair, error) {
	both := func(format string, v ...any) error { return pairError(srcName, dstName, format, v...) }
	switch {
	case src.MLA != dst.MLA:
		return nil, both("prefill MLA is %v (%d KV buffers), decode MLA is %v (%d KV buffers); run both with the same model", src.MLA, len(src.KVItemLens), dst.MLA, len(dst.KVItemLens))
	case src.PageSize != dst.PageSize:
		return nil, both("page size differs: prefill %d tokens, decode %d tokens", src.PageSize, dst.PageSize)
	}
	src, dst, err := ResolveHeads(src, dst, srcName, dstName)
	if err != nil {
		return nil, err
	}
	switch {
	case !src.MLA && src.TotalKVHeadNum != dst.TotalKVHeadNum:
		return nil, both("total KV heads differ: prefill %d, decode %d; run both with the same model", src.TotalKVHeadNum, dst.TotalKVHeadNum)
	case src.StartLayer < dst.StartLayer || src.EndLayer > dst.EndLayer:
		return nil, both("prefill holds layers [%d, %d), decode holds [%d, %d): the decode must hold every layer the prefill sends", src.StartLayer, src.EndLayer, dst.StartLayer, dst.EndLayer)
	}
	if err := sameList("aux", src.AuxItemLens, dst.AuxItemLens); err != nil {
		return nil, both("%v", err)
	}
	if err := sameList("state", src.StateItemLens, dst.StateItemLens); err != nil {
		return nil, both("%v", err)
	}
	if len(src.StateItemLens) > 0 && src.TPSize != dst.TPSize {
		return nil, both("state buffers do not support different TP sizes (prefill tp %d, decode tp %d), as in SGLang", src.TPSize, dst.TPSize)
	}
	if len(src.StateItemLens) > 0 && src.PPSize > 1 {
		return nil, both("state buffers with prefill pp size %d are not supported (one producer writes the state slots)", src.PPSize)
	}
	ps := uint64(src.PageSize)
	out := make([]BufferPair, 0, len(src.KVItemLens))
	for i, sItem := range src.KVItemLens {
		layer, kv := src.BufferLayer(i)
		di, ok := dst.BufferIndex(layer, kv)
		if !ok {
			return nil, both("%s has no decode counterpart", src.BufferName(i))
		}
		dItem := dst.KVItemLens[di]
		p := BufferPair{Src: i, Dst: di, SrcItem: sItem, DstItem: dItem, SrcToken: sItem / ps, DstToken: dItem / ps}
		if src.MLA || src.TPSize == dst.TPSize {
			if sItem != dItem {
				return nil, both("prefill %s is %d bytes per page, decode %s is %d bytes per page; with equal TP sizes (or MLA) page sizes in bytes must match", src.BufferName(i), sItem, dst.BufferName(di), dItem)
			}
			p.Full = true
			p.Slice = HeadSlice{Length: p.SrcToken, Heads: src.KVHeadNum}
			out = append(out, p)
			continue
		}
		total, P, D := src.TotalKVHeadNum, src.TPSize, dst.TPSize
		srcHeads, dstHeads := max(1, total/P), max(1, total/D)
		hb := p.DstToken / uint64(dstHeads)
		if p.DstToken%uint64(dstHeads) != 0 || p.SrcToken != hb*uint64(srcHeads) {
			return nil, both("bytes per head differ: prefill %s holds %d bytes per token over %d heads, decode %s holds %d bytes per token over %d heads", src.BufferName(i), p.SrcToken, srcHeads, dst.BufferName(di), p.DstToken, dstHeads)
		}
		var s HeadSlice
		if P > D {
			unique := (src.TPRank % P) / max(1, P/total)
			s = HeadSlice{SrcHeadStart: 0, Heads: srcHeads, DstHeadStart: (unique * srcHeads) % dstHeads}
		} else {
			uniqueDst := (dst.TPRank % D) / max(1, D/total)
			s = HeadSlice{SrcHeadStart: (uniqueDst * dstHeads) % srcHeads, Heads: dstHeads, DstHeadStart: 0}
		}
		s.SrcOffset, s.DstOffset, s.Length = uint64(s.SrcHeadStart)*hb, uint64(s.DstHeadStart)*hb, uint64(s.Heads)*hb
		if s.DstOffset+s.Length > p.DstToken || s.SrcOffset+s.Length > p.SrcToken {
			return nil, both("head slice of %d heads from head %d to head %d exceeds a token row (prefill tp %d, decode tp %d, %d KV heads)", s.Heads, s.SrcHeadStart, s.DstHeadStart, P, D, total)
		}
		p.Slice = s
		p.Full = s.Length == p.SrcToken && p.SrcToken == p.DstToken
		out = append(out, p)
	}
	return out, nil
}

// sameList refuses aux or state lists that differ in count or item lengths.
func sameList(what string, src, dst []uint64) error {
	if len(src) != len(dst) {
		return fmt.Errorf("%s buffer counts differ: prefill has %d, decode has %d (both sides must register the same %s list)", what, len(src), len(dst), what)
	}
	for i := range src {
		if src[i] != dst[i] {
			return fmt.Errorf("%s buffer %d item lengths differ: prefill %d bytes, decode %d bytes (both sides must register the same %s list)", what, i, src[i], dst[i], what)
		}
	}
	return nil
}
