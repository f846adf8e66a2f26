"""Shared by the tests and their peer processes: KV buffers laid out as SGLang
allocates them (one buffer per layer for K, then V; MLA one per layer), a
deterministic byte pattern, and aux rows."""

from __future__ import annotations

import numpy as np


class Geometry:
    """A small model: layers, heads (whole model), head_dim, bf16, page size."""

    def __init__(self, layers=2, heads=4, head_dim=16, elem=2, page_size=4, pages=64, mla=False, aux_rows=8):
        self.layers = layers
        self.heads = 1 if mla else heads
        self.head_dim = head_dim
        self.elem = elem
        self.page_size = page_size
        self.pages = pages
        self.mla = mla
        self.aux_rows = aux_rows
        self.aux_item_lens = [64, 256]  # SGLang's output_ids row and a wider row

    def nbuffers(self):
        return self.layers if self.mla else 2 * self.layers

    def heads_per_rank(self, tp):
        return self.heads if self.mla else self.heads // tp

    def item_len(self, tp):
        return self.page_size * self.heads_per_rank(tp) * self.head_dim * self.elem


class RankKV:
    """One rank's KV buffers (numpy, host memory, or kvxfer.HostBuffer when
    host_buffers is true) and aux buffers; kv_args() fills a KVArgs."""

    def __init__(self, g: Geometry, tp=1, rank=0, host_buffers=False):
        self.g, self.tp, self.rank = g, tp, rank
        self.hpr = g.heads_per_rank(tp)
        self._hb = []
        shape = (g.pages, g.page_size, self.hpr, g.head_dim * g.elem)

        def alloc(nbytes):
            if host_buffers:
                from kvxfer import HostBuffer

                hb = HostBuffer(nbytes, "pytest")
                self._hb.append(hb)
                return hb.numpy("uint8")[:nbytes]
            return np.zeros(nbytes, dtype=np.uint8)

        self.kv = [alloc(int(np.prod(shape))).reshape(shape) for _ in range(g.nbuffers())]
        self.aux = [alloc(g.aux_rows * n).reshape(g.aux_rows, n) for n in g.aux_item_lens]

    def kv_args(self, engine_rank=None):
        from kvxfer.sglang import KVArgs

        g = self.g
        return KVArgs(
            engine_rank=self.rank if engine_rank is None else engine_rank,
            kv_data_ptrs=[int(b.ctypes.data) for b in self.kv],
            kv_data_lens=[int(b.nbytes) for b in self.kv],
            kv_item_lens=[g.item_len(self.tp)] * len(self.kv),
            aux_data_ptrs=[int(a.ctypes.data) for a in self.aux],
            aux_data_lens=[int(a.nbytes) for a in self.aux],
            aux_item_lens=list(g.aux_item_lens),
            kv_head_num=self.hpr,
            total_kv_head_num=g.heads,
            page_size=g.page_size,
            kv_location="host",
        )

    def fill(self, room):
        """Page p of buffer b: byte (t, head h, offset i) = pattern(room, b, p,
        t, global head, i); the global head is rank*heads_per_rank + h (MLA:
        the one latent row)."""
        for b, buf in enumerate(self.kv):
            p = np.arange(buf.shape[0]).reshape(-1, 1, 1, 1)
            t = np.arange(buf.shape[1]).reshape(1, -1, 1, 1)
            h = np.arange(buf.shape[2]).reshape(1, 1, -1, 1) + (0 if self.g.mla else self.rank * self.hpr)
            i = np.arange(buf.shape[3]).reshape(1, 1, 1, -1)
            buf[...] = pattern(room, b, p, t, h, i)

    def fill_pages(self, room, pages):
        """fill(room) for the given pages only, so that several rooms can
        hold their source pages in one rank's buffers at once."""
        for b, buf in enumerate(self.kv):
            t = np.arange(buf.shape[1]).reshape(-1, 1, 1)
            h = np.arange(buf.shape[2]).reshape(1, -1, 1) + (0 if self.g.mla else self.rank * self.hpr)
            i = np.arange(buf.shape[3]).reshape(1, 1, -1)
            for p in pages:
                buf[p] = pattern(room, b, np.full((1, 1, 1), p), t, h, i)

    def fill_aux(self, row, room):
        for k, a in enumerate(self.aux):
            a[row, :] = (np.arange(a.shape[1]) * 7 + k * 13 + room % 256) % 256
            a[row, :8] = np.frombuffer(int(room).to_bytes(8, "little"), dtype=np.uint8)

    def close(self):
        self.kv = self.aux = None
        for hb in self._hb:
            hb.close()


def pattern(room, b, p, t, h, i):
    return (((room % 251) * 7 + b * 131 + p * 31 + t * 17 + h * 5 + i) % 251).astype(np.uint8)


def expected_page(g: Geometry, room, buffer, src_page):
    """What a decode page (all heads) must hold after receiving src_page of
    buffer from every prefill rank."""
    shape = (1, g.page_size, g.heads, g.head_dim * g.elem)
    t = np.arange(shape[1]).reshape(1, -1, 1, 1)
    h = np.arange(shape[2]).reshape(1, 1, -1, 1)
    i = np.arange(shape[3]).reshape(1, 1, 1, -1)
    return pattern(room, buffer, np.full((1, 1, 1, 1), src_page), t, h, i)[0]


def expected_aux(g: Geometry, k, room):
    n = g.aux_item_lens[k]
    row = ((np.arange(n) * 7 + k * 13 + room % 256) % 256).astype(np.uint8)
    row[:8] = np.frombuffer(int(room).to_bytes(8, "little"), dtype=np.uint8)
    return row
