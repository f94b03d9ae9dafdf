"""ServeConfig: the typed YAML config of `adaflash serve` (configs/serve_*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from adaflash.drafter import DEFAULT_DRAFTER, DRAFTER_DTYPES
from adaflash.policies import POLICY_NAMES, known_policy
from adaflash.target import TARGET_DTYPES, TARGET_QUANT_DTYPES


def _positive(section: str, **values) -> None:
    for name, v in values.items():
        if v is not None and v <= 0:
            raise ValueError(f"{section}.{name} must be > 0, got {v}")


@dataclass
class ModelSection:
    name: str = "smollm2"  # model id clients send in "model" and /v1/models lists
    aliases: list[str] = field(default_factory=lambda: ["adaflash"])  # other accepted "model" values
    target: str = "smollm2"  # 'smollm2' (packaged GGUF), a .gguf file or an HF model directory
    dtype: str = "float32"  # target dtype: float32, or bfloat16 / int4 / q4 where the CPU runs them fast (lossless too: the guide)
    drafter: str = str(DEFAULT_DRAFTER)  # drafter directory (config.json + model.safetensors [+ length head])
    drafter_dtype: str = "auto"  # auto: q4 on an AVX-512 VNNI CPU without AMX, else bf16 where fast (drafts need not be exact)
    drafter_version: str = "0"  # version label of the initial drafter (the registry's after a hot-swap)
    # auto (cost on a CPU; on a GPU head where the drafter has one, else fixed) | head | cost | fixed[K] | ema | ar;
    # backend vllm: auto / cost draft per step by batch size (a schedule re-chosen from live acceptance), fixed[K], ar
    policy: str = "auto"

    def __post_init__(self):
        if not self.name.strip():
            raise ValueError("model.name must not be empty")
        if not known_policy(self.policy):
            raise ValueError(f"model.policy must be one of {POLICY_NAMES}, got {self.policy!r}")
        if self.dtype not in TARGET_DTYPES:
            raise ValueError(f"model.dtype must be one of {', '.join(TARGET_DTYPES)}, got {self.dtype!r}")
        if self.drafter_dtype not in DRAFTER_DTYPES:
            raise ValueError(f"model.drafter_dtype must be one of {', '.join(DRAFTER_DTYPES)}, got {self.drafter_dtype!r}")

    @property
    def fixed_len(self) -> int | None:
        """K of policy fixedK (tokens verified per step); None for plain `fixed` and the other policies."""
        return int(self.policy[5:]) if self.policy.startswith("fixed") and self.policy[5:] else None


@dataclass
class EngineSection:
    max_batch: int = 16  # requests decoded together
    token_budget: int = 512  # max verify tokens per engine step (also the longest prompt admitted; vLLM: max_num_batched_tokens)
    max_queued: int = 64  # requests waiting for a batch slot before new ones get 429
    max_model_len: int | None = None  # context limit (prompt + max_tokens); default and cap: the target's
    default_max_tokens: int = 256  # max_tokens when a request gives none (capped by the context left)
    max_tokens_limit: int = 4096  # largest max_tokens a request may ask for
    lookup: int = 4  # prompt lookup: verify up to this many tokens copied from earlier text instead of drafting
    # (0 = off; applies to every policy, so policy ar + lookup is prompt-lookup decoding without a drafter)
    lookup_min_ngram: int = 2  # ... when the text's last N tokens (N = 3 down to this) occurred before
    tree: int = 0  # greedy requests verify a token tree of this many drafted nodes, the lookup chain grafted in
    # (0 = chains; the policy then decides for sampling requests only; 8 with lookup 8 is the fastest single request here)

    def __post_init__(self):
        _positive(
            "engine",
            max_batch=self.max_batch,
            token_budget=self.token_budget,
            max_queued=self.max_queued,
            max_model_len=self.max_model_len,
            default_max_tokens=self.default_max_tokens,
            max_tokens_limit=self.max_tokens_limit,
        )
        if self.lookup < 0:
            raise ValueError(f"engine.lookup must be >= 0 (0 = off), got {self.lookup}")
        if not 1 <= self.lookup_min_ngram <= 3:
            raise ValueError(f"engine.lookup_min_ngram must be 1, 2 or 3, got {self.lookup_min_ngram}")
        if self.tree < 0:
            raise ValueError(f"engine.tree must be >= 0 (0 = chains), got {self.tree}")


@dataclass
class TrajectorySection:
    enabled: bool = True  # record every finished request for the online trainer
    buffer_dir: str = "runs/buffer"  # ShardWriter root (the trainer's ShardReader reads it)
    writer_id: str | None = None  # default: <hostname>-<pid>
    rows_per_shard: int = 64
    max_age_s: float = 30.0  # publish a partial shard when its oldest row is this old

    def __post_init__(self):
        _positive("trajectories", rows_per_shard=self.rows_per_shard, max_age_s=self.max_age_s)


@dataclass
class RegistrySection:
    tracking_uri: str | None = None  # MLflow tracking server; set it to hot-swap drafters from the registry
    model_name: str = "adaflash-drafter"  # registered model holding the drafter versions
    cache_dir: str = "runs/serve/registry-cache"  # downloaded drafter versions
    interval_s: float = 30.0  # registry poll period
    retries: int = 5  # connection retries per registry call (backoff 0.5 s, doubling) before a poll counts as failed

    # automatic rollback (server/guard.py): judge a newly promoted version on live traffic against the one it replaced
    rollback: bool = True  # move champion back when the new version's live tau is clearly below its predecessor's
    rollback_window: int = 20  # finished requests of each version the test compares
    rollback_z: float = 3.0  # ... one-sided Welch statistic it needs (3: ~1 in 700 for equal versions)
    rollback_min_drop: float = 0.05  # ... and at least this relative drop of mean tau

    def __post_init__(self):
        _positive("registry", interval_s=self.interval_s, rollback_z=self.rollback_z)
        if self.rollback_window < 2:
            raise ValueError(f"registry.rollback_window must be >= 2 requests, got {self.rollback_window}")
        if not 0 <= self.rollback_min_drop < 1:
            raise ValueError(f"registry.rollback_min_drop must be in [0, 1), got {self.rollback_min_drop}")
        if self.retries < 0:
            raise ValueError(f"registry.retries must be >= 0, got {self.retries}")


@dataclass
class VLLMSection:
    """`backend: vllm`: stock vLLM serves the target and the exported drafter (server/vllm_backend.py)."""

    python: str | None = None  # vLLM venv's python (default $ADAFLASH_VLLM_PYTHON or .venv-vllm, from `make vllm`)
    port: int = 0  # loopback port of the vLLM child server (0 = any free port)
    work_dir: str = "runs/serve/vllm"  # exported drafter versions and vllm.log
    kv_cache_gb: int = 2  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    threads: int | None = None  # OMP_NUM_THREADS of vLLM (default: all cores; vLLM-CPU uses 1 unless told)
    enforce_eager: bool = True  # needed for hot-swaps on vLLM-CPU (a compiled graph can keep old weights)
    startup_timeout_s: float = 600.0  # vLLM loads and warms up the models (about a minute here)
    mask_token_id: int = 15  # placeholder id of the DFlash MASK slot (its embedding is the drafter's learned mask)
    extra_args: list[str] = field(default_factory=list)  # more `vllm serve` flags, passed through
    follow_every: int = 16  # policy cost: finished requests between re-choices of the schedule from live acceptance (0: fixed)

    def __post_init__(self):
        _positive("vllm", kv_cache_gb=self.kv_cache_gb, threads=self.threads, startup_timeout_s=self.startup_timeout_s)
        if self.follow_every < 0:
            raise ValueError(f"vllm.follow_every must be >= 0 (0 = the start-up schedule stays), got {self.follow_every}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"vllm.port must be in 0..65535 (0 = any free port), got {self.port}")


@dataclass
class SGLangSection:
    """`backend: sglang`: stock SGLang (DFLASH) serves the target and the exported drafter (server/sglang_backend.py)."""

    python: str | None = None  # SGLang venv's python (default $ADAFLASH_SGLANG_PYTHON, /opt/sglang, .venv-sglang)
    port: int = 0  # loopback port of the SGLang child server (0 = any free port)
    work_dir: str = "runs/serve/sglang"  # exported drafters, the mask-carrying target copies and sglang.log
    mem_fraction_static: float = 0.8  # --mem-fraction-static: GPU memory share for weights + KV cache
    startup_timeout_s: float = 900.0  # SGLang loads both models and captures CUDA graphs
    mask_token_id: int = 15  # target row that carries the drafter's learned MASK (a token the target never writes)
    swap: str = "auto"  # auto: in place, checked, else restart | inplace: in place, checked, or refuse | restart
    swap_request: dict = field(default_factory=dict)  # fields added to /update_weights_from_disk to select the draft
    # model (builds with a draft selector, e.g. {"update_speculative_draft": true}); stock builds have none
    probe_tokens: int = 48  # greedy tokens of each swap probe (the check that the draft changed and the target did not)
    extra_args: list[str] = field(default_factory=list)  # more `sglang.launch_server` flags, passed through

    def __post_init__(self):
        _positive("sglang", startup_timeout_s=self.startup_timeout_s, probe_tokens=self.probe_tokens)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"sglang.port must be in 0..65535 (0 = any free port), got {self.port}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"sglang.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.swap not in ("auto", "inplace", "restart"):
            raise ValueError(f"sglang.swap must be auto, inplace or restart, got {self.swap!r}")
        if self.mask_token_id < 0:
            raise ValueError(f"sglang.mask_token_id must be >= 0, got {self.mask_token_id}")


BACKENDS = ("builtin", "vllm", "sglang")


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None  # Bearer key for /v1/*; --api-key and $ADAFLASH_API_KEY override it
    shutdown_grace_s: float = 10.0  # on SIGINT/SIGTERM: in-flight requests get this long, then are cancelled
    log_level: str = "info"
    backend: str = "builtin"  # builtin (AdaFlash's engine) | vllm (stock vLLM, `make vllm`) | sglang (stock SGLang, a GPU)
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineSection = field(default_factory=EngineSection)
    trajectories: TrajectorySection = field(default_factory=TrajectorySection)
    registry: RegistrySection = field(default_factory=RegistrySection)
    vllm: VLLMSection = field(default_factory=VLLMSection)
    sglang: SGLangSection = field(default_factory=SGLangSection)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend != "builtin" and self.model.dtype in TARGET_QUANT_DTYPES:
            raise ValueError(f"model.dtype {self.model.dtype}: a quantised target runs on the builtin engine only, not {self.backend}")
        # stock engines have no per-request knob; vLLM takes a draft length per batch size (the cost policy's schedule)
        per_step = ("head", "ema") if self.backend == "vllm" else ("head", "ema", "cost")
        if self.backend != "builtin" and self.model.policy in per_step:
            cost = ", cost (drafts per step by batch size, re-chosen from live acceptance)" if self.backend == "vllm" else ""
            raise ValueError(
                f"model.policy {self.model.policy!r} needs the builtin backend; with backend {self.backend} use "
                f"auto or fixed (verify the whole block), fixedK (K tokens per step){cost} or ar (no drafter)"
            )
        if self.engine.tree and (self.backend != "builtin" or self.model.policy == "ar"):
            raise ValueError("engine.tree needs the builtin backend and a drafter (model.policy other than ar)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(f"log_level must be one of critical, error, warning, info, debug; got {self.log_level!r}")
