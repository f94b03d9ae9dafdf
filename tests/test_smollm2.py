"""The real target with the committed drafter: greedy DFlash (one chain, a token tree, a tree with a
prompt-lookup branch) equals plain decoding token for token, in float32, bfloat16 and int4, and the
trained drafter really drafts (tau well above 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import greedy_reference

from adaflash.drafter import load_drafter
from adaflash.engine import single_request_engine
from adaflash.target import load_target

ROOT = Path(__file__).resolve().parent.parent
DRAFTER = ROOT / "models" / "drafter-smollm2"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real():
    target = load_target("smollm2", "float32")
    return target, load_drafter(DRAFTER, target.model, target.identity)


def test_committed_drafter_metadata():
    meta = json.loads((DRAFTER / "config.json").read_text())
    assert meta["target"]["name"] == "SmolLM2-135M-Instruct"
    assert meta["block_size"] == 16 and meta["target_layer_ids"] == [1, 8, 14, 20, 27]
    assert (DRAFTER / "model.safetensors").stat().st_size < 64 * 2**20


def test_greedy_lossless_on_smollm2(real):
    target, drafter = real
    lines = (ROOT / "examples" / "prompts.jsonl").read_text().splitlines()
    taus, tree_taus, lookup_taus = [], [], []
    for line in lines[:3]:
        ids = target.encode_chat(json.loads(line)["messages"])
        ar = greedy_reference(target.model, ids, 64, target.eos_ids)
        sd, tree, lookup = (
            single_request_engine(target.model, drafter, target.eos_ids, **kw).generate(ids, 64)
            for kw in ({}, {"tree": 8}, {"tree": 8, "lookup": 8})
        )
        assert sd.out == ar and tree.out == ar and lookup.out == ar
        taus.append(sd.tau)
        tree_taus.append(tree.tau)
        lookup_taus.append(lookup.tau)
    assert sum(taus) / len(taus) > 1.5, taus  # a trained drafter, not a random one
    assert sum(tree_taus) > sum(taus), (tree_taus, taus)  # second-best drafts get accepted too
    assert sum(lookup_taus) > sum(tree_taus), (lookup_taus, tree_taus)  # answers copy spans of their prompts


@pytest.mark.parametrize("dtype", ["bfloat16", "int4"])
def test_greedy_lossless_on_smollm2_in_bf16_activations(dtype):
    """bfloat16 and int4 round every layer to 8 bits; with the row-invariant attention kernel greedy
    speculation (chain, tree with lookup, and 3 requests at once) still equals their own plain decoding."""
    from adaflash.kernels import attention_cpu

    from adaflash.engine import Engine
    from adaflash.policies import FixedPolicy
    from adaflash.request import Request

    if not attention_cpu.available():
        pytest.skip("the C++ attention kernel did not build here (no compiler)")
    target = load_target("smollm2", dtype)
    drafter = load_drafter(DRAFTER, target.model, target.identity)
    lines = (ROOT / "examples" / "prompts.jsonl").read_text().splitlines()[:3]
    prompts = [target.encode_chat(json.loads(line)["messages"]) for line in lines]
    refs = [greedy_reference(target.model, ids, 48, target.eos_ids) for ids in prompts]
    for ids, ar in zip(prompts, refs):
        for kw in ({"verify_len": 6}, {"tree": 8, "lookup": 8}):
            assert single_request_engine(target.model, drafter, target.eos_ids, **kw).generate(ids, 48).out == ar
    reqs = [Request(f"r{i}", ids, 48) for i, ids in enumerate(prompts)]
    states = Engine(target.model, drafter, FixedPolicy(4), eos_ids=target.eos_ids, max_batch=3).run(reqs)
    assert [s.out for s in states] == refs
