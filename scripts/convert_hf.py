#!/usr/bin/env python3
"""Converts our checkpoints to and from Hugging Face Llama folders, and a per-rank checkpoint to
one file, with the standard library only.

  convert_hf.py export CKPT_FILE OUT_DIR [--dtype bfloat16|float32]
      writes OUT_DIR/model.safetensors and OUT_DIR/config.json (LlamaForCausalLM); reads
      checkpoint versions 2 (every section's CRC-32 verified first: a damaged file is refused
      naming the section) and 1 (no checksums: read unchecked, with a warning), one file or a
      per-rank checkpoint's manifest (every part file's CRC-32 verified first)
  convert_hf.py merge MANIFEST CKPT_FILE
      writes a per-rank checkpoint (checkpoint_writes = per_rank: the manifest ckpt_<step>.bin
      and its part files ckpt_<step>.rank<r>.bin) as one file, the bytes rank 0 writes with
      checkpoint_writes = rank0; for the tools that read one file only
  convert_hf.py import HF_DIR CKPT_FILE
      reads HF_DIR/config.json and model.safetensors (or a sharded model.safetensors.index.json),
      F32 or BF16 tensors, and writes a version-2 checkpoint (coat/checkpoint_file.h: a CRC-32 per
      section and of the header, the bytes train_llama would write) at step 0 with the weights
      only: no optimizer or trainer state

Tensors keep their layout: HF nn.Linear weights are [out, in], as ours (coat/params.h).
safetensors: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end] relative to the data}}, then the data. BF16 is the upper half of
float32, rounded to nearest even (NaN stays NaN).
"""
import argparse
import json
import os
import struct
import sys
from functools import lru_cache
from typing import Callable, Dict, Iterable, List, Tuple

from llama_layout import (CHECKPOINT_HEADER_BYTES, CHECKPOINT_VERSION, CheckpointHeader, CheckpointReader, FormatError,
                          ModelShape, ParamLayout, TensorSlot, file_chunks, float32, open_regular, write_checkpoint)

CHUNK_ELEMS = 1 << 20  # converted at a time: bounds memory for multi-GB tensors
DTYPE_BYTES = {"F32": 4, "BF16": 2}
HF_DTYPE = {"float32": "F32", "bfloat16": "BF16"}


# ---- float32 <-> bfloat16 -------------------------------------------------------------------
# The rounding works on all values of a chunk at once: the chunk is read as one big integer made
# of 32-bit lanes, and every lane operation is chosen so that no carry crosses a lane boundary.

@lru_cache(maxsize=4)
def _lane_constants(n: int) -> Tuple[int, int, int, int, int]:
    def repeat(lane: int) -> int:
        return int.from_bytes(struct.pack("<I", lane) * n, "little")
    return repeat(1), repeat(0x7FFF), repeat(0x7FFFFFFF), repeat(0x007FFFFF), repeat(0x00400000)


def float32_to_bfloat16(data: bytes) -> bytes:
    """Little-endian float32 values to bfloat16, round to nearest even; NaN stays a (quiet) NaN,
    overflow rounds to infinity as IEEE rounding does."""
    n = len(data) // 4
    ones, rounding_bias, magnitude_mask, nan_probe, quiet_bit = _lane_constants(n)
    bits = int.from_bytes(data, "little")
    # |x| > 0x7F800000 (NaN) exactly when |x| + 0x007FFFFF reaches bit 31; the sum stays below 2^32.
    nan_flags = (((bits & magnitude_mask) + nan_probe) >> 31) & ones
    nan_lanes = nan_flags * 0xFFFFFFFF
    # Non-NaN lanes: + 0x7FFF + (bit 16) rounds to nearest even; the largest, -inf, stays below 2^32.
    # NaN lanes are truncated after setting the quiet bit, so a payload in the low half survives.
    odd = (bits >> 16) & ones
    rounded = (bits | (nan_lanes & quiet_bit)) + ((rounding_bias + odd) & ~nan_lanes)
    lanes = rounded.to_bytes(4 * n, "little")
    out = bytearray(2 * n)
    out[0::2] = lanes[2::4]
    out[1::2] = lanes[3::4]
    return bytes(out)


def bfloat16_to_float32(data: bytes) -> bytes:
    """Exact: a bfloat16 is the upper half of a float32."""
    n = len(data) // 2
    out = bytearray(4 * n)
    out[2::4] = data[0::2]
    out[3::4] = data[1::2]
    return bytes(out)


