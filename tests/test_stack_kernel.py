"""The decoder layers in one C++ call (kernels/stack_cpu.cpp) against the Python layer loop, bit for bit.

`TargetModel.forward_packed` takes the C++ loop for a bfloat16 model on AMX tiles, a float32 one with oneDNN
weights, or one with q4 projections (and the drafter its block pass and cache extension); it must give exactly
what the Python loop gives (logits, features, the K/V it writes), or greedy verification would no longer be plain
decoding. The AMX tests run where the CPU has AMX, the q4 tests where the q4 kernel builds; elsewhere the Python
loop is the only path and they skip.
"""

import pytest
import torch
from adaflash.kernels import amx_cpu, q4_cpu, stack_cpu
from conftest import tiny_drafter, tiny_target
from torch import nn

from adaflash import layers

needs_amx = pytest.mark.skipif(stack_cpu.load() is None or not amx_cpu.available(), reason="no AMX here (or no kernel build)")
needs_q4 = pytest.mark.skipif(stack_cpu.load() is None or q4_cpu.load() is None, reason="the q4 or the stack kernel did not build here")


def bf16_target():
    model = tiny_target(seed=3, vocab=96, layers=3, head_dim=32).to(torch.bfloat16).eval()  # head dim 32: the kernels' smallest
    return model


def run(model, use_stack: bool, monkeypatch, steps):
    """Prefill 5 ragged prompts, then `steps` (per request: tokens and an optional tree mask) -> every output
    and the K/V each request's cache holds at the end."""
    with monkeypatch.context() as m:
        if not use_stack:
            m.setattr(stack_cpu, "load", lambda: None)
        torch.manual_seed(0)
        caches = [model.new_cache(1, 64) for _ in range(5)]
        logits, feats = model.forward_packed([torch.randint(0, 96, (n,)) for n in (7, 1, 12, 3, 9)], caches, logits_last_only=True)
        outs = [*logits, *feats]
        for tokens, trees in steps:
            logits, feats = model.forward_packed(tokens, caches, trees=trees)
            outs += [*logits, *feats]
        kv = [torch.cat([c.k[i][:, :, : c.length] for c in caches], dim=2) for i in range(len(caches[0].k))]
        return outs, kv


def q4_target(dtype):
    """A tiny target in `dtype` with every projection a Q4Linear of its own weights (quant.q4_1_quantise: llama.cpp's Q4_1)."""
    from adaflash.quant import PROJECTIONS, Q4Linear, _swap, q4_1_quantise

    model = tiny_target(seed=3, vocab=96, layers=3, head_dim=32).to(dtype).eval()
    for i in range(len(model.model.layers)):
        for p in PROJECTIONS.values():
            path = f"model.layers.{i}.{p}"
            _swap(model, path, Q4Linear(*q4_1_quantise(model.get_submodule(path).weight.float())))
    return model


def counting(calls: list):
    """A stand-in for `stack_cpu.load` whose extension records each call's weight count in `calls` (`forward_layers`:
    the count, `extend_layers`: ("kv", the count))."""
    ext = stack_cpu.load()

    class Counting:
        def forward_layers(self, x, weights, *args):
            calls.append(len(weights))
            return ext.forward_layers(x, weights, *args)

        def extend_layers(self, x, weights, *args):
            calls.append(("kv", len(weights)))
            return ext.extend_layers(x, weights, *args)

    return lambda: Counting()


def steps_of_every_kind():
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)  # two branches
    return [
        ([torch.tensor([5]) for _ in range(5)], None),  # plain decoding
        ([torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in (4, 2, 4, 1, 3)], [tree, None, None, None, None]),
    ]


def same_bits(model, monkeypatch):
    steps = steps_of_every_kind()
    with_stack, kv_stack = run(model, True, monkeypatch, steps)
    without, kv_plain = run(model, False, monkeypatch, steps)
    assert len(with_stack) == len(without)
    for a, b in zip(with_stack, without):
        assert torch.equal(a, b)
    for a, b in zip(kv_stack, kv_plain):
        assert torch.equal(a, b)


@needs_amx
def test_stack_gives_the_python_loops_bits(monkeypatch):
    same_bits(bf16_target(), monkeypatch)


