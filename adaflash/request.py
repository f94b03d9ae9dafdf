"""A request and its state in the engine: what the engine, the policies and the serving backends share.

`Request` is what a client asks for; `RequestState` is its life in an engine (caches, output, rounds,
timings); `DrafterSlot` a live drafter with its length head and registry version, which a request keeps
from admission to the end (its drafter cache was built by that drafter's projections)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from adaflash.buffer import Round
from adaflash.drafter import Drafter
from adaflash.kvcache import KVCache, KVPool


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = None  # sampling: None = the rejection rule (the most drafts accepted); a seed = the target's
    # own seeded sample token for token, whatever the verify lengths, batch or drafter (spec: seeded sampling)
    domain: str | None = None
    stop: Callable[[list[int]], int | None] | None = None  # output ids -> keep this many and stop, or None
    ignore_eos: bool = False  # run to max_new_tokens past EOS (fixed-length benchmarks; vLLM's and SGLang's flag)


@dataclass
class DrafterSlot:
    """A live drafter with its length head and registry version."""

    drafter: Drafter | None
    head: object | None = None  # LengthHead trained on this drafter's block states
    version: str = "0"
    pool: KVPool | None = field(default=None, repr=False)  # its requests' drafter caches, made on first use

    def new_cache(self, capacity: int, rows: int = 0) -> KVCache:
        """A drafter cache on this slot's own pool: one pool per engine and drafter version, so a
        step's rows stay packed at the pool's front (other engines on the same model use their own)."""
        if self.pool is None:
            self.pool = self.drafter.new_pool(rows)
        return self.pool.take(capacity)


@dataclass
class RequestState:
    req: Request
    slot: DrafterSlot
    tcache: KVCache | None  # None before admission and once retired
    dcache: KVCache | None
    gen: torch.Generator | None  # an unseeded sampled request's random draws (the rejection rule)
    context: list[torch.Tensor] = field(default_factory=list)  # target features [n, n*H] not yet in dcache
    noise: tuple[int, torch.Tensor] | None = None  # a seeded request's noise rows [m, V] from position `[0]` (Engine._noise)
    context_tokens: int = 0  # rows in `context`, kept as it grows (a policy reads it every step)
    admitted: bool = False  # prefilled (got a first token); stays True after the caches are released
    features: torch.Tensor | None = None  # [prompt + out - 1, n*H] every fed token's target features (keep_features)
    out: list[int] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    ema_verify: float = 0.0
    finish_reason: str | None = None
    t_start: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0

    def add_context(self, feats: torch.Tensor) -> None:
        """Queue target features [n, n*H] for the drafter cache (read when this request drafts next)."""
        self.context.append(feats)
        self.context_tokens += feats.shape[0]

    def take_context(self) -> torch.Tensor:
        """The queued features [T, n*H], emptied."""
        feats = torch.cat(self.context) if len(self.context) > 1 else self.context[0]
        self.context, self.context_tokens = [], 0
        return feats

    @property
    def budget(self) -> int:
        """Drafts that could still be committed (a round commits them and one more token): none is verified past
        max_new_tokens."""
        return self.req.max_new_tokens - len(self.out) - 1

    @property
    def tau(self) -> float:
        return (len(self.out) - 1) / len(self.rounds) if self.rounds else 1.0

    @property
    def wall_s(self) -> float:
        """Admission (prefill included) to the end of the step that finished the request."""
        return self.t_done - self.t_start
