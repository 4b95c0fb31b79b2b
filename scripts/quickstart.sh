#!/usr/bin/env bash
# The main job end to end: build, fetch the Llama 2 tokenizer and build the local corpus, train
# llama-125m on it and plot its curves. Without a GPU it does the setup and stops before training.
# Extra arguments go to train_llama (for example --max_steps=100, --out_dir=out/mine).
set -euo pipefail
cd "$(dirname "$0")/.."
config=configs/llama-125m-corpus.conf
# The arguments are checked before minutes of build and download: each one --key=value with a key
# of the trainer's config table (coat/config.h; its model keys in coat/model_shape.h); the trainer
# checks the values. The last --out_dir is where the run and its curves go.
keys=$(sed -n 's/^ *{"\([a-z0-9_]*\)", KEY_.*/\1/p' coat/config.h; sed -n 's/^ *X(\([a-z0-9_]*\), .*/\1/p' coat/model_shape.h)
out_dir=$(sed -n 's/^out_dir *= *//p' "$config")
for argument in "$@"; do
    key=${argument#--}
    key=${key%%=*}
    if [[ $argument != --?*=* ]] || ! grep -qx -- "$key" <<< "$keys"; then
        echo "error: $argument: not --key=value with a key of train_llama's config (./train_llama --help lists them)" >&2
        exit 2
    fi
    if [ "$key" = out_dir ]; then out_dir=${argument#--out_dir=}; fi
done
has_gpu=0
if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then has_gpu=1; fi
# The plot at the end needs matplotlib: say so now, not after the setup and ten minutes of training.
if [ "$has_gpu" -eq 1 ] && ! python3 -c 'import matplotlib' 2>/dev/null; then
    echo "error: scripts/plot_curves.py needs matplotlib for the curves (apt-get install python3-matplotlib, or pip install matplotlib)" >&2
    exit 1
fi
make -j"$(nproc)" all
scripts/fetch_tokenizers.sh
scripts/fetch_corpus.sh
if [ "$has_gpu" -eq 0 ]; then
    ./train_llama "$config" --dry_run=1 "$@"
    echo
    echo "Setup is complete, but training needs an NVIDIA GPU (Hopper for fp8 and coat) and none was found."
    echo "On a GPU machine, run: scripts/quickstart.sh"
    exit 0
fi
./train_llama "$config" "$@"
python3 scripts/plot_curves.py "$out_dir/curves.png" "$out_dir:llama-125m bf16"
echo "curves: $out_dir/curves.png"