def shortest_float32_decimal(x: float) -> float:
    """The shortest decimal that reads back as the same float32 (1e-05, not 9.999999747378752e-06)."""
    for digits in range(1, 18):
        candidate = float(f"{x:.{digits}g}")
        if float32(candidate) == float32(x):
            return candidate
    return x


# ---- safetensors ----------------------------------------------------------------------------

class SafetensorsEntry:
    """A tensor to write: its bytes come from `chunks`, an iterable made on demand."""

    def __init__(self, name: str, dtype: str, shape: Tuple[int, ...], chunks: Callable[[], Iterable[bytes]]):
        self.name, self.dtype, self.shape, self.chunks = name, dtype, shape, chunks

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * DTYPE_BYTES[self.dtype]


def write_safetensors(path: str, entries: List[SafetensorsEntry]) -> None:
    header: Dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data starts 8-byte aligned
    def write(f) -> None:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for entry in entries:
            written = 0
            for chunk in entry.chunks():
                f.write(chunk)
                written += len(chunk)
            if written != entry.nbytes:
                raise FormatError(f"{path}: {entry.name}: produced {written} bytes, expected {entry.nbytes}")
    write_atomically(path, write)


def write_atomically(path: str, write: Callable) -> None:
    """Calls write(file) on PATH.tmp and renames it into place; nothing is left behind on failure."""
    temporary = path + ".tmp"
    try:
        with open(temporary, "wb") as f:
            write(f)
        os.replace(temporary, path)
    except (OSError, FormatError) as e:
        if os.path.exists(temporary):
            os.remove(temporary)
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"{path}: write failed: {e.strerror}") from None


def read_safetensors_header(path: str) -> Tuple[int, Dict[str, dict]]:
    """(file offset of the data, {name: {dtype, shape, data_offsets}}), checked against the file."""
    try:
        size = os.path.getsize(path)
        with open_regular(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise FormatError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (header_length,) = struct.unpack("<Q", prefix)
            if 8 + header_length > size:
                raise FormatError(f"{path}: not a safetensors file (header length {header_length} exceeds the file)")
            header = json.loads(f.read(header_length).decode("utf-8"))
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise FormatError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: not a safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)
    data_start = 8 + header_length
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise FormatError(f"{path}: {name}: entry without dtype, shape and data_offsets")
        begin, end = info["data_offsets"]
        if not 0 <= begin <= end <= size - data_start:
            raise FormatError(f"{path}: {name}: data_offsets [{begin}, {end}] outside the file")
    return data_start, header


# ---- export ---------------------------------------------------------------------------------

def hf_config(shape: ModelShape, torch_dtype: str) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_dim,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_seq_len,
        "rms_norm_eps": shortest_float32_decimal(shape.norm_eps),
        "rope_theta": shortest_float32_decimal(shape.rope_theta),
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "torch_dtype": torch_dtype,
    }
    if shape.rope_scaling_factor > 0:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": shortest_float32_decimal(shape.rope_scaling_factor),
            "low_freq_factor": shortest_float32_decimal(shape.rope_low_freq_factor),
            "high_freq_factor": shortest_float32_decimal(shape.rope_high_freq_factor),
            "original_max_position_embeddings": shape.rope_original_max_seq_len,
        }
    return config


def export_checkpoint(checkpoint_path: str, out_dir: str, torch_dtype: str) -> str:
    reader = CheckpointReader(checkpoint_path)
    header = reader.header
    if header.version == CHECKPOINT_VERSION:
        reader.verify()  # before anything is written
    else:
        print(f"warning: {checkpoint_path}: checkpoint version {header.version} carries no checksums: its weights are "
              "read unchecked", file=sys.stderr)
    layout = ParamLayout(header.shape)
    dtype = HF_DTYPE[torch_dtype]

    def tensor_chunks(slot: TensorSlot) -> Callable[[], Iterable[bytes]]:
        def chunks() -> Iterable[bytes]:
            start = CHECKPOINT_HEADER_BYTES + 4 * slot.offset
            for chunk in reader.chunks(start, 4 * slot.numel, 4 * CHUNK_ELEMS):
                yield chunk if dtype == "F32" else float32_to_bfloat16(chunk)
        return chunks

    entries = [SafetensorsEntry(slot.name, dtype, slot.shape, tensor_chunks(slot)) for slot in layout.tensors()]
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise FormatError(f"{out_dir}: cannot create: {e.strerror}") from None
    write_safetensors(os.path.join(out_dir, "model.safetensors"), entries)
    config_path = os.path.join(out_dir, "config.json")
    try:
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(hf_config(header.shape, torch_dtype), f, indent=2)
            f.write("\n")
    except OSError as e:
        raise FormatError(f"{config_path}: write failed: {e.strerror}") from None
    return (f"exported {len(entries)} tensors ({layout.total_params} parameters, {torch_dtype}) of {checkpoint_path} "
            f"(step {header.step}) to {out_dir}")


