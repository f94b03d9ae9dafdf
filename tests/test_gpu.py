"""The speculative core on a CUDA device: same greedy tokens and seeded samples as on CPU, unseeded
sampling runs with a device generator, the cost policy calibrates there. Skipped where no GPU is
present (this CI machine); run on a GPU host with `pytest -m gpu`."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import greedy_reference, tiny_drafter, tiny_target

from adaflash.engine import Engine, single_request_engine
from adaflash.policies import ARPolicy, FixedPolicy
from adaflash.policy_cost import CostPolicy
from adaflash.request import Request

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_engine_and_generate_on_cuda_match_cpu():
    target = tiny_target(11)
    drafter = tiny_drafter(target, 11)
    reqs = [Request(f"r{i}", [1 + i, 2, 3, 4], 20) for i in range(3)]
    cpu = [greedy_reference(target, r.prompt_ids, 20, []) for r in reqs]
    gt = copy.deepcopy(target).cuda()
    gd = copy.deepcopy(drafter).cuda()
    gd.attach(gt)  # share the GPU copy of the frozen embedding and LM head
    states = Engine(gt, gd, FixedPolicy(), eos_ids=[], max_batch=3).run(reqs)
    assert [s.out for s in states] == cpu
    assert single_request_engine(gt, gd, [], tree=4, lookup=4).generate(reqs[0].prompt_ids, 20).out == cpu[0]  # trees on the GPU
    seeded = Request("s", [1, 2, 3], 20, temperature=0.8, seed=3)  # the target's own seeded sample on either device
    sampled = Engine(gt, gd, FixedPolicy(), eos_ids=[]).run([seeded])
    assert sampled[0].out == Engine(target, None, ARPolicy(), eos_ids=[]).run([seeded])[0].out
    unseeded = Engine(gt, gd, FixedPolicy(), eos_ids=[]).run([Request("u", [1, 2, 3], 20, temperature=0.8)])  # a device generator
    assert len(unseeded[0].out) == 20
    cost = Engine(gt, gd, CostPolicy.for_models(gt, gd), eos_ids=[], max_batch=3).run(reqs)  # calibrated on the GPU
    assert [s.out for s in cost] == cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_opd_kernel_matches_torch_at_full_vocabulary(dtype):
    """The compiled (not interpreted) Triton OPD kernel against the PyTorch reference, at SmolLM2's
    49,152-token vocabulary: values and gradients."""
    from adaflash.kernels.opd import _kernels, fused_opd_terms

    from adaflash.losses import opd_row_terms

    if _kernels().INTERPRETED:
        pytest.skip("kernels imported in interpreter mode in this process: run this file on its own")
    g = torch.Generator().manual_seed(0)
    d = (torch.randn(48, 49152, generator=g) * 3).to("cuda", dtype)
    t = (torch.randn(48, 49152, generator=g) * 3).to("cuda", dtype)
    w_h, w_r = torch.rand(48, device="cuda"), torch.randn(48, device="cuda")
    for clip, mode in [(None, "vocab"), (1.0, "vocab"), (5.0, "token")]:
        d_ref, d_fus = d.float().clone().requires_grad_(), d.clone().requires_grad_()
        h_ref, r_ref = opd_row_terms(d_ref, t.float(), 1.0, clip, mode)
        h_fus, r_fus = fused_opd_terms(d_fus, t, 1.0, clip, mode)
        torch.testing.assert_close(h_fus, h_ref, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(r_fus, r_ref, rtol=1e-3, atol=1e-4)
        (w_h * h_ref + w_r * r_ref).sum().backward()
        (w_h * h_fus + w_r * r_fus).sum().backward()
        tol = dict(rtol=1e-3, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-4)
        torch.testing.assert_close(d_fus.grad.float(), d_ref.grad, **tol)
