"""Measurements behind docs/benchmarks.md's quantised-target section (issue 21 item 3).

  python scripts/quant_check.py forward float32,bfloat16,int4,int8,int4-fp32
      one SmolLM2 forward of N new tokens (one request, packed rows) on a 64-token cache per target
      dtype, best of 7 (3 for 128 rows): total ms (the 210 projections alone + the LM head alone)
  python scripts/quant_check.py compare A.jsonl B.jsonl
      two `adaflash generate --json` outputs of the same prompts: identical prompts, first divergences
  python scripts/quant_check.py nll PROMPTS.jsonl OUT.jsonl [OUT.jsonl ...]
      how likely the float32 target finds each `adaflash generate --json` output (another dtype's greedy
      text): mean negative log-likelihood per token, and the share of tokens that are its own greedy pick
  python scripts/quant_check.py dqref PROMPTS.jsonl [MAX_NEW]
      int4 (bf16 activations) vs its dequantised reference: a bfloat16 SmolLM2 whose projection
      weights are the int4 kernel's own (Int4Linear.dequantised()), plain greedy through the engine
Run with OMP_NUM_THREADS=1 on a shared machine.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def best_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def forward(dtypes: list[str]) -> None:
    from adaflash.target import load_target

    print("| dtype | " + " | ".join(f"{n} rows" for n in (1, 4, 16, 32, 128)) + " |")
    for name in dtypes:
        m = load_target("smollm2", name).model
        cache = m.new_cache(1, 512)
        m.forward_packed([torch.randint(0, m.config.vocab_size, (64,))], [cache])
        cells = []
        for n in (1, 4, 16) if name.endswith("fp32") else (1, 4, 16, 32, 128):  # the fp32 int kernels are slow
            toks = torch.randint(0, m.config.vocab_size, (n,))
            x, xi = torch.randn(n, m.config.hidden_size).to(m.dtype), torch.randn(n, m.config.intermediate_size).to(m.dtype)

            def step():
                m.forward_packed([toks], [cache])
                cache.crop(64)

            def projections():
                for layer in m.model.layers:
                    a, mlp = layer.self_attn, layer.mlp
                    a.q_proj(x), a.k_proj(x), a.v_proj(x), a.o_proj(x), mlp.gate_proj(x), mlp.up_proj(x), mlp.down_proj(xi)

            reps = 7 if n <= 32 else 3
            cells.append(f"{best_ms(step, reps):.1f} ({best_ms(projections, reps):.1f} + {best_ms(lambda: m.lm_head(x), reps):.1f})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def report(a: list[list[int]], b: list[list[int]]) -> None:
    div = [first_divergence(x, y) for x, y in zip(a, b)]
    agree = sum(len(x) if d is None else d for x, d in zip(a, div))
    print(
        f"{sum(d is None for d in div)}/{len(a)} prompts identical; {agree}/{sum(map(len, a))} tokens before the first "
        f"divergence; first divergence of the others at {[d for d in div if d is not None]}"
    )


def compare(path_a: str, path_b: str) -> None:
    def ids(p):
        return [json.loads(line)["output_ids"] for line in open(p) if line.strip()]

    report(ids(path_a), ids(path_b))


@torch.no_grad()
def nll(prompts: str, outputs: list[str]) -> None:
    from adaflash.target import load_target

    target = load_target("smollm2", "float32")
    messages = [json.loads(line)["messages"] for line in open(prompts) if line.strip()]
    for path in outputs:
        total, n, agree = 0.0, 0, 0
        for row in (json.loads(line) for line in open(path) if line.strip()):
            prompt, out = target.encode_chat(messages[row["index"]]), row["output_ids"]
            ids = torch.tensor([prompt + out])  # [1, P + T]
            logits, _ = target.model(ids, target.model.new_cache(1, ids.shape[1]))
            logp = logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)  # [T, V] predicting each output token
            tokens = torch.tensor(out)
            total -= float(logp.gather(1, tokens[:, None]).sum())
            agree += int((logp.argmax(-1) == tokens).sum())
            n += len(out)
        print(f"{path}: {total / n:.3f} nats/token under the float32 target; its greedy pick at {agree / n:.1%} of tokens")


@torch.no_grad()
def dqref(prompts: str, max_new: int) -> None:
    from adaflash.engine import single_request_engine
    from adaflash.quant import Int4Linear
    from adaflash.target import load_target

    items = [json.loads(line) for line in open(prompts) if line.strip()]
    quant, ref = load_target("smollm2", "int4"), load_target("smollm2", "bfloat16")
    changed = 0
    for name, mod in quant.model.named_modules():
        if isinstance(mod, Int4Linear):
            w, lin = mod.dequantised().to(torch.bfloat16), ref.model.get_submodule(name)
            changed += int((w != lin.weight).sum())
            lin.weight.copy_(w)
    print(f"bf16 projection weights set to the int4 kernel's: {changed} changed")
    outs = []
    for t in (quant, ref):
        engine = single_request_engine(t.model, None, t.eos_ids)
        outs.append([engine.generate(t.encode_chat(it["messages"]), max_new).out for it in items])
    report(*outs)


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "forward":
        forward(rest[0].split(","))
    elif cmd == "compare":
        compare(*rest)
    elif cmd == "nll":
        nll(rest[0], rest[1:])
    elif cmd == "dqref":
        dqref(rest[0], int(rest[1]) if len(rest) > 1 else 64)
    else:
        raise SystemExit(__doc__)
