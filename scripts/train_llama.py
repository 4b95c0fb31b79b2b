#!/usr/bin/env python3
"""The PyTorch reference of our Llama model (the same math as train_llama.cu), in three modes:

  --debug-state OUT.bin --config CONF [--batch B --seq T --steps N --seed S --lr LR]
      FP32 model, one random batch: writes the initial weights, the batch, logits, loss and every
      gradient, then the loss before each of N AdamW steps on that batch (format below)
  --bench --config CONF --batch B [--seq T] [--compile] [--fp8] [--steps N --warmup W] [--profile]
          [--exact-attention]
      training throughput as a user runs it (BF16 autocast, FP32 master weights, fused AdamW,
      SDPA flash attention): one JSON line; --fp8 puts the block's linear layers on FP8 GEMMs
      (FP8Linear: the PyTorch FP8 peer of coat/README.md); --profile adds, on stderr, the GPU
      kernels of two more steps by total time (torch.profiler); --exact-attention writes
      attention out instead of SDPA (the memory of an attention that stores its probabilities)
  --logits CKPT --tokens "1 2 3" [--out FILE]
      our checkpoint in this model, FP32: logits statistics as JSON; FILE gets the logits in the
      format check_hf_export.py reads

Model: pre-norm Llama. RMSNorm y = x * rsqrt(mean(x^2) + eps) * w in FP32; RoPE half-split (x_i,
x_{i+hd/2}) rotated by t * inv_freq_i; causal GQA attention (query head h reads kv head
h // (NH/NKV)), scale 1/sqrt(hd); MLP down(silu(gate(x)) * up(x)); untied lm_head; no biases;
loss = mean cross-entropy. Weights are [out, in] (nn.Linear); module names are the HF names, so
state_dict() keys are the names of scripts/llama_layout.py.

Debug state file (little-endian): int32 header[256] (llama_layout.pack_debug_state_header), then
float32 params[total_padded] (our layout, zero padding), int32 tokens[B*T], int32 targets[B*T],
float32 logits[B*T*V], float32 loss, float32 grads[total_padded], float32 losses[steps].
"""
import argparse
import json
import math
import os
import statistics
import struct
import sys

import torch
import torch.nn.functional as F
from torch import nn

from llama_layout import (CHECKPOINT_HEADER_BYTES, FormatError, ModelShape, ParamLayout, model_shape_from_config,
                          open_regular, pack_debug_state_header, pack_logits_header, read_checkpoint_header, read_config,
                          rope_inv_frequencies)

BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
BF16_DENSE_PEAK_FLOPS = 989e12  # H200 datasheet, dense BF16 (coat/README.md)


# ---- model ----------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def apply_rope(x, cos, sin):
    """x [B, heads, T, hd]; cos, sin [T, hd/2] FP32. Rotates the pairs (i, i + hd/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def causal_attention_exact(q, k, v):
    """Softmax attention written out, for the FP32 reference: q [B, NH, T, hd], k, v [B, NKV, T, hd]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # head h -> kv head h // group
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    T = q.shape[-2]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, exact: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = shape.n_heads, shape.n_kv_heads, shape.head_dim
        self.exact = exact
        self.q_proj = nn.Linear(shape.dim, shape.n_heads * shape.head_dim, bias=False)
        self.k_proj = nn.Linear(shape.dim, shape.n_kv_heads * shape.head_dim, bias=False)
        self.v_proj = nn.Linear(shape.dim, shape.n_kv_heads * shape.head_dim, bias=False)
        self.o_proj = nn.Linear(shape.n_heads * shape.head_dim, shape.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.exact:
            y = causal_attention_exact(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.dim, shape.ffn_dim, bias=False)
        self.up_proj = nn.Linear(shape.dim, shape.ffn_dim, bias=False)
        self.down_proj = nn.Linear(shape.ffn_dim, shape.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, shape: ModelShape, exact: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.dim, shape.norm_eps)
        self.self_attn = Attention(shape, exact)
        self.post_attention_layernorm = RMSNorm(shape.dim, shape.norm_eps)
        self.mlp = MLP(shape)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, shape: ModelShape, exact: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.dim)
        self.layers = nn.ModuleList(Block(shape, exact) for _ in range(shape.n_layers))
        self.norm = RMSNorm(shape.dim, shape.norm_eps)


