"""Verify-length policies: how many tokens each request verifies a step (and, for the cost policy in
adaflash.policy_cost, whether it drafts at all). One table of names (`POLICIES`), one builder (`make_policy`)."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Callable

import torch

from adaflash.drafter import Drafter
from adaflash.request import RequestState
from adaflash.target import TargetModel


class VerifyPolicy(ABC):
    """Chooses each request's verify length (tokens verified incl. the anchor, 1..K)."""

    name = "base"
    drafts = True

    reads_logits = False  # True: `lengths` also gets the drafted positions' draft logits (`logits` [R, L-1, Vd])

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

    timed = False  # True: the engine reports each step's timings to `observe_timing`

    def select(self, states: list[RequestState], others: tuple[int, int] = (0, 0)) -> list[bool]:
        """Before drafting: which of these requests draft this step; the others verify their anchor alone
        (plain decoding for that step). `others`: (requests, tokens) the step verifies besides them."""
        return [True] * len(states)

    def observe_timing(self, verify: tuple[int, int, float, float], draft: tuple[int, int, float, int] | None) -> None:
        """A step's timings: verify = (requests, tokens, seconds, QK) of the target pass, QK its attention's
        thousands of new-token x cached-token pairs (adaflash.cost.attention_pairs); draft = (requests,
        block length, seconds, context tokens extended) of the chain drafting pass (extending the
        drafter caches, draft_many, lengths), None without one."""

    def observe_step(self, seconds: float) -> None:
        """The whole step's wall time (selection, drafting, verification, commits), after observe_timing."""

    def prompts(self, requests: int, tokens: int) -> None:
        """Before `lookup_lengths` and `select`, every step: the step also prefills these prompts (requests,
        tokens), which ride in its target forward whatever the policy chooses."""

    def lookup_lengths(self, states: list[RequestState], chains: list[int], others: int = 0) -> list[int]:
        """Before drafting: how many tokens of each request's prompt-lookup chain (`chains`: their
        lengths) to verify; 0 = none this step (the request may draft instead). `others`: requests of
        the step without a chain. Default: whole chains."""
        return list(chains)

    def observe_lookup(self, states: list[RequestState], accepted: list[int]) -> None:
        """Called after verification with each lookup round's accepted chain tokens."""

    def state(self) -> list[tuple[str, str, str, float]]:
        """What the policy has learnt, for an operator (the server's /metrics and /v1/status): [(name, kind
        ("gauge" or "counter"), help, value)]. A fixed policy learns nothing."""
        return []


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


POLICIES: dict[str, Callable[..., VerifyPolicy]] = {  # name -> policy, given (the drafter's length head or None, target, drafter)
    "ar": lambda head, target, drafter: ARPolicy(),
    "fixed": lambda head, target, drafter: FixedPolicy(),
    "ema": lambda head, target, drafter: EMAPolicy(),
    "head": lambda head, target, drafter: HeadPolicy(head),
    "cost": lambda head, target, drafter: _cost_policy(target, drafter),
}
POLICY_NAMES = f"auto, {', '.join(POLICIES)}, fixedK (e.g. fixed8)"


def _cost_policy(target: TargetModel | None, drafter: Drafter | None) -> VerifyPolicy:
    from adaflash.policy_cost import CostPolicy  # it builds on this module

    if target is None or drafter is None:
        raise ValueError("verify policy 'cost' needs the target and the drafter (it measures what their steps cost)")
    return CostPolicy.for_models(target, drafter)


def known_policy(name: str) -> bool:
    return name == "auto" or name in POLICIES or re.fullmatch(r"fixed[1-9][0-9]*", name) is not None


def cost_by_default(target: TargetModel) -> bool:
    """Whether `auto` means the cost policy for `target`: on a CPU, where it was measured; on a GPU not yet."""
    return target.lm_head.weight.device.type == "cpu"


def make_policy(name: str, head=None, target: TargetModel | None = None, drafter: Drafter | None = None) -> VerifyPolicy:
    """The verify policy called `name` (POLICY_NAMES): fixedK verifies K tokens; cost calibrates (or reads
    the cached) step costs of `target` and `drafter`; auto is cost for a target on a CPU (ahead of the
    length head in 9 of 10 bench cells there, docs/benchmarks.md), elsewhere (cost not yet measured on a
    GPU) the length head where the drafter has one, else fixed."""
    if not known_policy(name):
        raise ValueError(f"unknown verify policy {name!r}; valid: {POLICY_NAMES}")
    if name == "auto":
        cost = target is not None and drafter is not None and cost_by_default(target)
        name = "cost" if cost else "head" if head is not None else "fixed"
    return FixedPolicy(int(name[5:])) if name not in POLICIES else POLICIES[name](head, target, drafter)
