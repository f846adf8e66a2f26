package workload

import (
	"container/list"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
)

// DefaultBlockTokens is the tokens per prefix block of the Mooncake traces:
// one hash_ids entry per 512-token block of the prompt.
const DefaultBlockTokens = 512

// PrefixCache is a decode rank's cache of prompt blocks whose KV it already
// holds, keyed by the hash chain of the trace's hash_ids (block j is named
// by hash_ids[0..j], so equal keys mean equal prompt prefixes), with least
// recently used eviction. It stands in for a serving engine's radix cache:
// Plan tells a request how many leading tokens it need not receive (SGLang's
// decode_prefix_len) and which pages hold them.
//
// Decisions depend only on the order of Plan calls, never on timing: a block
// counts as held from the moment an earlier request that will receive it was
// planned (its KV may still be in flight; Lease.WaitPrefix waits for it), and
// eviction is by capacity in blocks. So decode ranks that see the same
// requests in the same order make the same decisions, as SGLang's TP ranks
// do. Safe for concurrent use.
type PrefixCache struct {
	alloc       *PageAllocator
	pageSize    int
	blockTokens int
	blockPages  int
	capBlocks   int

	mu  sync.Mutex
	lru *list.List // of *prefixBlock, front = most recently used
	m   map[string]*prefixBlock
}

// prefixBlock is one cached block: blockPages pages holding the KV of
// logical pages [firstPage, firstPage+blockPages) of request room.
type prefixBlock struct {
	key       string
	room      uint64
	firstPage int
	pages     []int32
	allocated chan struct{} // closed once pages are assigned (or allocErr set)
	allocErr  error
	done      chan struct{} // closed when the owner request finished
	ok        bool          // the owner succeeded (valid after done)
	refs      int           // leases holding the block (owner included)
	indexed   bool          // still in the cache's index
	elem      *list.Element
}

// NewPrefixCache returns an empty cache of at most capBlocks blocks of
// blockTokens tokens (a whole number of pages of pageSize tokens), whose
// pages come from (and go back to) alloc. Errors name the bad value.
func NewPrefixCache(alloc *PageAllocator, pageSize, blockTokens, capBlocks int) (*PrefixCache, error) {
	switch {
	case pageSize < 1 || blockTokens < 1 || blockTokens%pageSize != 0:
		return nil, fmt.Errorf("workload: prefix cache: block of %d tokens is not a whole number of %d-token pages", blockTokens, pageSize)
	case capBlocks < 1:
		return nil, fmt.Errorf("workload: prefix cache: capacity %d blocks, want >= 1", capBlocks)
	}
	return &PrefixCache{alloc: alloc, pageSize: pageSize, blockTokens: blockTokens, blockPages: blockTokens / pageSize,
		capBlocks: capBlocks, lru: list.New(), m: map[string]*prefixBlock{}}, nil
}

// BlockPages is the pages of one block.
func (c *PrefixCache) BlockPages() int { return c.blockPages }

// Blocks is the number of blocks in the index now.
func (c *PrefixCache) Blocks() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.m)
}

// chainKey names block j of a prompt: hash_ids[0..j], packed.
func chainKey(ids []int64) string {
	b := make([]byte, 8*len(ids))
	for i, id := range ids {
		binary.LittleEndian.PutUint64(b[8*i:], uint64(id))
	}
	return string(b)
}

// Lease is one request's use of the cache, from Plan to Finish.
type Lease struct {
	c *PrefixCache
	// PrefixTokens is the leading prompt tokens already held (whole blocks,
	// always fewer than the prompt), SGLang's decode_prefix_len.
	PrefixTokens int
	room         uint64
	pages        int // the request's pages in all
	prefix       []*prefixBlock
	owned        []*prefixBlock
	fresh        []int32 // pages allocated by Pages (owned blocks' and the tail)
	allocDone    bool    // owned blocks' allocated channels are closed
	finished     bool
}

// Plan looks up the longest held prefix of a request (room, hash_ids,
// prompt tokens) and reserves the request's later whole blocks, which it will
// hold once it succeeded. Call it in request arrival order. A request with
// no hash_ids gets an empty lease (nothing held, nothing kept).
func (c *PrefixCache) Plan(room uint64, hashIDs []int64, tokens int) *Lease {
	l := &Lease{c: c, room: room, pages: (tokens + c.pageSize - 1) / c.pageSize}
	full := min(len(hashIDs), tokens/c.blockTokens) // whole blocks inside the prompt
	c.mu.Lock()
	defer c.mu.Unlock()
	hit := 0
	for j := 0; j < full && (j+1)*c.blockTokens < tokens; j++ { // at least one token is left to send
		b := c.m[chainKey(hashIDs[:j+1])]
		if b == nil {
			break
		}
		l.prefix = append(l.prefix, b)
		hit++
	}
	for i := len(l.prefix) - 1; i >= 0; i-- { // block 0 ends most recent
		b := l.prefix[i]
		b.refs++
		c.lru.MoveToFront(b.elem)
	}
	l.PrefixTokens = hit * c.blockTokens
	for j := full - 1; j >= hit; j-- {
		key := chainKey(hashIDs[:j+1])
		if _, dup := c.m[key]; dup {
			continue // an earlier block of this chain missed; keep the older copy
		}
		b := &prefixBlock{key: key, room: room, firstPage: j * c.blockPages, allocated: make(chan struct{}), done: make(chan struct{}), refs: 1, indexed: true}
		b.elem = c.lru.PushFront(b)
		c.m[key] = b
		l.owned = append([]*prefixBlock{b}, l.owned...)
	}
	for c.lru.Len() > c.capBlocks {
		c.unindexLocked(c.lru.Back().Value.(*prefixBlock))
	}
	return l
}