class Llama(nn.Module):
    """exact=True: attention written out (FP32 reference); False: SDPA (benchmark)."""

    def __init__(self, shape: ModelShape, exact: bool):
        super().__init__()
        self.shape = shape
        self.model = Backbone(shape, exact)
        self.lm_head = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        # RoPE table: angles in double, stored FP32, as the C trainer's table.
        inv_freq = torch.tensor(rope_inv_frequencies(shape), dtype=torch.float64)
        angles = torch.outer(torch.arange(shape.max_seq_len, dtype=torch.float64), inv_freq)
        self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float(), persistent=False)

    def forward(self, tokens, targets=None):
        T = tokens.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


# ---- FP8 linear layers (the PyTorch FP8 peer of the benchmark) -------------------------------

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def fp8_per_tensor(x: torch.Tensor, dtype: torch.dtype, limit: float):
    """x as FP8 codes and one FP32 scale from its current amax: x ~ codes * scale."""
    scale = (x.abs().amax().float() + 1e-10) / limit
    return (x.float() / scale).clamp(-limit, limit).to(dtype), scale


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column by column, the layout torch._scaled_mm wants for its second operand."""
    return t.t().contiguous().t()


class FP8LinearFunction(torch.autograd.Function):
    """y = x W^T with E4M3 x and W, dx = dy W and dW = dy^T x with E5M2 dy, on torch._scaled_mm;
    per-tensor scales from the current amax; the FP8 x and W are what backward keeps."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.bfloat16)
    def forward(ctx, x, weight):
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = fp8_per_tensor(x2, torch.float8_e4m3fn, E4M3_MAX)
        wq, ws = fp8_per_tensor(weight, torch.float8_e4m3fn, E4M3_MAX)
        ctx.save_for_backward(xq, xs, wq, ws)
        y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        xq, xs, wq, ws = ctx.saved_tensors
        gq, gs = fp8_per_tensor(dy.reshape(-1, dy.shape[-1]), torch.float8_e5m2, E5M2_MAX)
        dx = torch._scaled_mm(gq, column_major(wq), scale_a=gs, scale_b=ws, out_dtype=torch.bfloat16)
        dw = torch._scaled_mm(gq.t().contiguous(), column_major(xq), scale_a=gs, scale_b=xs, out_dtype=torch.bfloat16)
        return dx.reshape(*dy.shape[:-1], wq.shape[1]), dw


class FP8Linear(nn.Linear):
    def forward(self, x):
        return FP8LinearFunction.apply(x, self.weight)


def use_fp8_linears(model: "Llama") -> None:
    """The block's linear layers (not the lm_head) on FP8 GEMMs, as the FP8 recipes do."""
    for layer in model.model.layers:
        for module in layer.modules():
            if type(module) is nn.Linear:
                module.__class__ = FP8Linear


@torch.no_grad()
def init_weights(model: Llama, generator: torch.Generator) -> None:
    """Norms 1, matrices N(0, 0.02), output projections (o_proj, down_proj) / sqrt(2 * n_layers)."""
    output_std = 0.02 / math.sqrt(2 * model.shape.n_layers)
    for name, param in model.named_parameters():
        if param.dim() == 1:
            param.fill_(1.0)
        else:
            std = output_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            param.normal_(0.0, std, generator=generator)


