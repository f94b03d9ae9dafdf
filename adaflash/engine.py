"""Continuous-batching speculative engine (no HTTP, no tokenizer).

Each `step()` admits waiting requests (prefill packed into one forward), drafts one block per
running request (one drafter pass for all; a fixed or EMA policy drafts only the positions it will
verify, the length head the block length it was fitted on, since it reads the block), lets the
verify-length policy choose how many tokens each request verifies, verifies all of them in ONE
packed target forward (ragged: no padding to the longest), commits accepted + 1 per request and
retires finished requests. Requests join and leave between steps. Greedy output equals
single-request output; sampling is lossless.

Prompt lookup (`lookup` L > 0): a request whose text ends in an n-gram (at least `lookup_min`
tokens) that occurred earlier in its prompt or output verifies the up to L tokens that followed it
(spec.lookup_chain) instead of drafting: it skips the drafter pass and the verify-length policy that
step. Sampling stays lossless (the chain is a deterministic proposal, q = one-hot). The trajectory
buffer gets drafter rounds only.

Admission is bounded by a token budget per step: an exponential moving average of each request's
recent verify lengths estimates its next demand, and verify lengths are trimmed if a step would
exceed the budget, so the engine never over-commits.

Hot-swap: `swap()` (any thread) stages a new drafter (+ length head, version); the next step makes
it live for requests admitted from then on. A running request keeps the drafter it started with,
because its drafter KV cache was built by that drafter's projections; the old one is dropped when
its last request finishes. So a swap never stalls a step and never fails a request.

The engine keeps no finished request: `step()` retires them with their KV caches released (the
state keeps its tokens, rounds and drafter version for the response and the trajectory row) and
returns them; whoever collects them decides how long they live.
"""

from __future__ import annotations

import re
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from adaflash.buffer import Round, Trajectory
from adaflash.drafter import Drafter
from adaflash.spec import lookup_chain, pick, propose, verify
from adaflash.target import KVCache, TargetModel


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    domain: str | None = None
    stop: Callable[[list[int]], int | None] | None = None  # output ids -> keep this many and stop, or None


@dataclass
class DrafterSlot:
    """A live drafter with its length head and registry version."""

    drafter: Drafter | None
    head: object | None = None  # LengthHead trained on this drafter's block states
    version: str = "0"


@dataclass
class RequestState:
    req: Request
    slot: DrafterSlot
    tcache: KVCache | None  # None before admission and once retired
    dcache: KVCache | None
    gen: torch.Generator
    admitted: bool = False  # prefilled (got a first token); stays True after the caches are released
    out: list[int] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    ema_verify: float = 0.0
    finish_reason: str | None = None
    t_start: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0

    @property
    def tau(self) -> float:
        return (len(self.out) - 1) / len(self.rounds) if self.rounds else 1.0


class VerifyPolicy(ABC):
    """Chooses each request's verify length (tokens verified incl. the anchor, 1..K)."""

    name = "base"
    drafts = True

    @abstractmethod
    def lengths(self, states: list[RequestState], hidden: torch.Tensor | None, k_blk: int) -> tuple[list[int], list[float]]:
        """-> (verify length per request, length-head prediction per request or nan)."""

    def observe(self, states: list[RequestState], accepted: list[int]) -> None:
        """Called after verification with each request's accepted draft count."""

    def draft_len(self, k_blk: int, head=None) -> int:
        """Block positions to draft this step: a policy that knows its lengths before drafting asks
        for no more than it verifies; the length head reads the drafted block, so it gets the block
        length it was fitted on (`head`: the live slot's head)."""
        return k_blk


class FixedPolicy(VerifyPolicy):
    """Always verify k tokens (DFlash: k = block size)."""

    def __init__(self, k: int | None = None):
        self.k, self.name = k, f"fixed{k or ''}"

    def lengths(self, states, hidden, k_blk):
        return [self.draft_len(k_blk)] * len(states), [float("nan")] * len(states)

    def draft_len(self, k_blk, head=None):
        return min(self.k or k_blk, k_blk)


