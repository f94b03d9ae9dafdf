"""Continuous-batching speculative engine (no HTTP, no tokenizer).

Each `step()` admits waiting requests (their prompts packed into the step's verify forward), drafts one block per
running request (one drafter pass for all; a fixed or EMA policy drafts only the positions it will
verify, the length head the block length it was fitted on, since it reads the block), lets the
verify-length policy choose how many tokens each request verifies (before drafting, a policy may
also leave a request undrafted for the step: `VerifyPolicy.select`, the cost policy's plain-decoding
fallback), verifies all of them in ONE packed target forward (ragged: no padding to the longest),
commits accepted + 1 per request and retires finished requests. Requests join and leave between steps. Greedy output equals
single-request output; sampling is lossless, and a seeded request's text is the target's own seeded sample
token for token (spec: per-position noise), whatever its rounds. A request's drafter cache takes the target features of its
new text only when it drafts next (`_extend_context`), so a step where it does not draft costs no drafter work.

Token trees (`tree` N > 0, greedy and seeded requests): a request verifies the N most likely paths through
its drafter's block (spec.build_tree) as a token tree in the same packed forward (each node attends to
its ancestors, spec.tree_mask), walks down the accepted path (spec.walk_tree, from the target's token
after every node) and keeps only that path's K/V; the verify-length policy then decides for unseeded
sampled requests alone, which verify chains (a lossless multi-candidate rule for the rejection rule would
need candidates drawn from q, not its top tokens).

Prompt lookup (`lookup` L > 0): a request whose text ends in an n-gram (at least `lookup_min`
tokens) that occurred earlier in its prompt or output proposes the up to L tokens that followed it
(spec.lookup_chain). A tree grafts this chain into itself as one more path (spec.graft); a chain
request verifies the part of it the policy keeps (`lookup_lengths`: all of it, except for the cost
policy) instead of drafting, skipping the drafter pass that step, and drafts when the policy keeps
none of it. Sampling stays lossless (the chain is a deterministic proposal, q = one-hot). The trajectory
buffer gets drafter rounds only (a tree round is one: its drafter drafted at that anchor).

Single-request generation (`adaflash generate`, the pretraining eval) is this engine at batch 1.

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

import random
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from adaflash.buffer import Round, Trajectory
from adaflash.cost import attention_pairs
from adaflash.drafter import Drafter
from adaflash.policies import ARPolicy, FixedPolicy, VerifyPolicy
from adaflash.request import DrafterSlot, Request, RequestState
from adaflash.spec import build_tree, graft, greedy, lookup_chain, noise, pick, propose, tree_mask, verify, walk_tree
from adaflash.target import TargetModel

ENTROPY = random.Random()  # unseeded sampled requests' generator seeds (tests seed it for repeatable statistics)


@dataclass
class _Plan:
    """One running request's round within a step, filled in phase by phase (_plan, _draft, _propose, _verify)."""

    st: RequestState
    kind: str  # "tree" (token tree), "lookup" (verify `chain` instead of drafting), "draft" (a drafter chain), "plain",
    # "prefill" (admitted this step: its prompt rides in the step's forward, which gives its first token)
    chain: list[int]  # prompt-lookup proposal ([] = none); a tree grafts it in
    budget: int  # drafts that could still be committed (RequestState.budget)
    verify_len: int = 1  # tokens verified incl. the anchor
    pred: float = float("nan")  # length-head prediction
    hidden: torch.Tensor | None = None  # [L, H] drafter block states
    rows: int = 0  # block positions whose draft logits are needed (a tree's depth)
    logits: torch.Tensor | None = None  # [rows, Vd] draft logits
    draft: torch.Tensor | None = None  # [k] chain drafts, or [N] tree node tokens
    q: torch.Tensor | None = None  # [k, V] proposal distribution when sampling unseeded
    parents: torch.Tensor | None = None  # [N] tree node parents (0 = the anchor)
    mask: torch.Tensor | None = None  # [N+1, N+1] tree ancestor mask over [anchor, nodes]


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
        tree: int = 0,
        keep_features: bool = False,
    ):
        if keep_features and policy.drafts:
            raise ValueError(f"keep_features needs a plain-decoding policy (got {policy.name}): a drafter consumes the features")
        if policy.drafts and drafter is None:
            raise ValueError(f"policy {policy.name} needs a drafter")
        if lookup < 0 or not 1 <= lookup_min <= 3:
            raise ValueError(f"lookup must be >= 0 (got {lookup}) and lookup_min 1..3 (got {lookup_min})")
        if tree < 0 or (tree and not policy.drafts):
            raise ValueError(f"tree must be >= 0 (got {tree}) and needs a drafting policy (got {policy.name})")
        # every fed token's target features, kept on the request (`RequestState.features` once it is done):
        # regeneration's training data, recorded while decoding
        self.keep_features = keep_features
        self.keep_context = policy.drafts or keep_features  # fed tokens' features queue on the request (`add_context`)
        self.lookup, self.lookup_min, self.tree = lookup, lookup_min, tree
        self.target, self.policy = target, policy
        # the policy's step timings wait for queued GPU work; read once: `_clock` runs ~4 times a step, and the
        # module attribute walk to the device cost ~20 us a call on a CPU
        self._sync = policy.timed and target.lm_head.weight.device.type == "cuda"
        self.slot = DrafterSlot(drafter, head, version)
        self.pool = target.new_pool(max_batch)  # the target caches of this engine's requests
        self._lock = threading.Lock()
        self._pending: DrafterSlot | None = None
        self._cancel: set[str] = set()
        self.eos = set(eos_ids)
        self.max_batch, self.token_budget, self.ema_alpha = max_batch, token_budget, ema_alpha
        self.keep_hidden = keep_hidden
        self.k_blk = drafter.block_size if drafter is not None else 1
        tree_len = 1 + tree + min(lookup, self.k_blk - 1) if tree else 0
        self.max_verify = max(self.k_blk, lookup + 1, tree_len)  # the most tokens a request appends in one step
        # a new request's expected verify tokens a step (for admission): what this engine's rounds have
        # verified lately (1 before any), not the whole block; a policy that mostly decodes plainly admitted
        # prompts as if every newcomer would verify 16 tokens, and so prefilled in more, smaller calls than
        # plain decoding. A step that would verify more than the budget is trimmed (`_fit_budget`).
        self.ema_verify_all = 1.0
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
                self.pool.take(cap),
                self.slot.new_cache(cap, self.max_batch) if self.policy.drafts else None,
                torch.Generator(device=dev).manual_seed(ENTROPY.getrandbits(63)) if req.seed is None and req.temperature > 0 else None,
                t_start=time.perf_counter(),
            )
            st.ema_verify = self.ema_verify_all
            new.append(st)
        return new  # prefilled in this step's forward, beside the running requests' verify tokens (_speculate)

    def _commit(self, st: RequestState, tokens: list[int]) -> None:
        """Append tokens, applying EOS (unless ignored) / max_new_tokens / custom stop; mark finished."""
        eos = () if st.req.ignore_eos else self.eos
        for t in tokens:
            st.out.append(t)
            if t in eos:
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

    def _first_token(self, st: RequestState, logits: torch.Tensor, feats: torch.Tensor, best: int) -> None:
        """A request prefilled this step: logits [1, V] of its prompt's last token (best: their argmax), feats [prompt, n*H]."""
        if self.keep_context:
            st.add_context(feats)
        st.t_first, st.admitted = time.perf_counter(), True
        if st.req.temperature <= 0:
            self._commit(st, [best])
            return
        e = self._noise(st, 1)
        self._commit(st, [int(pick(logits[-1], st.req.temperature, st.gen, None if e is None else e[0]))])

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
            s.tcache = s.dcache = s.noise = None
            if self.keep_features and s.context:
                s.features = s.take_context()
            s.context, s.context_tokens = [], 0
        self.running = [s for s in self.running if s.finish_reason is None]
        self.stats["steps"] += 1
        return done

    def _plan(self, st: RequestState) -> _Plan:
        """How this request's round goes: a greedy or seeded request of a tree engine verifies a token tree (with
        its lookup chain grafted in); otherwise a lookup chain replaces drafting, or the drafter drafts."""
        if not st.admitted:
            return _Plan(st, "prefill", [], 0, verify_len=len(st.req.prompt_ids))
        budget = st.budget
        tree = self.tree > 0 and st.gen is None
        chain = []
        if self.lookup:
            n = min(self.lookup, budget, self.k_blk - 1) if tree else min(self.lookup, budget)
            chain = lookup_chain(st.req.prompt_ids + st.out, n, min_ngram=self.lookup_min)
        if tree:
            kind = "tree" if budget > 0 else "plain"
        elif chain:
            kind = "lookup"
        else:
            kind = "draft" if self.policy.drafts else "plain"
        return _Plan(st, kind, chain, budget)

    def _speculate(self, active: list[RequestState]) -> None:
        """One round for every active request: plan, draft, size to the token budget, propose, verify all
        of them in one packed target forward, commit, and grow the drafters' contexts."""
        t_step = self._clock() if self.policy.timed else 0.0
        plans = [self._plan(s) for s in active]
        fresh = [p for p in plans if p.kind == "prefill"]
        prompts = sum(p.verify_len for p in fresh)  # admission left room for them in the token budget
        self.policy.prompts(len(fresh), prompts)
        self._select(plans)
        drafted = self._draft(plans)
        plans = [p for p in plans if p.kind != "prefill"]  # the rounds
        for p in plans:  # chains never verify past max_new_tokens (a tree caps its depth instead)
            if p.kind != "tree":
                p.verify_len = max(1, min(p.verify_len, p.budget + 1))
        for p, n in zip(plans, self._fit_budget([p.verify_len for p in plans], prompts)):
            p.verify_len = n
        self._propose(plans)
        dev = self.target.lm_head.weight.device
        inputs = [torch.tensor(p.st.req.prompt_ids, device=dev) for p in fresh]  # [prompt] each
        inputs += [torch.cat([torch.tensor(p.st.out[-1:], device=dev), p.draft]) for p in plans]  # [verify_len] each
        t0 = self._clock()
        logits, feats = self.target.forward_packed(
            inputs, [p.st.tcache for p in fresh + plans], logits_last_only=[True] * len(fresh) + [False] * len(plans),
            trees=[None] * len(fresh) + [p.mask for p in plans],
        )  # fmt: skip
        tokens = sum(p.verify_len for p in plans)
        if self.policy.timed:
            secs = self._clock() - t0
            qk = attention_pairs([p.verify_len for p in plans], [p.st.tcache.length - p.verify_len for p in plans])  # prompts: none cached
            self.policy.observe_timing((len(fresh) + len(plans), prompts + tokens, secs, qk), drafted)
        flat = greedy(logits.flat).tolist()  # [N] every row's argmax, in one call for the whole step
        best, at = [], 0
        for lg in logits:
            best.append(flat[at : at + len(lg)])
            at += len(lg)
        for p, lg, ft, b in zip(fresh, logits, feats, best):
            self._first_token(p.st, lg, ft, b[-1])
        logits, feats, best = logits[len(fresh) :], feats[len(fresh) :], best[len(fresh) :]
        self.stats["verify_tokens"] += tokens
        self.stats["max_step_tokens"] = max(self.stats["max_step_tokens"], tokens)
        new_feats = [self._verify(p, lg, ft, b) for p, lg, ft, b in zip(plans, logits, feats, best)]
        if plans:
            self.ema_verify_all += self.ema_alpha * (tokens / len(plans) - self.ema_verify_all)
        if self.keep_context:  # the drafter reads them when this request drafts next (_draft)
            for p, ft in zip(plans, new_feats):
                p.st.add_context(ft)
        chains = [p for p in plans if p.kind == "draft"]
        self.policy.observe([p.st for p in chains], [p.st.rounds[-1].accepted for p in chains])
        looks = [p for p in plans if p.kind == "lookup"]
        if looks:
            self.policy.observe_lookup([p.st for p in looks], [p.st.rounds[-1].accepted for p in looks])
        if self.policy.timed:
            self.policy.observe_step(self._clock() - t_step)

    def _select(self, plans: list[_Plan]) -> None:
        """The policy sizes prompt-lookup chains (a request whose chain it refuses may draft instead) and
        may keep drafting requests from drafting this step: they verify their anchor alone."""
        looks = [p for p in plans if p.kind == "lookup"]
        if looks:
            keep = self.policy.lookup_lengths([p.st for p in looks], [len(p.chain) for p in looks], len(plans) - len(looks))
            for p, n in zip(looks, keep):
                p.chain = p.chain[:n]
                if not p.chain:
                    p.kind = "draft" if self.policy.drafts else "plain"
        cands = [p for p in plans if p.kind == "draft"]
        if not cands:
            return
        others = [p for p in plans if p.kind != "draft"]
        sizes = {
            "lookup": lambda p: 1 + len(p.chain),
            "tree": lambda p: 1 + self.tree + len(p.chain),
            "plain": lambda p: 1,
            "prefill": lambda p: p.verify_len,
        }
        for p, keep in zip(cands, self.policy.select([p.st for p in cands], (len(others), sum(sizes[p.kind](p) for p in others)))):
            if not keep:
                p.kind = "plain"

    def _clock(self) -> float:
        """Wall clock for the policy's step timings (on a GPU, once the queued work is done)."""
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _draft(self, plans: list[_Plan]) -> tuple[int, int, float] | None:
        """One drafter pass per live drafter and kind: a tree drafts the whole block (its nodes are the
        best paths through every position's candidates), a chain the block the policy asks for; the
        policy then picks each chain's verify length from the block states. A lookup round verifies
        its chain. -> (requests, block length, seconds, context tokens extended) of the chain drafting,
        None without any."""
        dev = self.target.lm_head.weight.device
        for p in plans:
            if p.kind == "lookup":
                p.verify_len = 1 + len(p.chain)
        timing = None
        for kind in ("tree", "draft"):
            for slot, idx in self._groups(plans, [i for i, p in enumerate(plans) if p.kind == kind]):
                t0 = self._clock()
                group = [plans[i] for i in idx]
                extended = self._extend_context(slot, [p.st for p in group])
                length = self.k_blk if kind == "tree" else self.policy.draft_len(self.k_blk, slot.head)
                last = torch.tensor([p.st.out[-1] for p in group], device=dev)
                hidden = slot.drafter.draft_many([p.st.dcache for p in group], last, length)  # [r, L, H]
                logits = [None] * len(group)
                if kind == "tree":
                    lens, preds = [1 + self.tree + len(p.chain) for p in group], [float("nan")] * len(group)
                elif self.policy.reads_logits:  # one LM-head call serves the policy and the drafts
                    logits = slot.drafter.logits(hidden[:, 1:])  # [r, L-1, Vd]
                    lens, preds = self.policy.lengths([p.st for p in group], hidden, self.k_blk, logits=logits)
                else:
                    lens, preds = self.policy.lengths([p.st for p in group], hidden, self.k_blk)
                for p, h, lg, n, pred in zip(group, hidden, logits, lens, preds):
                    p.hidden, p.logits, p.verify_len, p.pred = h, lg, n, pred
                if kind == "draft":
                    r, secs, cx = (timing[0], timing[2], timing[3]) if timing else (0, 0.0, 0)
                    timing = (r + len(group), length, secs + self._clock() - t0, cx + extended)
        return timing

    @staticmethod
    def _extend_context(slot: DrafterSlot, states: list[RequestState]) -> int:
        """Extend the drafter caches of requests about to draft with the features their text gained
        since they last drafted, in one packed call: a request that does not draft (plain decoding
        chosen by the policy, a prompt-lookup round) costs the drafter nothing that step. -> tokens extended."""
        todo = [s for s in states if s.context]
        if not todo:
            return 0
        feats = [s.take_context() for s in todo]  # [T_i, n*H] each
        slot.drafter.extend_many(feats, [s.dcache for s in todo])
        return sum(f.shape[0] for f in feats)

    def _propose(self, plans: list[_Plan]) -> None:
        """Each request's tokens to verify: its lookup chain; drafts from its drafter's logits at the
        positions it verifies; or a tree of the drafter's `tree` best paths with the lookup chain grafted
        in (fewer nodes when the token budget trimmed its verify length)."""
        for p in plans:
            if p.kind == "tree":
                p.chain = p.chain[: max(0, p.verify_len - 2)]  # the budget trims the chain first, keeping one node
                nodes = p.verify_len - 1 - len(p.chain)
                if nodes < 1:
                    p.kind = "plain"  # trimmed to the anchor alone
                p.rows = min(self.k_blk - 1, p.budget, max(0, nodes))  # the tree's depth: never past max_new_tokens
            elif p.kind == "draft":
                p.rows = p.verify_len - 1
        self._draft_logits(plans)
        dev = self.target.lm_head.weight.device
        vocab_size = self.target.config.vocab_size
        for p in plans:
            st, dr = p.st, p.st.slot.drafter
            p.draft = torch.zeros(0, dtype=torch.long, device=dev)
            if p.kind == "tree":
                tokens, p.parents = graft(*build_tree(p.logits, p.verify_len - 1 - len(p.chain), dr.vocab), p.chain)  # [N], [N]
                p.draft, p.mask = tokens.to(dev), tree_mask(p.parents)  # [N], [N+1, N+1]
                p.verify_len = 1 + len(tokens)
            elif p.kind == "lookup":
                p.draft = torch.tensor(p.chain[: p.verify_len - 1], dtype=torch.long, device=dev)  # [k]
                if st.gen is not None:  # a deterministic proposal: q is one-hot on it
                    p.q = torch.zeros(len(p.draft), vocab_size, device=dev).scatter_(1, p.draft[:, None], 1.0)  # [k, V]
            elif p.kind == "draft" and p.verify_len > 1:
                e = self._noise(st, p.verify_len - 1)  # [k, V] or None: the target samples with it too
                p.draft, p.q = propose(p.logits, st.req.temperature, st.gen, dr.vocab, dr.vocab_size, e)  # [k], [k, V] or None
            elif p.kind == "plain":
                p.verify_len = 1

    def _verify(self, p: _Plan, logits: torch.Tensor, feats: torch.Tensor, best: list[int]) -> torch.Tensor:
        """Accept (logits [verify_len, V] over [anchor, drafts or nodes], best [verify_len] their argmax), keep only
        the committed inputs' K/V in the target cache, record the round and commit; -> those inputs' features [1 + n, n*H]."""
        st = p.st
        if p.mask is not None:
            chosen = best  # [N+1] the target's greedy token after the anchor and each node (the record)
            if st.req.temperature > 0:  # seeded: a node's token lands at len(out) + its depth
                depth = p.mask.sum(-1) - 1  # [N+1]
                chosen = pick(logits, st.req.temperature, None, self._noise(st, int(depth.max()) + 1)[depth]).tolist()
            path, nxt = walk_tree(p.draft, p.parents, chosen)
            keep = [0] + path  # the anchor, then the accepted nodes
            st.tcache.keep(st.tcache.length - p.verify_len, keep)
            tokens, parents = p.draft.tolist(), p.parents.tolist()
            child = next((i for i, q in enumerate(parents, 1) if q == keep[-1]), None)  # the best candidate where it stopped
            walked = path + ([child] if child is not None else [])
            draft = [tokens[i - 1] for i in walked]  # the path the walk took, as a chain
            target = [best[i] for i in keep[: len(walked)]]  # the target's token after each one's parent
        else:
            k = p.verify_len - 1
            n, nxt, target = verify(p.draft, p.q, logits, st.req.temperature, st.gen, self._noise(st, p.verify_len), best)
            st.tcache.crop(st.tcache.length - (k - n))  # drop rejected drafts; [last, accepted] stay
            keep = list(range(1 + n))
            draft = p.draft.tolist()
        n = len(keep) - 1
        before = len(st.out)
        st.rounds.append(
            Round(
                anchor=len(st.req.prompt_ids) + before - 1,
                draft=draft,
                target=target,
                accepted=n,
                verify_len=p.verify_len,
                pred=p.pred,
                t_ns=time.time_ns(),
                hidden=p.hidden.clone() if self.keep_hidden and p.hidden is not None else None,
                source="lookup" if p.kind == "lookup" else "drafter",
            )
        )
        self._commit(st, draft[:n] + [nxt])
        self.stats["committed"] += len(st.out) - before
        st.ema_verify = (1 - self.ema_alpha) * st.ema_verify + self.ema_alpha * p.verify_len
        return feats[keep]

    def _noise(self, st: RequestState, n: int) -> torch.Tensor | None:
        """[n, V] a seeded sampled request's noise of its next n token positions (from len(out)); else None.
        Rows are kept for the positions not yet committed (`RequestState.noise`): the drafts a round rejects
        are the next round's positions, so each position's row is hashed once."""
        if st.req.temperature <= 0 or st.gen is not None:
            return None
        start, (first, rows) = len(st.out), st.noise or (len(st.out), None)
        rows = None if rows is None or start - first >= rows.shape[0] else rows[start - first :]  # [m, V] from start
        have = 0 if rows is None else rows.shape[0]
        if have < n:
            new = noise(st.req.seed, start + have, n - have, self.target.config.vocab_size, self.target.lm_head.weight.device)
            rows = new if rows is None else torch.cat([rows, new])
        st.noise = (start, rows)
        return rows[:n]

    @staticmethod
    def _draft_logits(plans: list[_Plan]) -> None:
        """Draft logits only for the block positions each request needs: p.hidden [L, H] -> p.logits
        [rows, Vd] over its drafter's draft vocabulary (position 0, the anchor, has none). One LM-head
        call per drafter over the packed rows; logits the policy already read are cut to their rows."""
        for p in plans:
            if p.logits is not None:
                p.logits = p.logits[: p.rows]
        need = [i for i, p in enumerate(plans) if p.rows > 0 and p.logits is None]
        for slot, idx in Engine._groups(plans, need):
            rows = torch.cat([plans[i].hidden[1 : 1 + plans[i].rows] for i in idx])  # [sum(rows), H]
            for i, lg in zip(idx, slot.drafter.logits(rows).split([plans[i].rows for i in idx])):
                plans[i].logits = lg

    @staticmethod
    def _groups(plans: list[_Plan], idx) -> list[tuple[DrafterSlot, list[int]]]:
        """Indices `idx` of `plans` grouped by their request's drafter slot."""
        groups: dict[int, tuple[DrafterSlot, list[int]]] = {}
        for i in idx:
            slot = plans[i].st.slot
            groups.setdefault(id(slot), (slot, []))[1].append(i)
        return list(groups.values())

    def _fit_budget(self, lens: list[int], fixed: int = 0) -> list[int]:
        """Trim the longest verify lengths until they and `fixed` tokens (prompts) fit the step's token
        budget (each keeps >= 1)."""
        lens = list(lens)
        while sum(lens) + fixed > self.token_budget and lens and max(lens) > 1:
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

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int | None = 0) -> RequestState:
        """Single-request generation: one request through the (idle) engine, stepped until it finishes."""
        (st,) = self.run([Request("generate", list(prompt_ids), max_new_tokens, temperature, seed)])
        return st

    def run(self, requests: list[Request]) -> list[RequestState]:
        """Submit all, step until every request finished; -> states in submission order."""
        for r in requests:
            self.submit(r)
        order = {r.request_id: i for i, r in enumerate(requests)}
        done = []
        while not self.idle:
            done += self.step()
        return sorted(done, key=lambda s: order[s.req.request_id])


def single_request_engine(
    target: TargetModel,
    drafter: Drafter | None,
    eos_ids: list[int],
    verify_len: int | None = None,
    tree: int = 0,
    lookup: int = 0,
    lookup_min: int = 1,
) -> Engine:
    """The engine as single-request generation runs it (batch 1, no token budget below the context):
    plain decoding without a drafter; else a chain of `verify_len` tokens (default the whole block) or,
    for greedy and seeded requests, a token tree of `tree` nodes with a prompt-lookup branch of up to `lookup` tokens
    grafted in (matches of `lookup_min`..3 tokens)."""
    policy = ARPolicy() if drafter is None else FixedPolicy(verify_len)
    ctx = target.config.max_position_embeddings
    return Engine(target, drafter, policy, eos_ids, max_batch=1, token_budget=ctx, lookup=lookup, lookup_min=lookup_min, tree=tree)