def make_optimizer(model: Llama, lr: float, fused: bool) -> torch.optim.AdamW:
    """AdamW with weight decay on the 2-D weights only (norms get none), as the C trainer."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": WEIGHT_DECAY}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=ADAM_EPS, fused=fused)


# ---- our flat layout ------------------------------------------------------------------------

def to_flat(tensors: dict, layout: ParamLayout) -> torch.Tensor:
    """{HF name: tensor} -> float32 [total_padded] in our layout, zero padding."""
    flat = torch.zeros(layout.total_padded, dtype=torch.float32)
    for slot in layout.tensors():
        flat[slot.offset:slot.offset + slot.numel] = tensors[slot.name].detach().float().reshape(-1).cpu()
    return flat


@torch.no_grad()
def load_flat(model: Llama, flat: torch.Tensor, layout: ParamLayout) -> None:
    state = model.state_dict()
    for slot in layout.tensors():
        state[slot.name].copy_(flat[slot.offset:slot.offset + slot.numel].view(slot.shape))


def tensor_bytes(t: torch.Tensor, dtype: torch.dtype) -> bytes:
    return t.detach().to(dtype).contiguous().cpu().numpy().tobytes()


def random_batch(vocab: int, batch: int, seq: int, generator: torch.Generator):
    """Random tokens; targets are the tokens shifted by one."""
    sequence = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()


# ---- modes ----------------------------------------------------------------------------------

def debug_state(args, shape: ModelShape) -> int:
    torch.set_float32_matmul_precision("highest")  # no TF32: this is the FP32 reference
    device = torch.device(args.device)
    layout = ParamLayout(shape)
    generator = torch.Generator().manual_seed(args.seed)
    model = Llama(shape, exact=True)
    init_weights(model, generator)  # on the CPU, so the weights do not depend on the device
    initial_params = to_flat(model.state_dict(), layout)
    tokens, targets = random_batch(shape.vocab_size, args.batch, args.seq, generator)
    model.to(device)
    tokens_on_device, targets_on_device = tokens.to(device), targets.to(device)
    optimizer = make_optimizer(model, args.lr, fused=False)

    def forward_backward():
        optimizer.zero_grad(set_to_none=True)
        logits, loss = model(tokens_on_device, targets_on_device)
        loss.backward()
        return logits, loss

    logits, loss = forward_backward()
    first_logits, first_loss = logits.detach().float().cpu(), loss.item()
    first_grads = to_flat({name: p.grad for name, p in model.named_parameters()}, layout)
    losses = []
    for step in range(args.steps):
        if step > 0:
            _, loss = forward_backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()

    header = pack_debug_state_header(shape, args.batch, args.seq, args.steps, args.lr, BETAS[0], BETAS[1], ADAM_EPS,
                                     WEIGHT_DECAY, GRAD_CLIP)
    with open(args.debug_state, "wb") as f:
        f.write(header)
        f.write(tensor_bytes(initial_params, torch.float32))
        f.write(tensor_bytes(tokens, torch.int32))
        f.write(tensor_bytes(targets, torch.int32))
        f.write(tensor_bytes(first_logits, torch.float32))
        f.write(struct.pack("<f", first_loss))
        f.write(tensor_bytes(first_grads, torch.float32))
        f.write(struct.pack(f"<{len(losses)}f", *losses))
    print(json.dumps({"debug_state": args.debug_state, "loss": first_loss, "losses": losses,
                      "grad_norm": first_grads.norm().item(), "device": str(device)}))
    return 0


def profile_steps(train_step, steps: int) -> None:
    """Prints the GPU kernels of `steps` training steps, the most time first, to stderr."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            train_step()
        torch.cuda.synchronize()
    print(f"profile of {steps} steps:", file=sys.stderr)
    print(profiler.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70),
          file=sys.stderr)


