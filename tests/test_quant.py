"""Quantised targets (adaflash.quant): Q4_1 blocks repacked for PyTorch's CPU int4 kernel and for our
q4 kernel (int8-rounded inputs, row-invariant), the int8 per-channel kernel, each against a plain
PyTorch reference, and a tiny GGUF end to end."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from adaflash.kernels import q4_cpu
from conftest import greedy_reference, tiny_drafter, tiny_target

from adaflash.quant import (
    GROUP,
    Int4Linear,
    Int8Linear,
    Q4Linear,
    Q8Head,
    q4_1_pack,
    q4_1_quantise,
    q4_1_unpack,
    quantise_drafter,
    quantise_target,
    rope_rows,
    weight_format,
)
from adaflash.target import load_target, resolve_dtype, resolve_target_dtype


def q4_1_blocks(w: np.ndarray) -> np.ndarray:
    """float32 [N, K] -> the GGUF's Q4_1 bytes, quantised by the `gguf` package (llama.cpp's rounding)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize(w.astype(np.float32), GGMLQuantizationType.Q4_1)


def file_values(blocks: np.ndarray) -> np.ndarray:
    """What the GGUF's Q4_1 bytes mean, float32 [N, K], as the `gguf` package (and transformers) dequantise them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(blocks, GGMLQuantizationType.Q4_1)


def test_q4_1_unpack_and_pack_round_trip():
    rng = np.random.default_rng(0)
    blocks = q4_1_blocks(rng.normal(size=(24, 96)) * rng.uniform(0.01, 3, size=(24, 1)))  # [24, 3*20] bytes
    q, d, m = q4_1_unpack(blocks)
    assert q.shape == (24, 96) and d.shape == m.shape == (24, 3) and d.dtype == np.float16 and q.max() <= 15
    np.testing.assert_array_equal(q4_1_pack(q, d, m), blocks)
    dq = d.astype(np.float32).repeat(GROUP, 1) * q + m.astype(np.float32).repeat(GROUP, 1)  # [24, 96]
    np.testing.assert_array_equal(dq, file_values(blocks))


def test_q4_1_quantise_is_llama_cpps_rounding_bit_for_bit():
    """A drafter's Q4_1 blocks are quantised from its float weights as the `gguf` package (llama.cpp) does: the
    same q, d and m for weights of every scale, a constant group (d = 0) and bfloat16 values included."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(48, 128)) * rng.uniform(1e-3, 3, size=(48, 1))
    w[3, 32:64] = 0.25  # a constant group
    w[5] = torch.tensor(w[5]).bfloat16().float().numpy()  # what a bfloat16 drafter holds
    w = w.astype(np.float32)
    q, d, m = q4_1_quantise(torch.from_numpy(w))
    rq, rd, rm = q4_1_unpack(q4_1_blocks(w))
    np.testing.assert_array_equal(q.numpy(), rq)
    np.testing.assert_array_equal(d.numpy(), rd)
    np.testing.assert_array_equal(m.numpy(), rm)
    assert q.dtype == torch.uint8 and d.dtype == m.dtype == torch.float16 and int(q[3, 32:64].max()) == 0


