"""KV caches: a padded batch cache, a pool of one-request caches, and ragged attention over the pool.

`KVCache` holds per-layer K/V [B, Hkv, capacity, D] for B rows that advance together (the padded
batch forward of pretraining and regeneration). The engine's requests each own a batch-1 cache, and
those are slots of one `KVPool` per model: the per-layer tensors [slots, Hkv, capacity, D] are shared,
so a ragged batch of requests attends in one call per layer over a view of the pool (`Ragged`)
instead of a Python loop of per-request attention calls (at 32 requests on two CPU cores that loop
was ~40% of a verification step: docs/benchmarks.md, issue 21).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
import weakref

import torch

from adaflash.kernels import attention_cpu


def kv_dtype(dtype: torch.dtype, device: torch.device | str | None, head_dim: int | None = None) -> torch.dtype:
    """What K/V are stored in for a model of `dtype`. On a CPU attention multiplies in float32. The
    row-invariant kernel reads bfloat16 K/V as they are (widening is exact, so the bits are those of
    float32 copies; a step reads half the K/V bytes and the pool takes half the memory: 32 requests of
    300 tokens attended in 22.2 ms a SmolLM2 step instead of 25.8), so a bf16 model whose head dim the
    kernel takes keeps them in bf16. Elsewhere (float16, no kernel) K/V are float32, converted once as
    they are written instead of every layer's whole context on every step by `Attention.attend_heads`
    (14% of a bf16 step at concurrency 32)."""
    cpu = device is None or torch.device(device).type == "cpu"
    if not cpu or dtype not in (torch.bfloat16, torch.float16):
        return dtype
    kernel = dtype == torch.bfloat16 and kernel_takes(device or "cpu", dtype, head_dim)
    return torch.bfloat16 if kernel else torch.float32


def kernel_takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the row-invariant C++ kernel (kernels/attention_cpu.py) can attend over K/V of this device,
    storage dtype and head dim: float32 or bfloat16 on a CPU, head dims of 32, 64 or 128, where it built."""
    return (
        torch.device(device).type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and head_dim in attention_cpu.HEAD_DIMS
        and attention_cpu.available()
    )


def invariant_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention over such K/V runs the kernel now: where it takes them, for inference; else
    PyTorch's attention (training with autograd, GPUs, no compiler)."""
    return not torch.is_grad_enabled() and kernel_takes(device, dtype, head_dim)


NO_TREES = torch.zeros(0, dtype=torch.bool)


def one_block(cache: "KVCache", start: int, n: int) -> tuple | None:
    """The kernel's description of one causal block of n tokens at `start` in a batch-1 cache (the padded
    forward of a single request, e.g. the plain-decoding reference), or None where the kernel is not used
    (a batch, or padding inside the block: the kernel's blocks are all real tokens)."""
    k = cache.k[0]
    if k.shape[0] != 1 or not invariant_kernel(k.device, k.dtype, k.shape[-1]) or not k.is_contiguous():
        return None
    if not bool(cache.valid[0, start : start + n].all()):
        return None
    req = torch.tensor([[0, start, n, 0, 0, 0]])
    return req, NO_TREES, attention_cpu.context_slots(cache.valid[:1].contiguous(), req)


