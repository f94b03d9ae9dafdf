"""Offline fit of the length head with the drafter frozen (REFERENCE.md section 3).

Verification rounds are recorded on training prompts with full-block verification (every draft
is checked, so the label (accepted + 1) / K is unbiased), keeping the drafter's block states; the
head is fitted on them and saved beside the drafter with its held-out metrics. With `draft_len`
L < K the rounds draft and verify the block [anchor, MASK x (L-1)] and the head is fitted on those
L-blocks (its `block_size` is L): in serving it then drafts only L positions (the drafter pass is
~all of drafting's cost on a CPU) and verifies at most L tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from adaflash.engine import Engine
from adaflash.length_head import LengthHead, LengthHeadConfig, fit_length_head, save_length_head
from adaflash.policies import FixedPolicy
from adaflash.request import Request, RequestState


def record_full_blocks(
    target, drafter, prompt_ids: list[list[int]], max_new: int, concurrency: int, eos: list[int], draft_len: int | None = None
) -> list[RequestState]:
    """Serve the prompts verifying every drafted position (L = draft_len or K), keeping the block states:
    finished requests in submission order, their rounds with uncensored labels."""
    k = min(draft_len or drafter.block_size, drafter.block_size)
    engine = Engine(target, drafter, FixedPolicy(k), eos, max_batch=concurrency, token_budget=concurrency * k + 4096, keep_hidden=True)
    reqs = [Request(f"fit-{i}", ids, max_new) for i, ids in enumerate(prompt_ids)]
    for r in reqs:
        engine.submit(r)
    bar, finished = tqdm(total=len(prompt_ids), desc="collect rounds", unit="prompt"), []
    while not engine.idle:
        finished += engine.step()
        bar.update(len(finished) - bar.n)
    bar.close()
    order = {r.request_id: i for i, r in enumerate(reqs)}
    return sorted(finished, key=lambda s: order[s.req.request_id])


def collect_rounds(
    target, drafter, prompt_ids: list[list[int]], max_new: int, concurrency: int, eos: list[int], draft_len: int | None = None
):
    """-> (block states [N, L, H], accepted [N]) from full-block verification rounds (L = draft_len or K)."""
    k = min(draft_len or drafter.block_size, drafter.block_size)
    finished = record_full_blocks(target, drafter, prompt_ids, max_new, concurrency, eos, draft_len)
    rounds = [r for s in finished for r in s.rounds if len(r.draft) == k - 1]
    return torch.stack([r.hidden for r in rounds]).float(), torch.tensor([r.accepted for r in rounds])


def fit_head(
    target,
    drafter,
    drafter_dir: Path,
    prompt_ids: list[list[int]],
    max_new: int,
    concurrency: int,
    eos: list[int],
    epochs: int,
    lr: float,
    seed: int = 0,
    draft_len: int | None = None,
) -> dict:
    hidden, accepted = collect_rounds(target, drafter, prompt_ids, max_new, concurrency, eos, draft_len)
    k = hidden.shape[1]  # the block length the head reads
    torch.manual_seed(seed)
    head = LengthHead(LengthHeadConfig(hidden_size=drafter.config.hidden_size, block_size=k))
    metrics = fit_length_head(head, hidden, accepted, k, lr=lr, epochs=epochs, seed=seed, progress=True)
    metrics["rounds"] = int(len(accepted))
    metrics["prompts"] = len(prompt_ids)
    save_length_head(head, drafter_dir, metrics)
    return metrics