def bench(args, shape: ModelShape) -> int:
    """Median step time over --steps timed steps after --warmup; tokens/s, MFU and peak memory."""
    config_name = os.path.splitext(os.path.basename(args.config))[0]
    impl = ("pytorch" + ("-compile" if args.compile else "") + ("-fp8" if args.fp8 else "") +
            ("-exact-attention" if args.exact_attention else ""))
    result = {"impl": impl, "config": config_name,
              "batch": args.batch, "seq": args.seq}
    layout = ParamLayout(shape)
    device = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats()
    try:
        generator = torch.Generator(device=device).manual_seed(args.seed)
        with device:
            model = Llama(shape, exact=args.exact_attention)
        init_weights(model, generator)
        if args.fp8:
            use_fp8_linears(model)
        optimizer = make_optimizer(model, args.lr, fused=True)
        forward = torch.compile(model) if args.compile else model
        tokens, targets = random_batch(shape.vocab_size, args.batch, args.seq, torch.Generator().manual_seed(args.seed))
        tokens, targets = tokens.to(device), targets.to(device)

        def train_step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = forward(tokens, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(args.warmup):
            train_step()
        torch.cuda.synchronize()
        step_ms = []
        for _ in range(args.steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            train_step()
            end.record()
            end.synchronize()
            step_ms.append(start.elapsed_time(end))
        if args.profile:
            profile_steps(train_step, steps=2)
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError, or one that torch.compile wrapped in its own error
        if not isinstance(e, torch.cuda.OutOfMemoryError) and "out of memory" not in str(e):
            raise
        result["error"] = "out of memory"
        print(json.dumps(result))
        return 0
    median_ms = statistics.median(step_ms)
    tokens_per_s = args.batch * args.seq / (median_ms / 1e3)
    flops_per_token = 6 * layout.non_embedding_params + 6 * shape.n_layers * shape.dim * args.seq
    result.update({"tokens_per_s": round(tokens_per_s, 1),
                   "mfu": round(tokens_per_s * flops_per_token / BF16_DENSE_PEAK_FLOPS, 4),
                   "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                   "step_ms": round(median_ms, 3)})
    print(json.dumps(result))
    return 0


def logits_of_checkpoint(args) -> int:
    torch.set_float32_matmul_precision("highest")
    header = read_checkpoint_header(args.logits)
    shape = header.shape
    layout = ParamLayout(shape)
    try:
        tokens = [int(t) for t in args.tokens.split()]
    except ValueError:
        raise FormatError(f"--tokens: '{args.tokens}' is not a list of integers") from None
    if not tokens or len(tokens) > shape.max_seq_len or not all(0 <= t < shape.vocab_size for t in tokens):
        raise FormatError(f"--tokens: give 1 to {shape.max_seq_len} token ids below {shape.vocab_size}")
    with open_regular(args.logits, "rb") as f:
        f.seek(CHECKPOINT_HEADER_BYTES)
        flat = torch.frombuffer(bytearray(f.read(4 * layout.total_padded)), dtype=torch.float32)
    model = Llama(shape, exact=True)
    load_flat(model, flat, layout)
    model.to(args.device)
    with torch.no_grad():
        logits, _ = model(torch.tensor([tokens], device=args.device))
    logits = logits[0].float().cpu()
    if args.out:
        with open(args.out, "wb") as f:
            f.write(pack_logits_header(tokens, shape.vocab_size))
            f.write(tensor_bytes(logits, torch.float32))
    print(json.dumps({"checkpoint": args.logits, "step": header.step, "n_tokens": len(tokens),
                      "vocab": shape.vocab_size, "mean": logits.mean().item(), "std": logits.std().item(),
                      "max_abs": logits.abs().max().item(), "argmax": logits.argmax(-1).tolist()}))
    return 0


def config_seq_len(path: str, shape: ModelShape) -> int:
    """The config's seq_len, where 0 (the default) means max_seq_len, as in coat/config.h."""
    value = read_config(path).get("seq_len", "0")
    try:
        return int(value) or shape.max_seq_len
    except ValueError:
        raise FormatError(f"{path}: seq_len: '{value}' is not an integer") from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_mutually_exclusive_group(required=True)
    modes.add_argument("--debug-state", metavar="OUT.bin", help="write the FP32 reference state")
    modes.add_argument("--bench", action="store_true", help="measure BF16 training throughput")
    modes.add_argument("--logits", metavar="CKPT", help="logits of our checkpoint on --tokens")
    parser.add_argument("--config", help="config file (model keys; seq_len for --bench)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=0, help="tokens per sequence (default: 32 for --debug-state, "
                        "the config's seq_len or max_seq_len for --bench)")
    parser.add_argument("--steps", type=int, default=None, help="AdamW steps (debug, default 10) or timed steps "
                        "(bench, default 10)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (bench)")
    parser.add_argument("--fp8", action="store_true", help="--bench: the block's linear layers on FP8 GEMMs")
    parser.add_argument("--exact-attention", action="store_true",
                        help="--bench: attention written out (stores the T x T probabilities) instead of SDPA")
    parser.add_argument("--profile", action="store_true", help="--bench: also print the GPU kernels of two steps")
    parser.add_argument("--tokens", help='token ids for --logits, e.g. "1 2 3"')
    parser.add_argument("--out", help="--logits: write [n_tokens, vocab] logits here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.steps = 10 if args.steps is None else args.steps
    if args.batch <= 0 or args.steps < 0 or args.warmup < 0 or args.seq < 0:
        parser.error("--batch must be positive; --seq, --steps and --warmup must not be negative")
    try:
        if args.logits:
            if not args.tokens:
                parser.error("--logits needs --tokens")
            return logits_of_checkpoint(args)
        if not args.config:
            parser.error("--debug-state and --bench need --config")
        shape = model_shape_from_config(args.config)
        if args.seq == 0:
            args.seq = min(32, shape.max_seq_len) if args.debug_state else config_seq_len(args.config, shape)
        if args.seq > shape.max_seq_len:
            parser.error(f"--seq {args.seq} exceeds max_seq_len {shape.max_seq_len}")
        if args.debug_state:
            return debug_state(args, shape)
        if args.steps == 0 or not torch.cuda.is_available():
            parser.error("--bench needs a GPU and --steps > 0")
        return bench(args, shape)
    except FormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