@pytest.mark.skipif(stack_cpu.load() is None or not torch.backends.mkldnn.is_available(), reason="no stack kernel or oneDNN here")
def test_float32_stack_gives_the_python_loops_bits(monkeypatch):
    """A float32 target (the CPU default) takes the loop with its oneDNN-blocked weights (6 a layer), one and two rows
    padded to four as `layers._one_call` pads them, with the Python loop's bits."""
    model = tiny_target(seed=3, vocab=96, layers=3, head_dim=32).eval()
    calls = []
    with monkeypatch.context() as m:
        m.setattr(stack_cpu, "load", counting(calls))
        model.forward_packed([torch.tensor([1, 2, 3])], [model.new_cache(1, 16)])
    assert calls == [6 * len(model.model.layers)]
    same_bits(model, monkeypatch)
    # the loop takes its padding from layers (one source): another one runs it too, with the Python loop's bits
    monkeypatch.setattr(layers, "PAD_ROWS", 4)
    monkeypatch.setattr(layers, "MIN_ROWS", 8)
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(stack_cpu, "load", counting(calls))
        model.forward_packed([torch.tensor([1, 2, 3])], [model.new_cache(1, 16)])
    assert calls == [6 * len(model.model.layers)]
    same_bits(model, monkeypatch)


@needs_q4
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_q4_stack_gives_the_python_loops_bits(monkeypatch, dtype):
    """A q4 target with bfloat16 activations (where bfloat16 is fast) or float32 ones (AVX2-only CPUs) takes the q4
    form of the loop, with the Python loop's bits: prefill, plain decoding, mixed verify lengths and a token tree."""
    model = q4_target(dtype)
    calls = []
    with monkeypatch.context() as m:
        m.setattr(stack_cpu, "load", counting(calls))
        model.forward_packed([torch.tensor([1, 2, 3])], [model.new_cache(1, 16)])
    assert calls == [14 * len(model.model.layers)]  # the q4 form
    same_bits(model, monkeypatch)


@needs_amx
def test_stack_is_taken_and_follows_weight_changes(monkeypatch):
    """The C++ loop runs for a bfloat16 model on AMX, and a weight changed in place or a new Parameter
    assigned after a forward is what the next forward multiplies with (its packed weights are rebuilt)."""
    model = bf16_target()
    calls = []
    monkeypatch.setattr(stack_cpu, "load", counting(calls))
    tokens = [torch.tensor([1, 2, 3])]

    def logits():
        return model.forward_packed(tokens, [model.new_cache(1, 16)])[0][0]

    before = logits()
    assert len(calls) == 1
    down = model.model.layers[1].mlp.down_proj
    with torch.no_grad():
        down.weight.mul_(2)
    changed = logits()
    assert not torch.equal(changed, before)
    down.weight = nn.Parameter(torch.randn_like(down.weight), requires_grad=False)
    replaced = logits()
    monkeypatch.setattr(stack_cpu, "load", lambda: None)
    assert torch.equal(replaced, logits())
    assert len(calls) == 3 and amx_cpu.available()


@needs_q4
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_q4_drafter_block_in_one_call_has_the_python_loops_bits(monkeypatch, dtype):
    """The drafter's context extension (`extend_many`: k/v projections, k norms, RoPE, pool writes) and its block pass
    (`draft_many`: bidirectional blocks over ragged contexts, q/k norms) take the C++ calls with q4 weights, with the
    Python loops' bits: the K/V they leave in the pool and the block states."""
    from adaflash.quant import quantise_drafter

    target = tiny_target(seed=3, vocab=96, layers=3, head_dim=32)
    drafter = tiny_drafter(target).to(dtype).requires_grad_(False)
    quantise_drafter(drafter)
    assert drafter.layers[0].self_attn.q_norm is not None
    calls = []

    def blocks(stack):
        with monkeypatch.context() as m:
            m.setattr(stack_cpu, "load", counting(calls) if stack else (lambda: None))
            torch.manual_seed(0)
            caches = [drafter.new_cache(1, 64) for _ in range(3)]
            drafter.extend_many([torch.randn(n, drafter.fc.in_features).to(dtype) for n in (5, 1, 9)], caches)
            out = [drafter.draft_many(caches, torch.tensor([7, 1, 30]), n) for n in (4, 6)]  # [3, L, H] each
            drafter.extend_many([torch.randn(n, drafter.fc.in_features).to(dtype) for n in (2, 3, 1)], caches)
            kv = [torch.cat([c.k[i][:, :, : c.length] for c in caches], 2) for i in range(len(drafter.layers))]  # [1, Hkv, N, D]
            return out + kv + [torch.cat([c.v[i][:, :, : c.length] for c in caches], 2) for i in range(len(drafter.layers))]

    with_stack = blocks(True)
    n = len(drafter.layers)
    assert calls == [("kv", 7 * n), 16 * n, 16 * n, ("kv", 7 * n)]  # the q4 forms with q/k norms, every pass
    for a, b in zip(with_stack, blocks(False)):
        assert torch.equal(a, b)