def test_q4_drafter_drafts_close_to_its_float_self_and_stays_lossless(tmp_path):
    """`quantise_drafter` swaps the fusion and every layer projection for Q4Linear (inference only: an export
    refuses it); its block states stay close to the float drafter's, and greedy speculation with it is still
    the target's own plain decoding."""
    from adaflash.dflash_format import export_dflash
    from adaflash.drafter import drafter_dtype_of
    from adaflash.engine import Engine
    from adaflash.policies import FixedPolicy
    from adaflash.request import Request

    target = tiny_target(vocab=96, std=0.2)
    base = tiny_drafter(target).requires_grad_(False)
    quant = copy.deepcopy(base)
    quant.attach(target)
    assert quantise_drafter(quant) == 1 + 7 * len(quant.layers) and weight_format(quant) == "q4"
    assert drafter_dtype_of(quant) == "q4" and drafter_dtype_of(base) == torch.float32
    torch.manual_seed(0)
    feats = torch.randn(1, 5, base.fc.in_features)
    outs = []
    for d in (base, quant):
        cache = d.new_cache(1, 64)
        d.extend_many([feats[0]], [cache])
        outs.append(d.draft_many([cache], torch.tensor([7]), 6))  # [1, 6, H]
    cos = torch.nn.functional.cosine_similarity(outs[0].flatten(), outs[1].flatten(), dim=0)
    assert float(cos) > 0.98
    prompts = [[3, 17, 42, 8], [5, 9, 11, 30, 2, 2], [60, 1]]
    refs = [greedy_reference(target, p, 24, []) for p in prompts]
    states = Engine(target, quant, FixedPolicy(4), eos_ids=[], max_batch=3).run([Request(f"r{i}", p, 24) for i, p in enumerate(prompts)])
    assert [s.out for s in states] == refs
    with pytest.raises(ValueError, match="inference form"):
        export_dflash(quant, tmp_path / "export", 15)


