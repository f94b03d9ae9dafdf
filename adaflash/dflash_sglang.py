"""What SGLang needs beside a DFlash export: the learned MASK inside the target it serves.

SGLang's DFlash worker (srt/speculative/dflash_worker.py) builds each draft block as the TARGET's
embedding of [anchor, mask_token_id x (K-1)]: it has no place for a separately learned mask (the
`mask_embedding` tensor of an AdaFlash export is an unknown weight to it and is skipped, and vLLM's
`mask_embedding.pt` is not read). So the mask travels in the target: `write_sglang_target` writes a
copy of the target directory whose embedding row `mask_token_id` is the drafter's learned mask and
whose LM head is the original embedding, written out untied. The target's logits are unchanged;
only a prompt or output containing `mask_token_id` itself would see the new row, which is why the
id is a special token the target never writes (SmolLM2's 15) and the SGLang backend refuses prompts
that contain it.

SGLang also drafts through the target's full LM head: a reduced draft vocabulary (`lm_head` + `d2t`
in the export) is skipped there, so such a drafter drafts over the whole vocabulary in SGLang.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from adaflash.venvs import REPO, venv_python

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
REPO_VENV = REPO / ".venv-sglang" / "bin" / "python"
DOCKER_VENV = Path("/opt/sglang/bin/python")  # the cuda image built with WITH_SGLANG=1


def write_sglang_target(target_dir: str | Path, out: str | Path, mask_token_id: int, mask: torch.Tensor) -> Path:
    """A copy of HF target directory `target_dir` at `out` with embedding row `mask_token_id` = `mask` [H]
    and an untied LM head equal to the original embedding; -> out. Files other than the weights and
    config.json are linked, not copied. The weights are written as one model.safetensors."""
    from safetensors.torch import load_file, save_file

    src, out = Path(target_dir), Path(out)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} has no *.safetensors weights (SGLang's target must be an HF safetensors directory)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if EMBED not in state:
        raise ValueError(f"{src}: no {EMBED} among the weights; cannot carry the MASK in the target's embedding")
    embed = state[EMBED]  # [V, H]
    if not 0 <= mask_token_id < embed.shape[0]:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the target's vocabulary [0, {embed.shape[0]})")
    if mask.numel() != embed.shape[1]:
        raise ValueError(f"mask of {mask.numel()} values for a target of hidden size {embed.shape[1]}")
    state.setdefault(HEAD, embed.clone())  # a tied head keeps the original row: the target's logits do not change
    patched = embed.clone()
    patched[mask_token_id] = mask.reshape(-1).to(embed.dtype)
    state[EMBED] = patched
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json") and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    tmp = out / ".model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    cfg["adaflash_mask_row"] = mask_token_id  # a note for people reading the directory; engines ignore it
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def sglang_python(configured: str | None) -> Path:
    """The Python of SGLang's own venv: the config's, $ADAFLASH_SGLANG_PYTHON, /opt/sglang (the cuda
    image) or the repo's .venv-sglang; raises with what to install when none exists."""
    return venv_python(
        "SGLang", configured, "ADAFLASH_SGLANG_PYTHON", [DOCKER_VENV, REPO_VENV],
        "SGLang runs on a CUDA GPU (or an Intel AMX CPU, built from source); install it in its own venv, e.g. "
        "`python -m venv .venv-sglang && .venv-sglang/bin/pip install 'sglang[all]'` (or build the cuda image with "
        "WITH_SGLANG=1: /opt/sglang), then set sglang.python or $ADAFLASH_SGLANG_PYTHON",
    )  # fmt: skip
