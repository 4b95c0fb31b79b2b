#!/usr/bin/env bash
# The PyTorch FP8 peer of the benchmark (scripts/train_llama.py --bench --fp8) on the GPU: its FP8
# linear layer's output and both gradients against the same product in FP32, within what E4M3 and
# E5M2 rounding of the operands allows (about 5% and 8% relative error on random data), and a
# benchmark run of the tiny model that prints its throughput. Needs python3 with torch.
cd "$(dirname "$0")/.." || exit 1
source test/check.sh
if ! python3 -c 'import torch; assert torch.cuda.is_available()' 2> /dev/null; then
    echo "SKIP: no torch with a GPU"
    check_summary test_pytorch_fp8
    exit
fi

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
out=$(cd scripts && python3 - <<'PY' 2>"$tmp/err"
import torch
from train_llama import FP8LinearFunction
torch.manual_seed(0)
x = torch.randn(4, 96, 768, device="cuda", requires_grad=True)
w = torch.randn(256, 768, device="cuda", requires_grad=True)
dy = torch.randn(4, 96, 256, device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    y = FP8LinearFunction.apply(x, w)
y.backward(dy)
x32, w32 = x.detach().bfloat16().float(), w.detach().bfloat16().float()
def relative(a, b):
    return ((a.float() - b).norm() / b.norm()).item()
print(f"forward {relative(y, x32 @ w32.t()):.4f} dx {relative(x.grad, dy @ w32):.4f} "
      f"dw {relative(w.grad, dy.reshape(-1, 256).t() @ x32.reshape(-1, 768)):.4f} dtypes {y.dtype} {w.grad.dtype}")
PY
)
read -r _ fwd _ dx _ dw _ dtypes <<< "$(tail -1 <<< "$out")"
check "FP8Linear: output within 8% of the FP32 product ($fwd), dx and dW within 15% ($dx, $dw), BF16 out, FP32 weight gradient" \
    "$(awk -v f="$fwd" -v a="$dx" -v b="$dw" 'BEGIN { exit !(f > 0 && f < 0.08 && a > 0 && a < 0.15 && b > 0 && b < 0.15) }' &&
       [ "$dtypes" = "torch.bfloat16 torch.float32" ]; echo $?)" "$out $(tail -3 "$tmp/err")"
out=$(python3 scripts/train_llama.py --bench --fp8 --config configs/models/tiny.conf --batch 4 --seq 64 --steps 3 --warmup 1 2>"$tmp/err")
check "train_llama.py --bench --fp8 trains the tiny model and prints its tokens/s" \
    "$(printf '%s' "$out" | tail -1 | python3 -c 'import json, sys; r = json.loads(sys.stdin.read()); sys.exit(not (r["impl"] == "pytorch-fp8" and r["tokens_per_s"] > 0))'; echo $?)" "$out $(tail -3 "$tmp/err")"
check_summary test_pytorch_fp8
