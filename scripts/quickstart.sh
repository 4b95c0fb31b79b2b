#!/usr/bin/env bash
# The main job end to end: build, fetch the Llama 2 tokenizer and build the local corpus, train
# llama-125m on it and plot its curves. Without a GPU it does the setup and stops before training.
# Extra arguments go to train_llama (for example --max_steps=100).
set -euo pipefail
cd "$(dirname "$0")/.."
make -j"$(nproc)" all
scripts/fetch_tokenizers.sh
scripts/fetch_corpus.sh
config=configs/llama-125m-corpus.conf
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    ./train_llama "$config" --dry_run=1 "$@"
    echo
    echo "Setup is complete, but training needs an NVIDIA GPU (Hopper for fp8 and coat) and none was found."
    echo "On a GPU machine, run: scripts/quickstart.sh"
    exit 0
fi
# The plot at the end needs matplotlib: say so now, not after ten minutes of training.
if ! python3 -c 'import matplotlib' 2>/dev/null; then
    echo "error: scripts/plot_curves.py needs matplotlib for the curves (apt-get install python3-matplotlib, or pip install matplotlib)" >&2
    exit 1
fi
./train_llama "$config" "$@"
out_dir=$(sed -n 's/^out_dir *= *//p' "$config")
python3 scripts/plot_curves.py "$out_dir/curves.png" "$out_dir:llama-125m bf16"
echo "curves: $out_dir/curves.png"
