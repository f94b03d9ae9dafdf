"""Offline fit of the length head with the drafter frozen (REFERENCE.md section 3).

Verification rounds are recorded on training prompts with full-block verification (every draft
is checked, so the label (accepted + 1) / K is unbiased), keeping the drafter's block states; the
head is fitted on them and saved beside the drafter with its held-out metrics.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from adaflash.engine import Engine, FixedPolicy, Request
from adaflash.length_head import LengthHead, LengthHeadConfig, fit_length_head, save_length_head


def collect_rounds(target, drafter, prompt_ids: list[list[int]], max_new: int, concurrency: int, eos: list[int]):
    """-> (block states [N, K, H], accepted [N]) from full-block verification rounds."""
    engine = Engine(target, drafter, FixedPolicy(), eos, max_batch=concurrency, token_budget=concurrency * drafter.block_size + 4096,
                    keep_hidden=True)
    for i, ids in enumerate(prompt_ids):
        engine.submit(Request(f"fit-{i}", ids, max_new))
    bar = tqdm(total=len(prompt_ids), desc="collect rounds", unit="prompt")
    while not engine.idle:
        bar.update(len(engine.step()))
    bar.close()
    rounds = [r for s in engine.finished for r in s.rounds if len(r.draft) == drafter.block_size - 1]
    return torch.stack([r.hidden for r in rounds]).float(), torch.tensor([r.accepted for r in rounds])


def fit_head(target, drafter, drafter_dir: Path, prompt_ids: list[list[int]], max_new: int, concurrency: int,
             eos: list[int], epochs: int, lr: float, seed: int = 0) -> dict:
    hidden, accepted = collect_rounds(target, drafter, prompt_ids, max_new, concurrency, eos)
    torch.manual_seed(seed)
    head = LengthHead(LengthHeadConfig(hidden_size=drafter.config.hidden_size, block_size=drafter.block_size))
    metrics = fit_length_head(head, hidden, accepted, drafter.block_size, lr=lr, epochs=epochs, seed=seed, progress=True)
    metrics["rounds"] = int(len(accepted))
    metrics["prompts"] = len(prompt_ids)
    save_length_head(head, drafter_dir, metrics)
    return metrics