# ---- import ---------------------------------------------------------------------------------

def shape_from_hf_config(config: dict, config_path: str) -> ModelShape:
    """Our model shape from a HF config.json; anything our model cannot represent is refused."""
    try:
        return _shape_from_hf_config(config, config_path)
    except KeyError as e:
        raise FormatError(f"{config_path}: missing key {e.args[0]}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise FormatError(f"{config_path}: bad value: {e}") from None


def _shape_from_hf_config(config: dict, config_path: str) -> ModelShape:
    def refuse(what: str) -> FormatError:
        return FormatError(f"{config_path}: unsupported model: {what}")

    architectures = config.get("architectures") or ["LlamaForCausalLM"]
    if config.get("model_type", "llama") != "llama" or "LlamaForCausalLM" not in architectures:
        raise refuse(f"model_type {config.get('model_type')!r}, architectures {architectures} (only LlamaForCausalLM)")
    if config.get("hidden_act", "silu") != "silu":
        raise refuse(f"hidden_act {config.get('hidden_act')!r} (only silu)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise refuse("biases (attention_bias or mlp_bias)")
    if config.get("pretraining_tp", 1) != 1:
        raise refuse(f"pretraining_tp {config.get('pretraining_tp')}")
    shape = ModelShape(vocab_size=int(config["vocab_size"]), dim=int(config["hidden_size"]),
                       n_layers=int(config["num_hidden_layers"]), n_heads=int(config["num_attention_heads"]),
                       n_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                       ffn_dim=int(config["intermediate_size"]),
                       max_seq_len=int(config.get("max_position_embeddings", 2048)),
                       norm_eps=float32(float(config.get("rms_norm_eps", 1e-6))))
    if shape.problem():  # checked before head_dim divides by n_heads
        raise refuse(shape.problem())
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) != shape.head_dim:
        raise refuse(f"head_dim {head_dim} differs from hidden_size / num_attention_heads = {shape.head_dim}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if any(isinstance(value, dict) for value in rope.values()):
        raise refuse("RoPE parameters per layer type")
    shape.rope_theta = float32(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        shape.rope_scaling_factor = float32(float(rope["factor"]))
        shape.rope_low_freq_factor = float32(float(rope["low_freq_factor"]))
        shape.rope_high_freq_factor = float32(float(rope["high_freq_factor"]))
        shape.rope_original_max_seq_len = int(rope["original_max_position_embeddings"])
    elif rope_type != "default":
        raise refuse(f"RoPE type {rope_type!r} (only default and llama3)")
    problem = shape.problem()
    if problem:
        raise refuse(problem)
    return shape


def find_hf_tensors(hf_dir: str) -> Dict[str, Tuple[str, int, dict]]:
    """{name: (file, data start, header entry)} over model.safetensors or its sharded index."""
    index_path = os.path.join(hf_dir, "model.safetensors.index.json")
    single_path = os.path.join(hf_dir, "model.safetensors")
    if os.path.exists(index_path):
        try:
            with open_regular(index_path, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError):
            raise FormatError(f"{index_path}: cannot read its weight_map") from None
        paths = [os.path.join(hf_dir, name) for name in files]
    elif os.path.exists(single_path):
        paths = [single_path]
    else:
        raise FormatError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    tensors = {}
    for path in paths:
        data_start, header = read_safetensors_header(path)
        for name, info in header.items():
            tensors[name] = (path, data_start, info)
    return tensors


def import_hf(hf_dir: str, checkpoint_path: str) -> str:
    config_path = os.path.join(hf_dir, "config.json")
    try:
        with open_regular(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise FormatError(f"{config_path}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError:
        raise FormatError(f"{config_path}: not valid JSON") from None
    shape = shape_from_hf_config(config, config_path)
    layout = ParamLayout(shape)
    tensors = find_hf_tensors(hf_dir)
    if "lm_head.weight" not in tensors and config.get("tie_word_embeddings") and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # tied: our lm_head is its own copy
    sources = []
    for slot in layout.tensors():
        if slot.name not in tensors:
            raise FormatError(f"{hf_dir}: tensor {slot.name} is missing")
        path, data_start, info = tensors[slot.name]
        if info["dtype"] not in DTYPE_BYTES:
            raise FormatError(f"{path}: {slot.name}: dtype {info['dtype']} (only F32 and BF16 are supported)")
        if tuple(info["shape"]) != slot.shape:
            raise FormatError(f"{path}: {slot.name}: shape {info['shape']}, config.json implies {list(slot.shape)}")
        begin, end = info["data_offsets"]
        if end - begin != slot.numel * DTYPE_BYTES[info["dtype"]]:
            raise FormatError(f"{path}: {slot.name}: {end - begin} bytes of data for shape {info['shape']}")
        sources.append((slot, path, data_start + begin, info["dtype"]))

    # Weights only, as train_llama marks them: has_optimizer_state 0, empty optimizer and trainer state.
    header = CheckpointHeader(shape, step=0, total_padded=layout.total_padded)

    def weight_chunks() -> Iterable[bytes]:
        for slot, path, start, dtype in sources:
            nbytes = slot.numel * DTYPE_BYTES[dtype]
            for chunk in file_chunks(path, start, nbytes, DTYPE_BYTES[dtype] * CHUNK_ELEMS):
                yield chunk if dtype == "F32" else bfloat16_to_float32(chunk)
            yield bytes(4 * (slot.padded - slot.numel))

    def write(f) -> None:
        write_checkpoint(f, checkpoint_path, header, [weight_chunks(), [], []])
        if f.tell() != header.file_bytes:
            raise FormatError(f"{checkpoint_path}: wrote {f.tell()} bytes, expected {header.file_bytes}")
    write_atomically(checkpoint_path, write)
    keys = "\n".join(f"{key} = {shortest_float32_decimal(value) if isinstance(value, float) else value}"
                     for key, value in vars(shape).items())
    return (f"imported {len(sources)} tensors ({layout.total_params} parameters) of {hf_dir} to {checkpoint_path}\n"
            f"# model keys for the config:\n{keys}")


# ---- merge ----------------------------------------------------------------------------------

def merge_checkpoint(manifest_path: str, out_path: str) -> str:
    """A per-rank checkpoint (its manifest and part files) as the one file train_llama's rank 0
    writes, byte for byte: every part's CRC-32 is verified first, the sections' are taken anew."""
    reader = CheckpointReader(manifest_path)
    if reader.manifest is None:
        raise FormatError(f"{manifest_path}: already one file, not a per-rank checkpoint's manifest")
    reader.verify()
    header = CheckpointHeader(reader.header.shape, reader.header.step, reader.header.total_padded,
                              reader.header.has_optimizer_state, reader.header.optimizer_state_bytes,
                              reader.header.trainer_state_bytes)
    sizes = header.section_bytes
    starts = [CHECKPOINT_HEADER_BYTES, CHECKPOINT_HEADER_BYTES + sizes[0], CHECKPOINT_HEADER_BYTES + sizes[0] + sizes[1]]

    def write(f) -> None:
        write_checkpoint(f, out_path, header, [reader.chunks(start, size) for start, size in zip(starts, sizes)])
    write_atomically(out_path, write)
    return (f"merged the {len(reader.manifest.parts)} part files of {manifest_path} (step {header.step}) into {out_path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="our checkpoint -> HF Llama folder")
    export.add_argument("checkpoint")
    export.add_argument("out_dir")
    export.add_argument("--dtype", choices=sorted(HF_DTYPE), default="bfloat16")
    imports = commands.add_parser("import", help="HF Llama folder -> our checkpoint (step 0)")
    imports.add_argument("hf_dir")
    imports.add_argument("checkpoint")
    merge = commands.add_parser("merge", help="per-rank checkpoint (manifest) -> one file")
    merge.add_argument("manifest")
    merge.add_argument("checkpoint")
    args = parser.parse_args()
    try:
        if args.command == "export":
            print(export_checkpoint(args.checkpoint, args.out_dir, args.dtype))
        elif args.command == "merge":
            print(merge_checkpoint(args.manifest, args.checkpoint))
        else:
            print(import_hf(args.hf_dir, args.checkpoint))
    except FormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
