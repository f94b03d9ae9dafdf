"""The speculative core on a CUDA device: same greedy tokens as on CPU, sampling runs with a device
generator. Skipped where no GPU is present (this CI machine); run on a GPU host with `pytest -m gpu`."""

from __future__ import annotations

import copy

import pytest
import torch

from adaflash.engine import Engine, FixedPolicy, Request
from adaflash.generate import generate_ar, generate_dflash
from conftest import tiny_drafter, tiny_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_engine_and_generate_on_cuda_match_cpu():
    target = tiny_target(11)
    drafter = tiny_drafter(target, 11)
    reqs = [Request(f"r{i}", [1 + i, 2, 3, 4], 20) for i in range(3)]
    cpu = [generate_ar(target, r.prompt_ids, 20, []).output_ids for r in reqs]
    gt = copy.deepcopy(target).cuda()
    gd = copy.deepcopy(drafter).cuda()
    gd.attach(gt)  # share the GPU copy of the frozen embedding and LM head
    states = Engine(gt, gd, FixedPolicy(), eos_ids=[], max_batch=3).run(reqs)
    assert [s.out for s in states] == cpu
    assert generate_dflash(gt, gd, reqs[0].prompt_ids, 20, []).output_ids == cpu[0]
    sampled = Engine(gt, gd, FixedPolicy(), eos_ids=[]).run([Request("s", [1, 2, 3], 20, temperature=0.8, seed=3)])
    assert len(sampled[0].out) == 20