def test_drafter_dtype_names(tiny_hf_dir, tiny_drafter_dir):
    """q4 loads a drafter with Q4_1 projections (activations bf16 where fast); auto is q4 where `q4_is_fast`;
    an unknown name is refused, in a serve config too."""
    from adaflash.server.config import ModelSection

    from adaflash.cost import machine_key
    from adaflash.drafter import load_drafter, resolve_drafter_dtype
    from adaflash.quant import q4_is_fast

    t = load_target(str(tiny_hf_dir), "float32")
    assert resolve_drafter_dtype("q4", t.model) == (resolve_dtype("auto"), "q4")
    assert resolve_drafter_dtype("auto", t.model)[1] == ("q4" if q4_is_fast() else None)
    assert resolve_drafter_dtype(None, t.model) == (torch.float32, None)
    with pytest.raises(ValueError, match="drafter dtype must be one of"):
        resolve_drafter_dtype("int4", t.model)
    with pytest.raises(ValueError, match="model.drafter_dtype must be one of"):
        ModelSection(drafter_dtype="fp16")
    d = load_drafter(tiny_drafter_dir, t.model, t.identity, "q4")
    assert weight_format(d) == "q4" and machine_key(t.model, d)["drafter_dtype"] == f"{d.dtype}+q4"


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_int4_linear_matches_dequantised_matmul(rows):
    rng = np.random.default_rng(rows)
    q, d, m = q4_1_unpack(q4_1_blocks(rng.normal(size=(48, 128))))
    ref_w = torch.from_numpy(file_values(q4_1_pack(q, d, m)))  # [48, 128] the file's values
    x = torch.randn(2, rows, 128)
    lin = Int4Linear(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m), torch.float32)
    assert torch.equal(lin.dequantised(), ref_w)  # float32 scale = d, zero = m + 8d: the file's weights exactly
    torch.testing.assert_close(lin(x), x @ ref_w.T, atol=1e-5, rtol=1e-5)
    bf = Int4Linear(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m), torch.bfloat16)
    assert bf.scale_zero.dtype == torch.bfloat16  # the kernel keeps scale and zero in the activation dtype
    ref = x.bfloat16().float() @ bf.dequantised().T
    torch.testing.assert_close(bf(x.bfloat16()).float(), ref, atol=2**-7 * float(ref.abs().max()), rtol=0)  # bf16 output rounding
    torch.testing.assert_close(bf.dequantised(), ref_w, atol=0.02 * float(ref_w.abs().max()), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_dequantised_matmul(dtype):
    w = torch.randn(40, 96)
    lin = Int8Linear(w, dtype)
    step = lin.scale.float()[:, None]  # [40, 1], in the activation dtype
    assert lin.qweight.dtype == torch.int8 and ((lin.dequantised() - w).abs() <= step / 2 + 1e-6).all()
    assert (step <= w.abs().amax(1, keepdim=True) / 125).all()  # at least 125 of the 127 steps used
    x = torch.randn(7, 96).to(dtype)
    ref = x.float() @ lin.dequantised().T
    # float32: a few ulps of the largest output (MKL's reference sums in an order that can vary between runs)
    tol = (2**-20 if dtype == torch.float32 else 2**-7) * float(ref.abs().max())
    torch.testing.assert_close(lin(x).float(), ref, atol=tol, rtol=0)


def test_rope_rows_undo_llama_cpp_permutation():
    heads, dim, k = 3, 8, 5
    hf = np.arange(heads * dim * k).reshape(heads * dim, k)
    gguf = hf.reshape(heads, 2, dim // 2, k).swapaxes(1, 2).reshape(heads * dim, k)  # how llama.cpp's converter stores q/k
    np.testing.assert_array_equal(gguf[rope_rows(heads * dim, heads)], hf)


def write_tiny_gguf(path, model, embd_q8: bool = False) -> dict[str, torch.Tensor]:
    """The tiny target's projections as Q4_1 tensors in a llama GGUF (q/k rows permuted as llama.cpp
    stores them), the embedding as F32 (or Q8_0, as SmolLM2's); -> {HF module path: the file's float
    values in HF order} (with `embd_q8`, also "lm_head" for the tied embedding)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    from adaflash.quant import PROJECTIONS

    c = model.config
    writer = GGUFWriter(str(path), "llama")
    embd = model.model.embed_tokens.weight.numpy()
    values = {}
    if embd_q8:
        blocks = quantize(embd.astype(np.float32), GGMLQuantizationType.Q8_0)
        writer.add_tensor("token_embd.weight", blocks, raw_dtype=GGMLQuantizationType.Q8_0)
        values["lm_head"] = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0))
    else:
        writer.add_tensor("token_embd.weight", embd)
    for i in range(c.num_layers):
        for kind, sub in PROJECTIONS.items():
            w = model.get_submodule(f"model.layers.{i}.{sub}").weight.numpy()  # [N, K]
            heads = {"attn_q": c.num_heads, "attn_k": c.num_kv_heads}.get(kind)
            if heads:
                w = w.reshape(heads, 2, c.head_dim // 2, -1).swapaxes(1, 2).reshape(w.shape)
            blocks = q4_1_blocks(w)
            writer.add_tensor(f"blk.{i}.{kind}.weight", blocks, raw_dtype=GGMLQuantizationType.Q4_1)
            back = file_values(blocks)
            values[f"model.layers.{i}.{sub}"] = torch.from_numpy(back[rope_rows(len(back), heads)] if heads else back)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


needs_q4 = pytest.mark.skipif(q4_cpu.load() is None, reason="the q4 kernel did not build here (no C++ compiler)")


@needs_q4
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_q4_kernel_is_its_plain_pytorch_reference_bit_for_bit(rows):
    """The kernel (VNNI or the portable loop, whichever this CPU built) does exactly the reference's
    float operations: integer dot products, then per group t = dots * dx, acc += d * t, acc += m * sx."""
    rng = np.random.default_rng(rows)
    q, d, m = (torch.from_numpy(a) for a in q4_1_unpack(q4_1_blocks(rng.normal(size=(48, 160)))))
    lin = Q4Linear(q, d, m)
    x = torch.randn(rows, 160) * torch.logspace(-2, 1, rows)[:, None]
    x[0, :32] = 0.0  # an all-zero input group: step 0, no division by zero
    ref = q4_cpu.reference(x, q.float(), d.float(), m.float())  # [rows, 48]
    assert torch.equal(lin(x), ref)
    w = torch.from_numpy(file_values(q4_1_pack(q.numpy(), d.numpy(), m.numpy())))  # the file's weights
    torch.testing.assert_close(lin(x), x @ w.T, atol=0.02 * float((x @ w.T).abs().max()), rtol=0)  # int8 inputs: ~0.5% off
    assert lin(x.bfloat16()).dtype == torch.bfloat16


@needs_q4
def test_q4_kernel_rows_are_their_own():
    """A row gives the same bits alone, among 1-12 others (every tile remainder) and on 1 or 2 threads:
    what makes greedy verification of a block equal to decoding its tokens one by one."""
    rng = np.random.default_rng(7)
    q, d, m = (torch.from_numpy(a) for a in q4_1_unpack(q4_1_blocks(rng.normal(size=(64, 96)))))
    lin = Q4Linear(q, d, m)
    x = torch.randn(13, 96)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(13)])
    for n in range(2, 14):
        assert torch.equal(lin(x[:n]), alone[:n]), n
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lin(x), alone)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="outputs in 16s"):
        Q4Linear(q[:40], d[:40], m[:40])
    other = Q4Linear(q[:32].flip(0), d[:32], m[:32])
    both = Q4Linear.fuse((lin, other))  # q/k/v side by side (layers.fused): the same bits, members now views into it
    assert torch.equal(both(x), torch.cat([alone, other(x)], -1)) and torch.equal(lin(x), alone)
    assert lin.packed.data_ptr() == both.packed.data_ptr()


# the kernel as older CPUs build it: AVX2 without VNNI (vpmaddubsw's 16-bit sums), and no AVX2 at all
ISA_BUILDS = {"haswell": ("avx2", {"avx2", "fma"}), "x86-64-v2": ("portable", {"sse4_2"})}


@needs_q4
@pytest.mark.parametrize("arch", sorted(ISA_BUILDS))
def test_q4_kernel_built_for_an_older_cpu_gives_the_same_bits(arch):
    """Every build (VNNI, AVX2, the portable loop) computes the same integer dot products and then the same
    float operations: the reference's bits, 4- and 8-bit weights, float32 and bfloat16 inputs, every tile
    remainder. The extremes (weights 15 / 255, inputs +-127 in every position) are where AVX2's 16-bit
    pair sums would saturate if they could."""
    from adaflash.target import cpu_flags

    isa, needs = ISA_BUILDS[arch]
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run code built for {arch}")
    kernel = q4_cpu.load(arch)
    assert kernel is not None and kernel.isa() == isa
    g = torch.Generator().manual_seed(3)
    for bits, top in ((4, 15), (8, 255)):
        q = torch.randint(0, top + 1, (48, 96), generator=g)
        q[:16] = top  # the largest weights ...
        d, m = torch.rand(48, 3, generator=g) * 0.01, torch.randn(48, 3, generator=g) * 0.01
        packed, dp, mp = q4_cpu.pack(q, d, m, bits=bits)
        for rows in (1, 2, 3, 4, 5, 9):
            x = torch.randn(rows, 96, generator=g)
            x[0] = 1.0  # ... times inputs all quantised to 127,
            x[-1, :32], x[-1, 32:64] = -1.0, torch.tensor([1.0, -1.0]).repeat(16)  # -127, and alternating signs
            ref = q4_cpu.reference(x, q.float(), d, m)
            assert torch.equal(kernel.q4_linear(x, packed, dp, mp), ref), (bits, rows)
            assert torch.equal(kernel.q4_linear(x.bfloat16(), packed, dp, mp), q4_cpu.load().q4_linear(x.bfloat16(), packed, dp, mp))


@needs_q4
@pytest.mark.parametrize("rows", [1, 5])
def test_q8_head_is_the_kernels_reference_bit_for_bit(rows):
    """The LM head from Q8_0 blocks (w = d*s) runs the kernel's 8-bit form q = s + 128, m = -128 d: the
    reference's float operations exactly, each row its own, and close to x @ w.T (int8 inputs)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from adaflash.quant import q8_0_unpack

    rng = np.random.default_rng(rows)
    blocks = quantize(rng.normal(size=(64, 96)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0))  # [64, 96], the file's values
    s, d = (torch.from_numpy(a) for a in q8_0_unpack(blocks))
    assert torch.equal(s.float() * d.float().repeat_interleave(GROUP, 1), w)
    head = Q8Head(torch.nn.Parameter(w.clone(), requires_grad=False), s, d)
    x = torch.randn(rows, 96) * torch.logspace(-2, 1, rows)[:, None]
    d32 = d.float()
    with torch.no_grad():
        out = head(x)
        assert torch.equal(out, q4_cpu.reference(x, s.float() + 128, d32, -128 * d32))
        assert torch.equal(torch.cat([head(x[i : i + 1]) for i in range(rows)]), out)
        torch.testing.assert_close(out, x @ w.T, atol=0.02 * float((x @ w.T).abs().max()), rtol=0)
    assert torch.equal(head(x), torch.nn.functional.linear(x, w))  # with autograd on: the float matmul (training)
    with pytest.raises(ValueError, match="does not match"):
        Q8Head(torch.nn.Parameter(w[:48].clone()), s, d)


def test_int4_target_from_gguf_blocks(tmp_path):
    model = tiny_target(vocab=96, std=0.2)
    values = write_tiny_gguf(tmp_path / "tiny.gguf", model)
    for path, w in values.items():  # the float target with the file's values: the reference
        model.get_submodule(path).weight.copy_(w)
    quant = copy.deepcopy(model)
    info = quantise_target(quant, "int4", tmp_path / "tiny.gguf")
    assert info["converted"] == 4 * 7 and info["float_tensors"] == {"token_embd.weight": "F32"}
    assert weight_format(quant) == "int4" and weight_format(model) == "float"
    for path, w in values.items():
        assert torch.equal(quant.get_submodule(path).dequantised(), w), path
    ids = torch.tensor([[3, 17, 42, 8, 61, 5]])
    torch.testing.assert_close(quant(ids, quant.new_cache())[0], model(ids, model.new_cache())[0], atol=1e-4, rtol=1e-4)
    assert greedy_reference(quant, [3, 17, 42, 8], 24, []) == greedy_reference(model, [3, 17, 42, 8], 24, [])
    with pytest.raises(ValueError, match="Q4_1 blocks"):
        quantise_target(tiny_target(vocab=96), "int4")


@needs_q4
def test_q4_target_from_gguf_blocks_is_greedy_lossless(tmp_path):
    """The q4 target multiplies with the same Q4_1 blocks (bf16 activations, inputs rounded to int8 per 32):
    close to the float target, and greedy speculation (chain, tree, a batch) equals its own plain decoding."""
    from adaflash.engine import Engine, single_request_engine
    from adaflash.policies import FixedPolicy
    from adaflash.request import Request

    model = tiny_target(vocab=96, std=0.2, head_dim=32)  # a head dim the row-invariant attention kernel takes
    values = write_tiny_gguf(tmp_path / "tiny.gguf", model, embd_q8=True)
    for path, w in values.items():
        model.get_submodule(path).weight.copy_(w)
    quant = copy.deepcopy(model).to(torch.bfloat16)
    info = quantise_target(quant, "q4", tmp_path / "tiny.gguf", q8_head=True)  # (by default not on AMX CPUs)
    assert info["format"] == "q4" and info["converted"] == 4 * 7 and weight_format(quant) == "q4"
    assert info["head"] == "Q8_0" and isinstance(quant.lm_head, Q8Head)
    assert quant.lm_head.weight is quant.model.embed_tokens.weight  # still tied: lookups and drafting rows
    ids = torch.tensor([[3, 17, 42, 8, 61, 5]])
    ref = model(ids, model.new_cache())[0]
    torch.testing.assert_close(
        quant(ids, quant.new_cache())[0].float(), ref, atol=0.1 * float(ref.abs().max()), rtol=0
    )  # bf16, int8 inputs
    drafter = tiny_drafter(quant).to(torch.bfloat16)
    prompts = [[3, 17, 42, 8], [5, 9, 11, 30, 2, 2], [60, 1]]
    refs = [greedy_reference(quant, p, 24, []) for p in prompts]
    for p, ar in zip(prompts, refs):
        for kw in ({"verify_len": 5}, {"tree": 6, "lookup": 4}):
            assert single_request_engine(quant, drafter, [], **kw).generate(p, 24).out == ar
    states = Engine(quant, drafter, FixedPolicy(4), eos_ids=[], max_batch=3).run([Request(f"r{i}", p, 24) for i, p in enumerate(prompts)])
    assert [s.out for s in states] == refs


def test_target_dtype_names(tiny_hf_dir):
    assert resolve_target_dtype("int4") == (torch.bfloat16, "int4")
    assert resolve_target_dtype("int4-fp32") == (torch.float32, "int4")
    assert resolve_target_dtype("float32") == (torch.float32, None)
    assert resolve_target_dtype("q4") == (resolve_dtype("auto"), "q4")  # bfloat16 inputs only where this CPU runs them fast
    with pytest.raises(ValueError, match="target dtype must be one of"):
        resolve_target_dtype("int3")
    with pytest.raises(ValueError, match="quantised target's weight format"):
        resolve_dtype("int4")  # drafters and exports stay float
    with pytest.raises(ValueError, match="GGUF's Q4_1 blocks"):
        load_target(str(tiny_hf_dir), "int4")  # an HF directory has no Q4_1 blocks
    t = load_target(str(tiny_hf_dir), "int8")
    assert weight_format(t.model) == "int8" and t.model.dtype == torch.bfloat16 and t.identity["weights"] == "int8"
    assert t.identity["fingerprint"] == load_target(str(tiny_hf_dir), "float32").identity["fingerprint"]


@pytest.mark.slow
def test_smollm2_q4_1_blocks_are_the_float_copy(smollm2_dir):
    """All 210 projections of the packaged SmolLM2 are Q4_1 (the embedding is Q8_0, the norms F32), and
    the kernel's float32 form (q - 8) * d + (m + 8d) is the dequantised float32 copy bit for bit."""
    from safetensors.torch import load_file

    from adaflash.quant import gguf_q4_1
    from adaflash.target import packaged_gguf

    state = load_file(str(smollm2_dir / "model.safetensors"))
    blocks, kept = gguf_q4_1(packaged_gguf(), num_heads=9, num_kv_heads=3)
    assert len(blocks) == 30 * 7 and kept["token_embd.weight"] == "Q8_0" and set(kept.values()) == {"F32", "Q8_0"}
    for path, (q, d, m) in blocks.items():
        d32, m32 = d.astype(np.float32).repeat(GROUP, 1), m.astype(np.float32).repeat(GROUP, 1)  # [N, K]
        zero = m32 + 8 * d32
        np.testing.assert_array_equal(zero.astype(np.float64), m32.astype(np.float64) + 8 * d32.astype(np.float64))  # exact
        np.testing.assert_array_equal((q.astype(np.float32) - 8) * d32 + zero, state[f"{path}.weight"].numpy())


@pytest.mark.slow
def test_smollm2_int4_fp32_greedy_equals_float32():
    """int4-fp32 multiplies with the float32 target's own weights (above), so its plain greedy output is
    the float32 target's. (int4 with bf16 activations is another model: its reference is its own plain
    decoding, test_smollm2.py.)"""
    lines = (Path(__file__).resolve().parent.parent / "examples" / "prompts.jsonl").read_text().splitlines()[:2]
    f32, int4 = load_target("smollm2", "float32"), load_target("smollm2", "int4-fp32")
    assert weight_format(int4.model) == "int4" and int4.identity["fingerprint"] == f32.identity["fingerprint"]
    for line in lines:
        ids = f32.encode_chat(json.loads(line)["messages"])
        assert greedy_reference(int4.model, ids, 24, int4.eos_ids) == greedy_reference(f32.model, ids, 24, f32.eos_ids)


def test_serve_config_takes_quantised_dtypes_on_the_builtin_backend_only():
    from adaflash.server.config import ModelSection, ServeConfig

    assert ServeConfig(model=ModelSection(dtype="int4")).model.dtype == "int4"
    with pytest.raises(ValueError, match="model.dtype must be one of"):
        ModelSection(dtype="int3")
    with pytest.raises(ValueError, match="builtin engine only"):
        ServeConfig(model=ModelSection(dtype="int4", policy="fixed"), backend="vllm")