class KVCache:
    """Per-layer K/V buffers [B, Hkv, capacity, D] with one shared length (stored as `kv_dtype`).

    `valid` marks real (non-padding) slots, `next_pos` the RoPE position of each row's next token,
    so left-padded batches work. `crop` rolls back rejected speculative tokens. A pooled cache
    (`KVPool.take`, batch 1) holds views of its pool's row `slot`; it grows with the pool.
    """

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        dtype,
        capacity: int = 256,
        device: torch.device | str | None = None,
    ):
        dtype = kv_dtype(dtype, device, head_dim)
        self.k = [torch.zeros(batch, n_kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(batch, n_kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(n_layers)]
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = 0
        self.pool: KVPool | None = None
        self.slot = -1

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def reserve(self, extra: int) -> None:
        need = self.length + extra
        if need <= self.capacity:
            return
        if self.pool is not None:
            self.pool.grow(need)  # rebinds this cache's views
            return
        new = max(need, 2 * self.capacity)
        grow = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], new - t.shape[2], t.shape[3])], dim=2)  # noqa: E731
        self.k = [grow(t) for t in self.k]
        self.v = [grow(t) for t in self.v]
        self.valid = torch.cat([self.valid, self.valid.new_zeros(self.valid.shape[0], new - self.capacity)], dim=1)

    def append(self, valid: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Claim slots for T new tokens (valid [B, T], False = padding); -> (first slot, RoPE positions [B, T])."""
        b, t = valid.shape
        start = self.length
        self.reserve(t)
        positions = (self.next_pos[:, None] + valid.long().cumsum(1) - 1).clamp(min=0)
        self.valid[:, start : start + t] = valid
        self.next_pos += valid.sum(1)
        self.length = start + t
        return start, positions

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (finished requests leave the batch)."""
        if self.pool is not None:
            raise ValueError("a pooled cache holds one request: drop it instead of selecting rows")
        self.k = [t[rows] for t in self.k]
        self.v = [t[rows] for t in self.v]
        self.valid, self.next_pos = self.valid[rows], self.next_pos[rows]

    def keep(self, start: int, slots: list[int]) -> None:
        """Keep only the new slots start + slots[i] (in order) of the last append (a tree's accepted
        path), moved to start + i; all rows valid (the engine's caches hold one request each)."""
        idx = torch.tensor(slots, device=self.valid.device) + start
        m = len(slots)
        for t in self.k + self.v:
            t[:, :, start : start + m] = t[:, :, idx]
        self.next_pos -= (self.length - start) - m
        self.valid[:, start + m : self.length] = False
        self.length = start + m

    def crop(self, length: int) -> None:
        """Drop slots from `length` on (all rows); positions roll back with them."""
        dropped = self.valid[:, length : self.length].sum(1)
        self.next_pos -= dropped
        self.valid[:, length : self.length] = False
        self.length = length


class KVPool:
    """Batch-1 caches of one model as rows of shared per-layer tensors [slots, Hkv, capacity, D].

    `take` hands out the lowest free row (so the live rows stay packed at the front), and a cache's
    row returns to the pool when the cache is garbage-collected (the engine drops a finished request's
    caches). The pool grows by doubling its rows, and its capacity to the longest request asked for
    and at least x1.5 (rounded up), copying live rows once and rebinding their caches.
    An empty pool frees its tensors, so an idle server holds no K/V.

    A pool read only by the C++ kernel (`lazy`: CPU, the kernel built, a dtype and head dim it takes) is
    allocated uninitialised: the kernel reads a row's valid slots and nothing else, so no slot needs zeros,
    and the operating system backs a page with memory when it is first written. Zero-filling made every
    resize touch all of the new tensors at once: at concurrency 32 (SmolLM2 float32, 32 rows of 256-320
    tokens, ~470 MB) one resize stalled a step 0.6-0.9 s on a 2-core VM (92k page faults at ~7 us each;
    1.5-4.5 s in busier runs). So a lazy pool takes its `rows` (an engine's max batch) at once, which costs
    nothing until written, grows its capacity x2, and a resize copies only what live caches wrote. The
    PyTorch attention path reads padding slots too (masked, but 0 x NaN is NaN): before it reads a lazy
    pool, `settle` zeroes every slot no live cache holds, and the pool allocates zeros from then on.
    Memory is rows x the longest capacity: one long request makes every row that long (a paged store
    would not; not needed yet).
    """

    ROUND = 64  # capacity granularity (tokens)

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str, rows: int = 0):
        """rows: how many requests are expected at once (an engine's max batch): a lazy pool's first allocation."""
        self.shape = (n_layers, n_kv_heads, head_dim)
        self.dtype, self.device = kv_dtype(dtype, device, head_dim), torch.device(device)
        if self.device.type == "cpu":
            attention_cpu.load()  # built (once per machine) now, not in the first request's step
        self.lazy = kernel_takes(self.device, self.dtype, head_dim)  # decided once: a pool is made with autograd on
        self.min_rows = max(rows, 1) if self.lazy else 1
        self.resizes, self.resize_s, self.resize_max_s = 0, 0.0, 0.0  # what resizing cost (the bench reports it)
        self.lock = threading.RLock()
        self._resizing = False
        self._alloc(0, 0)

    def _alloc(self, rows: int, capacity: int) -> None:
        n_layers, hkv, d = self.shape
        new = torch.empty if self.lazy else torch.zeros
        z = lambda: new(rows, hkv, capacity, d, dtype=self.dtype, device=self.device)  # noqa: E731
        self.k, self.v = [z() for _ in range(n_layers)], [z() for _ in range(n_layers)]  # per layer [rows, Hkv, C, D]
        self.valid = torch.zeros(rows, capacity, dtype=torch.bool, device=self.device)  # [rows, C]
        self.next_pos = torch.zeros(rows, dtype=torch.long, device=self.device)  # [rows]
        self.free = list(range(rows))  # a heap
        self.live: dict[int, weakref.ref] = {}

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def take(self, capacity: int) -> KVCache:
        """A new empty batch-1 cache of at least `capacity` tokens on the lowest free row."""
        with self.lock:
            if capacity > self.capacity or not self.free:
                self._resize(self.rows if self.free else max(self.min_rows, 2 * self.rows), self._grown(capacity))
            slot = heapq.heappop(self.free)
            self.valid[slot] = False
            self.next_pos[slot] = 0
            cache = KVCache.__new__(KVCache)
            cache.pool, cache.slot, cache.length = self, slot, 0
            self._bind(cache)
            self.live[slot] = weakref.ref(cache)
            weakref.finalize(cache, self._release, slot)
            return cache

    def grow(self, capacity: int) -> None:
        """Make every row hold at least `capacity` tokens (a cache outgrew its request's estimate)."""
        with self.lock:
            if capacity > self.capacity:
                self._resize(self.rows, self._grown(capacity))

    def _grown(self, capacity: int) -> int:
        """The capacity to resize to for a cache of `capacity` tokens: unchanged if it fits, else at least x1.5
        (x2 for a lazy pool, whose unwritten slots cost no memory): every resize copies the live rows, so
        requests of rising lengths pay for few of them."""
        if capacity <= self.capacity:
            return self.capacity
        return max(capacity, self.capacity * 2 if self.lazy else self.capacity * 3 // 2)

    def settle(self) -> None:
        """Zero every slot no live cache holds and allocate zeros from now on (see the class docstring):
        a lazy pool is about to be read by PyTorch's attention, which reads padding slots too."""
        with self.lock:
            if not self.lazy:
                return
            self.lazy = False
            held = torch.zeros(self.rows, self.capacity, dtype=torch.bool, device=self.device)  # [rows, C]: slots live caches wrote
            for slot, ref in self.live.items():
                cache = ref()
                if cache is not None:
                    held[slot, : cache.length] = True
            unwritten = ~held[:, None, :, None]  # [rows, 1, C, 1]
            for t in self.k + self.v:  # [rows, Hkv, C, D]
                t.masked_fill_(unwritten, 0)

    def _release(self, slot: int) -> None:
        with self.lock:
            if self.live.pop(slot, None) is None:
                return
            heapq.heappush(self.free, slot)
            if not self.live and not self._resizing:
                self._alloc(0, 0)

    def _resize(self, rows: int, capacity: int) -> None:
        t0 = time.perf_counter()
        capacity = -(-capacity // self.ROUND) * self.ROUND
        old_k, old_v, old_valid, old_pos, live = self.k, self.v, self.valid, self.next_pos, self.live
        r0, c0 = rk, ck = old_valid.shape
        if self.lazy:  # copy what live caches wrote: unwritten slots of the new tensors stay untouched
            rk, ck = max(live, default=-1) + 1, max((c.length for ref in live.values() if (c := ref()) is not None), default=0)
        self._resizing = True  # a cache collected meanwhile only frees its row
        self._alloc(rows, capacity)
        for new, old in zip(self.k + self.v, old_k + old_v):
            new[:rk, :, :ck] = old[:rk, :, :ck]
        self.valid[:r0, :c0] = old_valid
        self.next_pos[:r0] = old_pos
        self.live = live
        self.free = [s for s in range(rows) if s not in live]
        heapq.heapify(self.free)
        for ref in list(live.values()):
            cache = ref()
            if cache is not None:
                self._bind(cache)
        self._resizing = False
        took = time.perf_counter() - t0
        self.resizes, self.resize_s, self.resize_max_s = self.resizes + 1, self.resize_s + took, max(self.resize_max_s, took)

    def _bind(self, cache: KVCache) -> None:
        s = cache.slot
        cache.k = [t[s : s + 1] for t in self.k]  # views [1, Hkv, C, D]
        cache.v = [t[s : s + 1] for t in self.v]
        cache.valid, cache.next_pos = self.valid[s : s + 1], self.next_pos[s : s + 1]


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pool_of(model) -> KVPool:
    """The model's shared pool (`model.new_pool()`, made on first use; it dies with the model), for
    caches made outside an engine; it is made anew if the model moved to another dtype or device."""
    w = next(model.parameters())
    pool, made_for = _POOLS.get(model, (None, None))
    if pool is None or made_for != (w.dtype, w.device):
        pool = model.new_pool()
        _POOLS[model] = (pool, (w.dtype, w.device))
    return pool


def packed_slots(caches: list[KVCache], starts: list[int], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the packed tokens of pooled caches go: request i's n_i tokens at its row, slots starts[i] ..
    starts[i] + n_i. -> (pool row [N], cache slot [N], column within its request's block [N])."""
    dev = caches[0].pool.device
    lens_t = torch.tensor(lens, device=dev)
    rows = torch.tensor([c.slot for c in caches], device=dev).repeat_interleave(lens_t)
    cols = torch.cat([torch.arange(n, device=dev) for n in lens])
    return rows, cols + torch.tensor(starts, device=dev).repeat_interleave(lens_t), cols


class Ragged:
    """Where each token of a packed ragged batch sits in a pool, built once per forward for all layers.

    Request i (cache caches[i], pool row r_i) brings n_i new tokens at cache slots starts[i] ..
    starts[i] + n_i. `attend` writes their K/V there, then runs attention in two parts: the first
    `head` queries of every request in ONE call over the pool's rows lo..hi (queries padded to `head`:
    [P, Hq, head, D] against [P, Hkv, S, D], S = the furthest slot those queries read, a mask per
    row), and the queries beyond `head` of the requests that have more, one call each (a prefill, a
    long tree). `head` is the split that costs least: padding a short request to a long one's length
    multiplies attention work (scores and softmax over [P, Hq, head, S]), one call per request
    costs ~0.05 ms of overhead. A query sees the row's valid slots before its own block, then within
    its block its causal prefix (`causal`), its ancestors (`trees[i]`, [n_i, n_i] bool, nodes after
    their parents), or the whole block (`causal=False`, the drafter's bidirectional block).
    On a CPU, for inference, all of that is one call per layer of the row-invariant kernel instead
    (`invariant_kernel`; kernels/attention_cpu.py): no padding and no split, and each query's result is
    independent of the rest of the batch, which keeps bfloat16 verification lossless.
    """

    CALL = 500  # one attention call's overhead on one thread (~50 us), in units of reading one row x key of K/V (~0.1 us)
    QUERY = 0.7  # what each query adds per row x key, on one thread, in the same units
    PADDED = 2**21  # most score elements per head in the one padded call (fp32 scores of 9 heads: ~75 MB)

    def __init__(
        self,
        caches: list,
        starts: list[int],
        lens: list[int],
        causal: bool = True,
        trees: list[torch.Tensor | None] | None = None,
    ):
        pools = {id(c.pool) for c in caches}
        if len(pools) != 1 or caches[0].pool is None:
            raise ValueError("a ragged forward needs batch-1 caches of this model's pool (model.new_cache(1, ...))")
        self.pool = pool = caches[0].pool
        dev = pool.device
        self.rows, self.starts, self.lens = [c.slot for c in caches], starts, lens
        self.lo, self.hi = min(self.rows), max(self.rows) + 1
        self.tok_slot, self.tok_pos, self.tok_col = packed_slots(caches, starts, lens)
        trees = trees or [None] * len(lens)
        self.kernel = invariant_kernel(pool.device, pool.dtype, pool.shape[2])
        if self.kernel:  # one row-invariant kernel call per layer: what each request's queries see, no masks
            firsts = [0, *itertools.accumulate(lens)][:-1]
            offs = [0, *itertools.accumulate(n * n if t is not None else 0 for n, t in zip(lens, trees))][:-1]
            modes = [2 if t is not None else 0 if causal else 1 for t in trees]
            self.req = torch.tensor(list(zip(self.rows, starts, lens, firsts, modes, offs)), dtype=torch.long).view(-1, 6)
            flat = [t.reshape(-1).to("cpu", torch.bool) for t in trees if t is not None]
            self.tree_bits = torch.cat(flat) if flat else NO_TREES
            self.ctx = attention_cpu.context_slots(pool.valid, self.req)
            return
        pool.settle()  # PyTorch's attention reads padding slots too: they must hold numbers
        p = self.hi - self.lo
        self.head = head = self._split(p)
        lens_t, starts_t, rows_t = (torch.tensor(x, device=dev) for x in (lens, starts, self.rows))
        in_head = self.tok_col < head
        self.head_tok = in_head.nonzero()[:, 0]  # [Nh] packed index of the head queries
        self.dense = self.rows == list(range(self.lo, self.hi)) and all(n == head for n in lens)
        if head and not self.dense:  # where the padded call's queries come from and its outputs go
            head_row, head_col = self.tok_slot[in_head] - self.lo, self.tok_col[in_head]
            self.head_dst = head_row * head + head_col  # [Nh] each head query's place in the padded call's [P * head]
            self.pad_src = torch.full((p * head,), len(self.tok_slot), dtype=torch.long, device=dev)  # [P * head]: a query or the zero row
            self.pad_src[self.head_dst] = self.head_tok
        self.s = max(a + min(n, head) for a, n in zip(starts, lens))
        self.mask = self._head_mask(p, rows_t, starts_t, lens_t, causal, trees) if head else None  # [P, 1, head, S]
        self.tails = []  # (row, block start, n, packed slice of the queries past head, their mask [1, 1, n - head, start + n])
        first = 0
        for r, a, n, tree in zip(self.rows, starts, lens, trees):
            if n > head:
                ones = torch.ones(n, n, dtype=torch.bool, device=dev)
                blk = tree.to(dev) if tree is not None else ones.tril() if causal else ones
                m = torch.cat([pool.valid[r, :a].expand(n, a), blk], dim=1)[head:]  # [n - head, a + n]
                self.tails.append((r, a, n, slice(first + head, first + n), m[None, None]))
            first += n

    def _head_mask(self, p, rows_t, starts_t, lens_t, causal, trees) -> torch.Tensor:
        """[P, 1, head, S]: what each row's first `head` queries see (padding queries and rows outside
        the batch see slot 0 alone: finite, their outputs unused)."""
        dev, head = rows_t.device, self.head
        keys = torch.arange(self.s, device=dev)
        st_p = torch.zeros(p, dtype=torch.long, device=dev)  # [P] block start per row (0 outside the batch)
        st_p[rows_t - self.lo] = starts_t
        n_p = torch.zeros(p, dtype=torch.long, device=dev)
        n_p[rows_t - self.lo] = lens_t
        before = self.pool.valid[self.lo : self.hi, : self.s] & (keys[None] < st_p[:, None])  # [P, S] context slots
        rel = keys[None, None] - st_p[:, None, None]  # [P, 1, S] key index within the row's block
        last = torch.arange(head, device=dev)[None, :, None] if causal else n_p[:, None, None] - 1  # furthest block key
        mask = before[:, None] | ((rel >= 0) & (rel <= last))  # [P, head, S]
        for r, a, n, tree in zip(self.rows, self.starts, self.lens, trees):
            if tree is not None:
                h = min(n, head)
                mask[r - self.lo, :h, a : a + h] = tree[:h, :h].to(dev)
        mask[:, :, 0] |= ~mask.any(-1)
        return mask[:, None]

    def _split(self, p: int) -> int:
        """The head length (0 = no padded call, or one of the n_i) with the least estimated attention
        time, whose padded call stays within PADDED (a batch of long prefills attends per request).
        A call reads all its rows' K/V (memory-bound for short query blocks: ~0.1 us per row x key on
        two CPU cores) and costs ~0.07 us more per row x key x query and ~50 us of overhead: so a
        request attending alone after the padded call pays its K/V twice, and a mixed batch of short
        and long blocks may do best with no padded call at all. With t threads the reading and the
        arithmetic divide among them and a call's overhead does not, so the overhead weighs t times
        more, and each query's arithmetic 1/t as much against the reading (both fitted on mixed
        batches of 2-32 requests on the 2-core AVX-512 machine: a pick within 0.5% of the best
        split's time at two threads, where the one-thread constants lost 8%: a request verifying 4
        tokens among 7 plain ones attended alone at 0.70 ms a layer where padding all 8 to 4 queries
        took 0.35)."""
        t = torch.get_num_threads() if self.pool.device.type == "cpu" else 1

        def call(rows_keys: int, queries: int) -> float:  # in units of ~0.1 us
            return self.CALL * t + rows_keys * (1 + self.QUERY / t * queries)

        best, best_cost = 0, sum(call(a + n, n) for a, n in zip(self.starts, self.lens))
        for h in sorted(set(self.lens)):
            s = max(a + min(n, h) for a, n in zip(self.starts, self.lens))
            if p * h * s > self.PADDED:
                break
            cost = call(p * s, h) + sum(call(a + n, n - h) for a, n in zip(self.starts, self.lens) if n > h)
            if cost < best_cost:
                best, best_cost = h, cost
        return best

    def attend(self, attn, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] of the packed tokens (RoPE applied) -> [N, Hq*D] before o_proj."""
        pk, pv = self.pool.k[layer], self.pool.v[layer]
        pk[self.tok_slot, :, self.tok_pos] = k.to(pk.dtype)
        pv[self.tok_slot, :, self.tok_pos] = v.to(pv.dtype)
        if self.kernel:
            return attention_cpu.ragged_attention(q, pk, pv, self.req, self.tree_bits, self.ctx)
        if self.dense:  # every row of lo..hi in order with `head` tokens: no scatter, no gather
            qp = q.view(self.hi - self.lo, self.head, *q.shape[1:]).transpose(1, 2)  # [P, Hq, head, D]
            out = attn.attend_heads(qp, pk[self.lo : self.hi, :, : self.s], pv[self.lo : self.hi, :, : self.s], self.mask)
            return out.view(q.shape[0], -1)

        def alone(r: int, a: int, n: int, idx: slice, m: torch.Tensor) -> torch.Tensor:  # -> [len(idx), Hq*D]
            return attn.attend_heads(q[idx].transpose(0, 1)[None], pk[r : r + 1, :, : a + n], pv[r : r + 1, :, : a + n], m)[0]

        if not self.head:  # every request on its own, in packed order
            return torch.cat([alone(*t) for t in self.tails])
        # gathers, not scatters into zeros: index_select is the cheap indexing op on a CPU
        qz = torch.cat([q, q.new_zeros(1, *q.shape[1:])])  # [N + 1, Hq, D]: the last row pads
        qp = qz.index_select(0, self.pad_src).view(self.hi - self.lo, self.head, *q.shape[1:])  # [P, head, Hq, D]
        heads = attn.attend_heads(qp.transpose(1, 2), pk[self.lo : self.hi, :, : self.s], pv[self.lo : self.hi, :, : self.s], self.mask)
        heads = heads.reshape(-1, heads.shape[-1]).index_select(0, self.head_dst)  # [Nh, Hq*D]
        if not self.tails:  # every query in the padded call, in packed order
            return heads
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # [N, Hq*D]
        out[self.head_tok] = heads
        for t in self.tails:  # the queries past `head` of longer requests: [n - head, Hq*D] each
            out[t[3]] = alone(*t)
        return out