class ARPolicy(VerifyPolicy):
    """No speculation: verify only the last token (plain decoding through the same engine)."""

    name, drafts = "ar", False

    def lengths(self, states, hidden, k_blk):
        return [1] * len(states), [float("nan")] * len(states)


class EMAPolicy(VerifyPolicy):
    """SGLang's approach: an EMA of recent accepted lengths picks ONE verify length per batch."""

    name = "ema"

    def __init__(self, alpha: float = 0.2, rate: float = 1.3, min_len: int = 2, init: float = 4.0):
        self.alpha, self.rate, self.min_len, self.ema = alpha, rate, min_len, init

    def lengths(self, states, hidden, k_blk):
        return [self.draft_len(k_blk)] * len(states), [float("nan")] * len(states)

    def draft_len(self, k_blk, head=None):
        return max(self.min_len, min(k_blk, round((self.ema + 1) * self.rate)))

    def observe(self, states, accepted):
        if accepted:
            self.ema = (1 - self.alpha) * self.ema + self.alpha * (sum(accepted) / len(accepted))


class HeadPolicy(VerifyPolicy):
    """AdaFlash: the length head predicts each block's acceptance rate; verify only what is likely kept."""

    name = "head"

    def __init__(self, head):
        if head is None:
            raise ValueError("verify policy 'head' needs a length head beside the drafter: run `adaflash fit-head` first")
        self.head = head

    def draft_len(self, k_blk, head=None):
        return min((head or self.head).config.block_size, k_blk)  # a head fitted on L-blocks reads L-blocks

    def lengths(self, states, hidden, k_blk):
        from adaflash.length_head import verify_length

        head = states[0].slot.head or self.head  # the head that belongs to these requests' drafter
        c = head.config
        with torch.no_grad():
            pred = head(hidden.float())  # [R]
        lens = verify_length(pred, self.draft_len(k_blk, head), c.rate, c.min_len)  # at most the drafted block
        return lens.tolist(), pred.tolist()


POLICIES: dict[str, Callable[[object], VerifyPolicy]] = {  # name -> policy, given the drafter's length head or None
    "ar": lambda head: ARPolicy(),
    "fixed": lambda head: FixedPolicy(),
    "ema": lambda head: EMAPolicy(),
    "head": HeadPolicy,
}
POLICY_NAMES = f"auto, {', '.join(POLICIES)}, fixedK (e.g. fixed8)"


def known_policy(name: str) -> bool:
    return name == "auto" or name in POLICIES or re.fullmatch(r"fixed[1-9][0-9]*", name) is not None


def make_policy(name: str, head=None) -> VerifyPolicy:
    """The verify policy called `name` (POLICY_NAMES): fixedK verifies K tokens; auto is the length head
    when the drafter has one (`head`), else fixed."""
    if not known_policy(name):
        raise ValueError(f"unknown verify policy {name!r}; valid: {POLICY_NAMES}")
    if name == "auto":
        name = "head" if head is not None else "fixed"
    return FixedPolicy(int(name[5:])) if name not in POLICIES else POLICIES[name](head)