// unindexLocked drops b from the index; its pages go back once no lease
// holds it.
func (c *PrefixCache) unindexLocked(b *prefixBlock) {
	if !b.indexed {
		return
	}
	b.indexed = false
	c.lru.Remove(b.elem)
	if c.m[b.key] == b {
		delete(c.m, b.key)
	}
	c.freeLocked(b)
}

func (c *PrefixCache) freeLocked(b *prefixBlock) {
	if b.refs == 0 && !b.indexed && b.pages != nil {
		_ = c.alloc.Free(b.pages)
		b.pages = nil
	}
}

// Pages returns the request's page list in token order: the held prefix
// blocks' pages (waiting until their owners allocated them), then pages from
// alloc(n) for the rest, of which the request's own whole blocks are kept by
// the cache after a successful Finish. Call it once. Errors: a prefix block
// whose owner could not allocate, alloc's error, or ctx ending.
func (l *Lease) Pages(ctx context.Context, alloc func(n int) ([]int32, error)) ([]int32, error) {
	var out []int32
	var err error
	for _, b := range l.prefix {
		select {
		case <-b.allocated:
		case <-ctx.Done():
			err = ctx.Err()
		}
		if err == nil && b.allocErr != nil {
			err = fmt.Errorf("workload: prefix block of room %d (pages from %d): %w", b.room, b.firstPage, b.allocErr)
		}
		if err != nil {
			l.failAlloc(err)
			return nil, err
		}
		out = append(out, b.pages...)
	}
	fresh, err := alloc(l.pages - len(out))
	if err != nil {
		l.failAlloc(err)
		return nil, err
	}
	bp := l.c.blockPages
	l.c.mu.Lock()
	l.fresh = fresh
	for _, b := range l.owned {
		off := b.firstPage - len(out)
		b.pages = fresh[off : off+bp : off+bp]
		close(b.allocated)
	}
	l.allocDone = true
	l.c.mu.Unlock()
	return append(out, fresh...), nil
}

// failAlloc tells requests waiting for this lease's blocks that they will
// get no pages.
func (l *Lease) failAlloc(err error) {
	l.c.mu.Lock()
	defer l.c.mu.Unlock()
	l.failAllocLocked(err)
}

func (l *Lease) failAllocLocked(err error) {
	if l.allocDone {
		return
	}
	l.allocDone = true
	for _, b := range l.owned {
		b.allocErr = err
		close(b.allocated)
	}
}

// PrefixSegment is a run of held prefix pages: pages hold logical pages
// [FirstPage, FirstPage+len(Pages)) of request Room (whose pattern they
// carry).
type PrefixSegment struct {
	Room      uint64
	FirstPage int
	Pages     []int32
}

// ErrPrefixLost is wrapped when a held prefix block's owner request failed,
// so the block never received its KV.
var ErrPrefixLost = errors.New("workload: a held prefix block's request failed")

// WaitPrefix waits until the requests that receive the held prefix blocks
// finished and returns the blocks, in token order. Errors: an owner failed
// (wraps ErrPrefixLost, naming its room), or ctx ended.
func (l *Lease) WaitPrefix(ctx context.Context) ([]PrefixSegment, error) {
	var out []PrefixSegment
	for _, b := range l.prefix {
		select {
		case <-b.done:
		case <-ctx.Done():
			return nil, fmt.Errorf("workload: waiting for the prefix block of room %d: %w", b.room, ctx.Err())
		}
		if !b.ok {
			return nil, fmt.Errorf("%w: room %d (logical pages from %d)", ErrPrefixLost, b.room, b.firstPage)
		}
		out = append(out, PrefixSegment{Room: b.room, FirstPage: b.firstPage, Pages: b.pages})
	}
	return out, nil
}

// Finish ends the lease: on success the request's whole blocks become held
// blocks, on failure they leave the index; the held prefix blocks are
// released, and pages no held block keeps (the partial last block, blocks
// evicted meanwhile, everything on failure) go back to the allocator once no
// lease uses them. Idempotent.
func (l *Lease) Finish(ok bool) {
	c := l.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if l.finished {
		return
	}
	l.finished = true
	l.failAllocLocked(errors.New("the request ended before it allocated its pages"))
	inBlock := map[int32]bool{}
	for _, b := range l.owned {
		for _, p := range b.pages {
			inBlock[p] = true
		}
	}
	for _, b := range l.owned {
		b.ok = ok
		close(b.done)
		if !ok {
			c.unindexLocked(b)
		}
	}
	for _, b := range append(l.prefix, l.owned...) {
		b.refs--
		c.freeLocked(b)
	}
	var rest []int32
	for _, p := range l.fresh {
		if !inBlock[p] {
			rest = append(rest, p)
		}
	}
	if len(rest) > 0 {
		_ = c.alloc.Free(rest)
	}
}
