"""Where offline pretraining's drafter starts (`drafter:` of the pretrain config): a new drafter (random
weights, or the target's own last layers), or an existing one to continue (a drafter directory such as
the committed one, or `registry:<version|alias>`), copied once into run_dir/init so resumes and the
export do not depend on where it came from (the gate may replace it meanwhile)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from adaflash.pipelines.gate import install_drafter

from adaflash.drafter import CONFIG, DRAFT_VOCAB, Drafter, DrafterConfig, deepen, load_drafter
from adaflash.target import Target

if TYPE_CHECKING:
    from adaflash.pipelines.pretrain import PretrainConfig

NEW_INITS = ("random", "target-last")  # drafter.init values that build a new drafter; anything else names one
REGISTRY = "registry:"  # drafter.init prefix of an MLflow registry version or alias
START = "start.json"  # beside the run's copy of its init drafter: what drafter.init named


@dataclass
class DrafterSection:
    init: str = "random"  # "random"; "target-last": the target's last layers (init_from_target); a drafter
    #                       directory or "registry:<version|alias>": continue training that drafter
    num_layers: int | None = None  # None: the init drafter's, else 3; above the init drafter's: it is deepened
    #                                (`drafter.deepen`: new layers start as the identity), below it is refused
    block_size: int | None = None  # None: the init drafter's, else 16
    qk_norm: bool | None = None  # per-head q/k RMSNorm (Qwen3 style; match the target's for target-last); None: the init's, else true
    draft_vocab: str | None = None  # a drafter directory whose draft vocabulary a new drafter drafts from
    #                                 (trained with that head under train.vocab draft, exported with it); None = all
    tracking_uri: str | None = None  # MLflow server of a registry: init; None = $MLFLOW_TRACKING_URI, else http://127.0.0.1:5000
    model_name: str = "adaflash-drafter"  # registered model of a registry: init

    def __post_init__(self):
        if self.init in NEW_INITS:
            self.num_layers = 3 if self.num_layers is None else self.num_layers
            self.block_size = 16 if self.block_size is None else self.block_size
            self.qk_norm = True if self.qk_norm is None else self.qk_norm
        elif self.init.startswith(REGISTRY) and not self.init.removeprefix(REGISTRY):
            raise ValueError(f"init {self.init!r} names no version: e.g. registry:champion or registry:3")
        elif not self.init.startswith(REGISTRY) and not (Path(self.init) / CONFIG).exists():
            raise ValueError(
                f"init must be 'random', 'target-last', a drafter directory or 'registry:<version|alias>', got {self.init!r} "
                f"(no {CONFIG} there)"
            )
        if self.draft_vocab is not None and self.continues:
            raise ValueError(f"draft_vocab: a drafter continued from {self.init} keeps its draft vocabulary; remove drafter.draft_vocab")
        if self.draft_vocab is not None and not (Path(self.draft_vocab) / DRAFT_VOCAB).exists():
            raise ValueError(f"drafter.draft_vocab: {self.draft_vocab}/{DRAFT_VOCAB} is missing (make it with `adaflash draft-vocab`)")

    @property
    def continues(self) -> bool:
        """Whether training continues an existing drafter (init names one) rather than building a new one."""
        return self.init not in NEW_INITS


def new_drafter(cfg: "PretrainConfig", target: Target) -> Drafter:
    """The configured drafter (random weights), with drafter.draft_vocab's draft vocabulary when set."""
    dc = cfg.drafter
    drafter = Drafter(DrafterConfig.for_target(target.model, target.identity, dc.num_layers, dc.block_size, dc.qk_norm), target.model)
    if dc.draft_vocab is not None:
        from safetensors.torch import load_file

        drafter.set_vocab(load_file(str(Path(dc.draft_vocab) / DRAFT_VOCAB))["ids"])
    return drafter


@torch.no_grad()
def init_from_target(drafter: Drafter, target: Target) -> None:
    """Start the drafter from the target's own last layers and final norm, with `fc` passing the
    deepest feature layer through: a language-aware starting point (on SmolLM2 it reached the loss a
    random start needs ~400 steps for in ~50)."""
    layers = target.model.model.layers
    for d_layer, t_layer in zip(drafter.layers, layers[len(layers) - len(drafter.layers) :]):
        d_layer.load_state_dict({k: v.float() for k, v in t_layer.state_dict().items()}, strict=False)
    drafter.norm.weight.copy_(target.model.model.norm.weight.float())
    h = drafter.config.hidden_size
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, -h:] = torch.eye(h)  # the deepest target layer's features
    deepest = drafter.config.target_layer_ids[-1]
    drafter.hidden_norm.weight.copy_(layers[min(deepest + 1, len(layers) - 1)].input_layernorm.weight.float())


def init_copy(cfg: "PretrainConfig", run_dir: Path) -> Path:
    """drafter.init as this run's own directory, run_dir/init: copied from the drafter directory it names or
    downloaded from the MLflow registry on the first call, reused by resumes and the export (a run that was
    started from another init is refused)."""
    dest, spec = run_dir / "init", cfg.drafter.init
    if (dest / START).exists():
        started = json.loads((dest / START).read_text())
        if started["init"] != spec:
            raise ValueError(f"{run_dir} was started from drafter.init {started['init']}, the config now says {spec}: use another run_dir")
        return dest
    version = None
    if spec.startswith(REGISTRY):
        from adaflash.registry import Registry

        uri = cfg.drafter.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
        registry = Registry(uri, cfg.drafter.model_name)
        version = registry.resolve(spec.removeprefix(REGISTRY))
        src = registry.download(version, run_dir / "registry")
    else:
        src = Path(spec)
    return install_drafter(src, dest, {START: json.dumps({"init": spec, "version": version, "source": str(src)}) + "\n"})


def start_drafter(cfg: "PretrainConfig", target: Target, run_dir: Path) -> Drafter:
    """The drafter training starts from (and the export fills): the one drafter.init names, with its
    architecture and draft vocabulary, after checking it fits the config and the target; else a new one
    (random, or the target's last layers). A resumed run then loads its checkpoint over it."""
    dc = cfg.drafter
    if not dc.continues:
        drafter = new_drafter(cfg, target)
        if dc.init == "target-last":
            if dc.qk_norm != target.model.config.qk_norm:
                raise ValueError(
                    "drafter.init target-last copies the target's attention: set drafter.qk_norm to the "
                    f"target's style ({target.model.config.qk_norm})"
                )
            init_from_target(drafter, target)
        return drafter
    src = init_copy(cfg, run_dir)
    try:
        drafter = load_drafter(src, target.model, target.identity, torch.float32)  # refuses another target's drafter
    except (ValueError, RuntimeError) as e:
        raise ValueError(
            f"drafter.init {dc.init} cannot continue on target {cfg.target.source}: {e}. Continue from a drafter trained "
            "for this target, or start a new one (drafter.init: random)"
        ) from e
    if dc.num_layers is not None and dc.num_layers > drafter.config.num_layers:
        drafter = deepen(drafter, target.model, dc.num_layers)
    for key in ("num_layers", "block_size", "qk_norm"):
        want, have = getattr(dc, key), getattr(drafter.config, key)
        if want is not None and want != have:
            raise ValueError(
                f"drafter.{key} is {want} but the init drafter {dc.init} has {have}: the architecture comes from the "
                f"init drafter (only num_layers may grow); remove drafter.{key} (or start a new drafter with drafter.init: random)"
            )
    drafter.attach(target.model)  # the target's own frozen head and embedding (bf16 when training under autocast), as a new drafter
    return drafter.train().requires_grad_(True)