class Engine:
    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter | None,
        policy: VerifyPolicy,
        eos_ids: list[int],
        max_batch: int = 32,
        token_budget: int = 512,
        ema_alpha: float = 0.3,
        keep_hidden: bool = False,
        head=None,
        version: str = "0",
        lookup: int = 0,
        lookup_min: int = 2,
    ):
        if policy.drafts and drafter is None:
            raise ValueError(f"policy {policy.name} needs a drafter")
        if lookup < 0 or not 1 <= lookup_min <= 3:
            raise ValueError(f"lookup must be >= 0 (got {lookup}) and lookup_min 1..3 (got {lookup_min})")
        self.lookup, self.lookup_min = lookup, lookup_min
        self.target, self.policy = target, policy
        self.slot = DrafterSlot(drafter, head, version)
        self._lock = threading.Lock()
        self._pending: DrafterSlot | None = None
        self._cancel: set[str] = set()
        self.eos = set(eos_ids)
        self.max_batch, self.token_budget, self.ema_alpha = max_batch, token_budget, ema_alpha
        self.keep_hidden = keep_hidden
        self.k_blk = drafter.block_size if drafter is not None else 1
        self.max_verify = max(self.k_blk, lookup + 1)  # the most tokens a request appends in one step
        self.waiting: deque[Request] = deque()
        self.running: list[RequestState] = []
        self.stats = {"steps": 0, "verify_tokens": 0, "committed": 0, "max_step_tokens": 0, "swaps": 0}

    @property
    def drafter(self) -> Drafter | None:
        return self.slot.drafter

    @property
    def version(self) -> str:
        return self.slot.version

    def swap(self, drafter: Drafter, head=None, version: str = "0") -> None:
        """Stage a new drafter (thread-safe); it goes live at the start of the next step."""
        if drafter.block_size != self.k_blk:
            raise ValueError(f"drafter block size {drafter.block_size} != engine block size {self.k_blk}")
        with self._lock:
            self._pending = DrafterSlot(drafter, head, version)

    def cancel(self, request_id: str) -> None:
        """Cancel a waiting or running request (thread-safe); it finishes with reason 'cancelled'."""
        with self._lock:
            self._cancel.add(request_id)

    def apply_swap(self) -> bool:
        """Make a staged drafter live now; step() calls it, an idle server calls it between polls."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        self.slot = pending
        self.stats["swaps"] += 1
        return True

    def _apply_control(self) -> list[RequestState]:
        self.apply_swap()
        with self._lock:
            cancel, self._cancel = self._cancel, set()
        dropped = []
        if cancel:
            keep = deque()
            for r in self.waiting:
                if r.request_id in cancel:
                    dropped.append(RequestState(r, self.slot, None, None, None, finish_reason="cancelled"))
                else:
                    keep.append(r)
            self.waiting = keep
            for s in self.running:
                if s.req.request_id in cancel and s.finish_reason is None:
                    s.finish_reason = "cancelled"
        return dropped

    def submit(self, req: Request) -> None:
        limit = self.target.config.max_position_embeddings
        if len(req.prompt_ids) + req.max_new_tokens + self.max_verify > limit:
            raise ValueError(
                f"request {req.request_id}: prompt of {len(req.prompt_ids)} tokens + max_new_tokens "
                f"{req.max_new_tokens} exceeds the target's context of {limit}"
            )
        if len(req.prompt_ids) > self.token_budget:
            raise ValueError(
                f"request {req.request_id}: prompt of {len(req.prompt_ids)} tokens exceeds the step token budget {self.token_budget}"
            )
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def demand(self) -> float:
        """Estimated verify tokens of the running requests next step (EMA of their recent lengths)."""
        return sum(max(1.0, s.ema_verify) for s in self.running)

    # ------------------------------------------------------------------ step phases

    def _admit(self) -> list[RequestState]:
        new, budget = [], self.token_budget - self.demand()
        dev = self.target.lm_head.weight.device
        while self.waiting and len(self.running) + len(new) < self.max_batch and len(self.waiting[0].prompt_ids) <= budget:
            req = self.waiting.popleft()
            budget -= len(req.prompt_ids)
            cap = len(req.prompt_ids) + req.max_new_tokens + self.max_verify + 1
            st = RequestState(
                req,
                self.slot,
                self.target.new_cache(1, cap),
                self.drafter.new_cache(1, cap) if self.policy.drafts else None,
                torch.Generator(device=dev).manual_seed(req.seed),
                t_start=time.perf_counter(),
            )
            st.ema_verify, st.admitted = float(self.k_blk), True
            new.append(st)
        if not new:
            return []
        logits, feats = self.target.forward_packed(
            [torch.tensor(s.req.prompt_ids) for s in new], [s.tcache for s in new], logits_last_only=True
        )
        if self.policy.drafts:
            self.slot.drafter.extend_many(feats, [s.dcache for s in new])
        for st, lg in zip(new, logits):
            st.t_first = time.perf_counter()
            self._commit(st, [int(pick(lg[-1], st.req.temperature, st.gen))])
        return new

    def _commit(self, st: RequestState, tokens: list[int]) -> None:
        """Append tokens, applying EOS / max_new_tokens / custom stop; mark finished."""
        for t in tokens:
            st.out.append(t)
            if t in self.eos:
                st.finish_reason = "stop"
                break
            if len(st.out) >= st.req.max_new_tokens:
                st.finish_reason = "length"
                break
        if st.req.stop is not None and st.finish_reason is None:
            keep = st.req.stop(st.out)
            if keep is not None:
                del st.out[keep:]
                st.finish_reason = "stop"

    def step(self) -> list[RequestState]:
        """One engine step; returns the requests that finished in it, their KV caches released (the engine
        keeps no reference to them: a finished request's caches and an old drafter are freed with it)."""
        cancelled = self._apply_control()
        self.running += self._admit()
        active = [s for s in self.running if s.finish_reason is None]
        if active:
            self._speculate(active)
        done = cancelled + [s for s in self.running if s.finish_reason is not None]
        for s in done:
            s.t_done = time.perf_counter()
            s.tcache = s.dcache = None
        self.running = [s for s in self.running if s.finish_reason is None]
        self.stats["steps"] += 1
        return done

    def _chains(self, active: list[RequestState]) -> list[list[int]]:
        """Prompt-lookup chain per request ([] = none, or lookup off), never past max_new_tokens."""
        if not self.lookup:
            return [[] for _ in active]
        return [
            lookup_chain(s.req.prompt_ids + s.out, min(self.lookup, s.req.max_new_tokens - len(s.out) - 1), min_ngram=self.lookup_min)
            for s in active
        ]

    def _speculate(self, active: list[RequestState]) -> None:
        k_blk = self.k_blk
        dev = self.target.lm_head.weight.device
        last = torch.tensor([s.out[-1] for s in active], device=dev)
        chains = self._chains(active)
        drafting = [i for i, c in enumerate(chains) if not c] if self.policy.drafts else []
        groups = self._groups(active, drafting)  # drafting requests per live drafter (several only around a swap)
        lens, preds = [1] * len(active), [float("nan")] * len(active)
        hidden: list[torch.Tensor | None] = [None] * len(active)
        if not self.policy.drafts:
            lens, preds = self.policy.lengths(active, None, k_blk)
        for slot, idx in groups:
            hd = slot.drafter.draft_many([active[i].dcache for i in idx], last[idx], self.policy.draft_len(k_blk, slot.head))  # [r, L, H]
            gl, gp = self.policy.lengths([active[i] for i in idx], hd, k_blk)
            for j, i in enumerate(idx):
                hidden[i], lens[i], preds[i] = hd[j], gl[j], gp[j]
        for i, c in enumerate(chains):
            if c:
                lens[i] = 1 + len(c)
        lens = [max(1, min(n, s.req.max_new_tokens - len(s.out))) for n, s in zip(lens, active)]  # never past the budget
        lens = self._fit_budget(lens)
        draft_logits = self._draft_logits(groups, hidden, lens)
        drafts, qs = [], []
        vocab_size = self.target.config.vocab_size
        for i, (s, n) in enumerate(zip(active, lens)):
            d, q = torch.zeros(0, dtype=torch.long, device=dev), None
            if chains[i]:
                d = torch.tensor(chains[i][: n - 1], dtype=torch.long, device=dev)
                if s.req.temperature > 0:  # a deterministic proposal: q is one-hot on it
                    q = torch.zeros(len(d), vocab_size, device=dev).scatter_(1, d[:, None], 1.0)  # [k, V]
            elif n > 1:
                dr = s.slot.drafter
                d, q = propose(draft_logits[i][: n - 1], s.req.temperature, s.gen, dr.vocab, dr.vocab_size)  # [k], [k, V] or None
            drafts.append(d)
            qs.append(q)
        inputs = [torch.cat([last[i : i + 1], d]) for i, d in enumerate(drafts)]
        logits, feats = self.target.forward_packed(inputs, [s.tcache for s in active])
        self.stats["verify_tokens"] += sum(lens)
        self.stats["max_step_tokens"] = max(self.stats["max_step_tokens"], sum(lens))
        accepted, new_feats = [], []
        for i, s in enumerate(active):
            d, lg, k = drafts[i], logits[i], lens[i] - 1  # lg: [k+1, V]
            n, nxt = verify(d, qs[i], lg, s.req.temperature, s.gen)
            t_ns = time.time_ns()
            s.tcache.crop(s.tcache.length - (k - n))
            new_feats.append(feats[i][: 1 + n])
            before = len(s.out)
            s.rounds.append(
                Round(
                    anchor=len(s.req.prompt_ids) + before - 1,
                    draft=d.tolist(),
                    target=lg[:k].argmax(-1).tolist(),
                    accepted=n,
                    verify_len=lens[i],
                    pred=preds[i],
                    t_ns=t_ns,
                    hidden=hidden[i].clone() if self.keep_hidden and hidden[i] is not None else None,
                    source="lookup" if chains[i] else "drafter",
                )
            )
            self._commit(s, d[:n].tolist() + [nxt])
            self.stats["committed"] += len(s.out) - before
            s.ema_verify = (1 - self.ema_alpha) * s.ema_verify + self.ema_alpha * lens[i]
            accepted.append(n)
        if self.policy.drafts:
            for slot, idx in self._groups(active, range(len(active))):  # every request's context grows
                slot.drafter.extend_many([new_feats[i] for i in idx], [active[i].dcache for i in idx])
        self.policy.observe([active[i] for i in drafting], [accepted[i] for i in drafting])

    @staticmethod
    def _draft_logits(groups, hidden: list[torch.Tensor], lens: list[int]) -> list[torch.Tensor | None]:
        """Draft logits only for the positions each request verifies: hidden[i] [K, H] -> [lens[i]-1, Vd].
        One LM-head call per drafter over the packed rows."""
        out: list[torch.Tensor | None] = [None] * len(hidden)
        for slot, idx in groups:
            idx = [i for i in idx if lens[i] > 1]
            if not idx:
                continue
            rows = torch.cat([hidden[i][1 : lens[i]] for i in idx])  # [sum(len-1), H]
            for i, lg in zip(idx, slot.drafter.logits(rows).split([lens[i] - 1 for i in idx])):
                out[i] = lg  # [lens[i]-1, Vd] over the drafter's draft vocabulary
        return out

    @staticmethod
    def _groups(active: list[RequestState], idx) -> list[tuple[DrafterSlot, list[int]]]:
        """Indices `idx` of `active` grouped by their drafter slot."""
        groups: dict[int, tuple[DrafterSlot, list[int]]] = {}
        for i in idx:
            groups.setdefault(id(active[i].slot), (active[i].slot, []))[1].append(i)
        return list(groups.values())

    def _fit_budget(self, lens: list[int]) -> list[int]:
        """Trim the longest verify lengths until the step fits the token budget (each keeps >= 1)."""
        lens = list(lens)
        while sum(lens) > self.token_budget and max(lens) > 1:
            i = lens.index(max(lens))
            lens[i] -= 1
        return lens

    @staticmethod
    def trajectory(st: RequestState, writer_id: str) -> Trajectory:
        """A finished request as a trajectory-buffer row; its drafter rounds only (the buffer describes the drafter)."""
        rounds = [r for r in st.rounds if r.source == "drafter"]
        return Trajectory(
            st.req.request_id, writer_id, st.slot.version, list(st.req.prompt_ids), list(st.out), rounds, domain=st.req.domain
        )

    def run(self, requests: list[Request]) -> list[RequestState]:
        """Submit all, step until every request finished; -> states in submission order."""
        for r in requests:
            self.submit(r)
        order = {r.request_id: i for i, r in enumerate(requests)}
        done = []
        while not self.idle:
            done += self.step()
        return sorted(done, key=lambda s: order[s.req.request_id])
