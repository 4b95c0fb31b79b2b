"""Shared helpers of the Python scripts, standard library only: the config reader, the model
shape, the parameter layout of coat/params.h, the RoPE frequencies, and the binary formats the
scripts exchange with ./train_llama (checkpoint files with their checksums, one file or per-rank
parts with a manifest; debug state header, logits file).

Parameter layout (one flat float32 buffer, layer-major, as coat/params.h):
  embedding [V, H]; per layer: attn_norm [H], wq [NH*hd, H], wk [NKV*hd, H], wv [NKV*hd, H],
  wo [H, NH*hd], mlp_norm [H], w_gate [I, H], w_up [I, H], w_down [H, I]; final_norm [H],
  lm_head [V, H]. Matrices are [out, in] (y = x W^T); every tensor is padded with zeros to a
  multiple of 128 elements. Names are the Hugging Face ones.
All binary formats are little-endian.
"""
import bisect
import errno
import io
import math
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

PARAM_ALIGN_ELEMS = 128


class FormatError(Exception):
    """A file that cannot be used; str() is "<path>: <what is wrong>"."""


# ---- config files ---------------------------------------------------------------------------

def open_regular(path: str, mode: str = "r", **kwargs):
    """open() of a regular file only: a FIFO would block until a writer comes and a device might
    never end, so they raise OSError (strerror "not a regular file (a FIFO)") before any open."""
    kind = os.stat(path).st_mode
    if not stat.S_ISREG(kind):
        what = "a directory" if stat.S_ISDIR(kind) else "a FIFO" if stat.S_ISFIFO(kind) else "a device or other special file"
        raise OSError(errno.EINVAL, f"not a regular file ({what})", path)
    return open(path, mode, **kwargs)


def read_config(path: str) -> Dict[str, str]:
    """Reads `key = value` lines with `#` comments and `include = other.conf` (relative to the
    including file), later values overriding earlier ones, as coat/config.h does."""
    values: Dict[str, str] = {}
    _read_config_into(path, values, [])
    return values


def _read_config_into(path: str, values: Dict[str, str], include_stack: List[str]) -> None:
    resolved = os.path.realpath(path)
    if resolved in include_stack:
        raise FormatError(f"{path}: include cycle")
    try:
        with open_regular(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise FormatError(f"{path}: cannot open config: {e.strerror}") from None
    include_stack.append(resolved)
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        name, equals, value = text.partition("=")
        name, value = name.strip(), value.strip()
        if not equals or not name or not value:
            raise FormatError(f"{path}:{number}: expected `key = value`")
        if name == "include":
            included = value if os.path.isabs(value) else os.path.join(os.path.dirname(path), value)
            _read_config_into(included, values, include_stack)
        else:
            values[name] = value
    include_stack.pop()


# ---- model shape ----------------------------------------------------------------------------

def float32(x: float) -> float:
    """x rounded to the nearest float32, as the C trainer stores its float settings."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


@dataclass
class ModelShape:
    """The model keys of a config (coat/model_shape.h); defaults are those of coat/config.h."""
    vocab_size: int = 32000
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int = 4
    ffn_dim: int = 2048
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = float32(1e-5)
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def problem(self) -> Optional[str]:
        """What makes this shape unusable, or None."""
        if min(self.vocab_size, self.dim, self.n_layers, self.n_heads, self.n_kv_heads, self.ffn_dim,
               self.max_seq_len) <= 0:
            return "every size must be positive"
        if self.dim % self.n_heads != 0:
            return f"n_heads {self.n_heads} does not divide dim {self.dim}"
        if self.n_heads % self.n_kv_heads != 0:
            return f"n_kv_heads {self.n_kv_heads} does not divide n_heads {self.n_heads}"
        if self.head_dim % 2 != 0:
            return f"head_dim {self.head_dim} must be even for RoPE"
        if self.rope_scaling_factor > 0 and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            return "rope_high_freq_factor must exceed rope_low_freq_factor"
        return None


_INT_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len",
             "rope_original_max_seq_len")
_FLOAT_KEYS = ("rope_theta", "norm_eps", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor")


def model_shape_from_config(path: str) -> ModelShape:
    """The model shape a config file describes; keys other than the model's are ignored."""
    values = read_config(path)
    shape = ModelShape()
    for key in _INT_KEYS + _FLOAT_KEYS:
        if key not in values:
            continue
        try:
            value = int(values[key]) if key in _INT_KEYS else float32(float(values[key]))
        except ValueError:
            raise FormatError(f"{path}: {key}: '{values[key]}' is not a number") from None
        setattr(shape, key, value)
    problem = shape.problem()
    if problem:
        raise FormatError(f"{path}: {problem}")
    return shape


def _llama3_scaled_inv_freq(inv_freq: float, shape: ModelShape) -> float:
    """Llama 3.1 scaling (HF _compute_llama3_parameters): wavelengths shorter than
    original_len/high_freq_factor are kept, longer than original_len/low_freq_factor are divided by
    the factor, and the band between is interpolated linearly in original_len/wavelength."""
    original_len = float(shape.rope_original_max_seq_len)
    low, high = shape.rope_low_freq_factor, shape.rope_high_freq_factor
    wavelength = 2.0 * math.pi / inv_freq
    if wavelength < original_len / high:
        return inv_freq
    if wavelength > original_len / low:
        return inv_freq / shape.rope_scaling_factor
    smooth = (original_len / wavelength - low) / (high - low)
    return (1.0 - smooth) * inv_freq / shape.rope_scaling_factor + smooth * inv_freq


def rope_inv_frequencies(shape: ModelShape) -> List[float]:
    """inv_freq_i = theta^(-2i/head_dim) for i < head_dim/2 (pairs i, i + head_dim/2), in double
    precision, scaled as Llama 3.1 when rope_scaling_factor > 0."""
    frequencies = []
    for i in range(shape.head_dim // 2):
        inv_freq = float(shape.rope_theta) ** (-2.0 * i / shape.head_dim)
        if shape.rope_scaling_factor > 0:
            inv_freq = _llama3_scaled_inv_freq(inv_freq, shape)
        frequencies.append(inv_freq)
    return frequencies


# ---- parameter layout (coat/params.h) -------------------------------------------------------

class ParamKind(NamedTuple):
    name: str        # as in coat/params.h, lower case
    hf_name: str     # Hugging Face name; "model.layers.<i>." is prefixed for per-layer kinds
    per_layer: bool
    is_matrix: bool  # weight decay applies; norms are vectors


PARAM_KINDS: Tuple[ParamKind, ...] = (
    ParamKind("embedding", "model.embed_tokens.weight", False, True),
    ParamKind("attn_norm", "input_layernorm.weight", True, False),
    ParamKind("wq", "self_attn.q_proj.weight", True, True),
    ParamKind("wk", "self_attn.k_proj.weight", True, True),
    ParamKind("wv", "self_attn.v_proj.weight", True, True),
    ParamKind("wo", "self_attn.o_proj.weight", True, True),
    ParamKind("mlp_norm", "post_attention_layernorm.weight", True, False),
    ParamKind("w_gate", "mlp.gate_proj.weight", True, True),
    ParamKind("w_up", "mlp.up_proj.weight", True, True),
    ParamKind("w_down", "mlp.down_proj.weight", True, True),
    ParamKind("final_norm", "model.norm.weight", False, False),
    ParamKind("lm_head", "lm_head.weight", False, True),
)


class TensorSlot(NamedTuple):
    """One tensor of the flat buffer."""
    name: str      # Hugging Face name
    kind: str
    layer: int     # -1 for the embedding, the final norm and lm_head
    offset: int    # in elements
    rows: int
    cols: int      # 1 for vectors
    padded: int    # elements reserved
    is_matrix: bool

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def shape(self) -> Tuple[int, ...]:
        return (self.rows, self.cols) if self.is_matrix else (self.rows,)


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class ParamLayout:
    """Offsets and sizes of every tensor, computed exactly as param_layout_init does."""

    def __init__(self, shape: ModelShape):
        self.shape = shape
        hd, H, I, V = shape.head_dim, shape.dim, shape.ffn_dim, shape.vocab_size
        NH, NKV = shape.n_heads, shape.n_kv_heads
        self.rows = [V, H, NH * hd, NKV * hd, NKV * hd, H, H, I, I, H, H, V]
        self.cols = [H, 1, H, H, H, NH * hd, 1, H, H, I, 1, H]
        self.padded = [round_up(r * c, PARAM_ALIGN_ELEMS) for r, c in zip(self.rows, self.cols)]
        self.total_params = sum(r * c * (shape.n_layers if kind.per_layer else 1)
                                for kind, r, c in zip(PARAM_KINDS, self.rows, self.cols))
        self.first_layer_offset = self.padded[0]
        self.within_layer: Dict[int, int] = {}
        self.layer_stride = 0
        for k, kind in enumerate(PARAM_KINDS):
            if kind.per_layer:
                self.within_layer[k] = self.layer_stride
                self.layer_stride += self.padded[k]
        tail = self.first_layer_offset + shape.n_layers * self.layer_stride
        final_norm, lm_head = len(PARAM_KINDS) - 2, len(PARAM_KINDS) - 1
        self.tail_offset = {final_norm: tail, lm_head: tail + self.padded[final_norm]}
        self.total_padded = self.tail_offset[lm_head] + self.padded[lm_head]

    def offset(self, k: int, layer: int) -> int:
        if k == 0:
            return 0
        if not PARAM_KINDS[k].per_layer:
            return self.tail_offset[k]
        return self.first_layer_offset + layer * self.layer_stride + self.within_layer[k]

    def slot(self, k: int, layer: int) -> TensorSlot:
        kind = PARAM_KINDS[k]
        name = f"model.layers.{layer}.{kind.hf_name}" if kind.per_layer else kind.hf_name
        return TensorSlot(name, kind.name, layer if kind.per_layer else -1, self.offset(k, layer),
                          self.rows[k], self.cols[k], self.padded[k], kind.is_matrix)

    def tensors(self) -> List[TensorSlot]:
        """Every tensor in buffer order."""
        slots = [self.slot(0, -1)]
        for layer in range(self.shape.n_layers):
            slots += [self.slot(k, layer) for k, kind in enumerate(PARAM_KINDS) if kind.per_layer]
        slots += [self.slot(k, -1) for k in (len(PARAM_KINDS) - 2, len(PARAM_KINDS) - 1)]
        return slots

    @property
    def non_embedding_params(self) -> int:
        """Parameters counted by the MFU convention (coat/README.md): all but the embedding."""
        return self.total_params - self.rows[0] * self.cols[0]


# ---- checkpoint files (coat/checkpoint_file.h) -----------------------------------------------
# "LLAMACK1", int64 fields[63], then three sections: float32 master weights [total_padded], the
# optimizer state and the trainer state (opaque here). Version 2, written here as by train_llama,
# holds the zlib CRC-32 of each section in fields 19-21 and that of the header itself (the magic
# and the fields, field 22 zero) in field 22. Version 1 holds none; it is still read, unchecked.
# A checkpoint of weights only (convert_hf.py import) has has_optimizer_state 0 and empty optimizer
# and trainer sections (0 bytes, CRC-32 0).

CHECKPOINT_MAGIC = b"LLAMACK1"
CHECKPOINT_VERSION = 2  # written here and by train_llama
CHECKPOINT_VERSION_UNCHECKED = 1  # the version before checksums: read, its weights unchecked
CHECKPOINT_READ_VERSIONS = (CHECKPOINT_VERSION_UNCHECKED, CHECKPOINT_VERSION)
CHECKPOINT_FIELDS = 63
CHECKPOINT_HEADER_BYTES = 8 + 8 * CHECKPOINT_FIELDS
CHECKPOINT_SECTION_NAMES = ("weights", "optimizer state", "trainer state")  # in file order
_CK_CRC_SECTIONS = 19  # fields 19-21: the sections' CRC-32 (version 2)
_CK_CRC_HEADER = 22    # field 22: the header's own CRC-32 (version 2)
_CK_CHUNK_BYTES = 1 << 20  # checksummed at a time
_CK_DOUBLE_FIELDS = {8: "rope_theta", 9: "norm_eps", 10: "rope_scaling_factor", 11: "rope_low_freq_factor",
                     12: "rope_high_freq_factor"}
_CK_INT_SHAPE_FIELDS = {1: "vocab_size", 2: "dim", 3: "n_layers", 4: "n_heads", 5: "n_kv_heads", 6: "ffn_dim",
                        7: "max_seq_len", 13: "rope_original_max_seq_len"}


@dataclass
class CheckpointHeader:
    shape: ModelShape
    step: int = 0
    total_padded: int = 0
    has_optimizer_state: int = 0
    optimizer_state_bytes: int = 0
    trainer_state_bytes: int = 0
    version: int = CHECKPOINT_VERSION  # as read; pack_checkpoint_header writes this one
    crc: Tuple[int, int, int] = (0, 0, 0)  # zlib CRC-32 of each section (version 2)

    @property
    def section_bytes(self) -> Tuple[int, int, int]:
        """The sizes of the weights, the optimizer state and the trainer state, in file order."""
        return 4 * self.total_padded, self.optimizer_state_bytes, self.trainer_state_bytes

    @property
    def file_bytes(self) -> int:
        return CHECKPOINT_HEADER_BYTES + sum(self.section_bytes)


def _double_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_double(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def checkpoint_header_crc(data: bytes) -> int:
    """The header's own checksum (checkpoint_header_crc): the magic and the fields with field 22 zero."""
    crc_at = 8 + 8 * _CK_CRC_HEADER
    return zlib.crc32(data[:crc_at] + bytes(8) + data[crc_at + 8:CHECKPOINT_HEADER_BYTES])


def pack_checkpoint_header(header: CheckpointHeader) -> bytes:
    """The header as checkpoint_encode_header writes it; version 2 with header.crc and its own CRC-32."""
    fields = [0] * CHECKPOINT_FIELDS
    fields[0] = header.version
    for index, key in _CK_INT_SHAPE_FIELDS.items():
        fields[index] = getattr(header.shape, key)
    for index, key in _CK_DOUBLE_FIELDS.items():
        fields[index] = _double_bits(getattr(header.shape, key))
    fields[14:19] = [header.step, header.total_padded, header.has_optimizer_state, header.optimizer_state_bytes,
                     header.trainer_state_bytes]
    if header.version == CHECKPOINT_VERSION:
        fields[_CK_CRC_SECTIONS:_CK_CRC_SECTIONS + 3] = header.crc
        fields[_CK_CRC_HEADER] = checkpoint_header_crc(CHECKPOINT_MAGIC + struct.pack(f"<{CHECKPOINT_FIELDS}q", *fields))
    return CHECKPOINT_MAGIC + struct.pack(f"<{CHECKPOINT_FIELDS}q", *fields)


def unpack_checkpoint_header(data: bytes, path: str) -> CheckpointHeader:
    """The header at the start of `data`; a version-2 header is checked against its own CRC-32."""
    if len(data) < CHECKPOINT_HEADER_BYTES:
        raise FormatError(f"{path}: truncated header")
    if data[:8] != CHECKPOINT_MAGIC:
        raise FormatError(f"{path}: not a train_llama checkpoint (bad magic)")
    fields = struct.unpack_from(f"<{CHECKPOINT_FIELDS}q", data, 8)
    if fields[0] not in CHECKPOINT_READ_VERSIONS:
        raise FormatError(f"{path}: checkpoint version {fields[0]}, expected one of {CHECKPOINT_READ_VERSIONS}")
    if fields[0] == CHECKPOINT_VERSION and fields[_CK_CRC_HEADER] != checkpoint_header_crc(data):
        raise FormatError(f"{path}: the header fails its checksum (crc32 {checkpoint_header_crc(data):08x}, the header "
                          f"says {fields[_CK_CRC_HEADER] & 0xFFFFFFFFFFFFFFFF:08x}): the file is damaged")
    shape = ModelShape()
    for index, key in _CK_INT_SHAPE_FIELDS.items():
        setattr(shape, key, fields[index])
    for index, key in _CK_DOUBLE_FIELDS.items():
        setattr(shape, key, float32(_bits_double(fields[index])))
    header = CheckpointHeader(shape, *fields[14:19], version=fields[0])
    if header.version == CHECKPOINT_VERSION:
        header.crc = tuple(crc & 0xFFFFFFFF for crc in fields[_CK_CRC_SECTIONS:_CK_CRC_SECTIONS + 3])  # as uint32_t
    if min(header.step, header.total_padded - 1, header.optimizer_state_bytes, header.trainer_state_bytes) < 0:
        raise FormatError(f"{path}: corrupt header (negative sizes)")
    problem = shape.problem()
    if problem:
        raise FormatError(f"{path}: corrupt header: {problem}")
    return header


def read_checkpoint_header(path: str) -> CheckpointHeader:
    """The header of a checkpoint file, checked against the file size and the layout of its shape
    (and, version 2, against its own checksum; verify_checkpoint checks the sections'). A
    per-rank checkpoint's manifest is refused naming the conversion to one file (CheckpointReader
    reads either form)."""
    try:
        with open_regular(path, "rb") as f:
            data = f.read(CHECKPOINT_HEADER_BYTES)
            if data[:8] == MANIFEST_MAGIC:
                raise FormatError(f"{path}: a per-rank checkpoint's manifest (checkpoint_writes = per_rank), not one file: "
                                  f"python3 scripts/convert_hf.py merge {path} ONE.bin makes it one")
            header = unpack_checkpoint_header(data, path)
        size = os.path.getsize(path)
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror}") from None
    if size != header.file_bytes:
        raise FormatError(f"{path}: size {size} bytes, header announces {header.file_bytes} (truncated or corrupt)")
    expected = ParamLayout(header.shape).total_padded
    if header.total_padded != expected:
        raise FormatError(f"{path}: total_padded {header.total_padded}, the layout of its shape needs {expected}")
    return header


def verify_checkpoint(path: str, header: CheckpointHeader) -> None:
    """Checks each section of a version-2 checkpoint against its CRC-32 (checkpoint_verify); a
    version-1 file has none to check. Raises FormatError naming the first damaged section."""
    if header.version != CHECKPOINT_VERSION:
        return
    try:
        with open_regular(path, "rb") as f:
            f.seek(CHECKPOINT_HEADER_BYTES)
            for name, size, expected in zip(CHECKPOINT_SECTION_NAMES, header.section_bytes, header.crc):
                crc = 0
                while size > 0:
                    chunk = f.read(min(size, _CK_CHUNK_BYTES))
                    if not chunk:
                        raise FormatError(f"{path}: read failed while checksumming: truncated")
                    crc = zlib.crc32(chunk, crc)
                    size -= len(chunk)
                if crc != expected:
                    raise FormatError(f"{path}: the {name} section fails its checksum (crc32 {crc:08x}, the header says "
                                      f"{expected:08x}): the file is damaged")
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror}") from None


def write_checkpoint(f: BinaryIO, path: str, header: CheckpointHeader, sections: Sequence[Iterable[bytes]]) -> None:
    """Writes a version-2 checkpoint to the seekable file f as train_llama does (checkpoint_begin,
    checkpoint_commit): a placeholder header, the three sections (each an iterable of byte
    chunks, of the sizes the header announces), then the header again with every CRC-32. Sets
    header.version and header.crc; `path` names the file in errors."""
    header.version, header.crc = CHECKPOINT_VERSION, (0, 0, 0)
    start = f.tell()
    f.write(pack_checkpoint_header(header))
    crcs = []
    for name, chunks, expected in zip(CHECKPOINT_SECTION_NAMES, sections, header.section_bytes):
        crc, written = 0, 0
        for chunk in chunks:
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
            written += len(chunk)
        if written != expected:
            raise FormatError(f"{path}: the {name} section: wrote {written} bytes, the header announces {expected}")
        crcs.append(crc)
    end = f.tell()
    header.crc = tuple(crcs)
    f.seek(start)
    f.write(pack_checkpoint_header(header))
    f.seek(end)


def checkpoint_bytes(header: CheckpointHeader, weights: bytes, optimizer_state: bytes = b"",
                     trainer_state: bytes = b"") -> bytes:
    """A whole version-2 checkpoint in memory (small ones, for tests); sets header.crc."""
    out = io.BytesIO()
    write_checkpoint(out, "<memory>", header, [[weights], [optimizer_state], [trainer_state]])
    return out.getvalue()


# ---- per-rank checkpoints (checkpoint_writes = per_rank; coat/checkpoint_parts.h) -----------
# One checkpoint in several files: DIR/ckpt_<step>.rank<p>.bin for p < P ("LLAMACKP", uint64
# version, step, p, P, then for each of the 5 arrays, the master weights and the optimizer's m, v,
# m's group scalars, v's, the bytes of the part's element ranges in order) and the manifest
# DIR/ckpt_<step>.bin ("LLAMACKM", uint64 version, the header of the single file it stands for
# with section CRCs 0, uint64 P, uint64 bytes per 128-group of each array, uint64 H and the
# optimizer state's first H bytes, the trainer state, then per part uint64 file size, CRC-32,
# range count n and n x (begin, end); last the CRC-32 of everything before). The parts' ranges
# tile the parameter order; the single file's weights are array 0, its optimizer state the H
# bytes then arrays 1 to 4.

MANIFEST_MAGIC = b"LLAMACKM"
PART_MAGIC = b"LLAMACKP"
PARTS_VERSION = 1
PART_HEADER_BYTES = 40
CHECKPOINT_ARRAYS = 5


@dataclass
class CheckpointPart:
    file_bytes: int
    crc: int
    ranges: List[Tuple[int, int]]  # elements of the parameter order, in the file's order


@dataclass
class Manifest:
    header: CheckpointHeader  # of the single file it stands for
    group_bytes: Tuple[int, ...]
    optimizer_header: bytes
    trainer_state: bytes
    parts: List[CheckpointPart]


def part_path(manifest_path: str, part: int) -> str:
    """DIR/ckpt_<step>.rank<part>.bin of the manifest DIR/ckpt_<step>.bin."""
    stem = manifest_path[:-4] if manifest_path.endswith(".bin") else manifest_path
    return f"{stem}.rank{part}.bin"


def _manifest_problem(m: Manifest) -> Optional[str]:
    """What is wrong with a manifest's numbers (checkpoint_manifest_check), or None."""
    total, h = m.header.total_padded, m.header
    if not 1 <= len(m.parts) <= 65536:
        return f"{len(m.parts)} parts, a manifest lists 1 to 65536"
    if total % PARAM_ALIGN_ELEMS or m.group_bytes[0] != 4 * PARAM_ALIGN_ELEMS or max(m.group_bytes) > 4096:
        return f"bytes per group {m.group_bytes}: the weights are FP32 groups of {PARAM_ALIGN_ELEMS}"
    groups = total // PARAM_ALIGN_ELEMS
    if len(m.optimizer_header) + sum(groups * g for g in m.group_bytes[1:]) != h.optimizer_state_bytes:
        return f"its optimizer state does not add up to the header's {h.optimizer_state_bytes} bytes"
    ranges = sorted(r for part in m.parts for r in part.ranges)
    at = 0
    for begin, end in ranges:
        if begin != at or end <= begin or end % PARAM_ALIGN_ELEMS:
            return f"the parts' ranges do not tile the parameter order at element {at}"
        at = end
    if at != total:
        return f"the parts' ranges leave out elements [{at}, {total})"
    for p, part in enumerate(m.parts):
        size = PART_HEADER_BYTES + sum((e - b) // PARAM_ALIGN_ELEMS for b, e in part.ranges) * sum(m.group_bytes)
        if part.file_bytes != size:
            return f"part {p} is said to be {part.file_bytes} bytes, its ranges make {size}"
    return None


def read_manifest(path: str) -> Manifest:
    """A per-rank checkpoint's manifest, checked against its own CRC-32 and its numbers."""
    try:
        with open_regular(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror}") from None
    fixed = 16 + CHECKPOINT_HEADER_BYTES + 8 + 8 * CHECKPOINT_ARRAYS + 8 + 8
    if len(data) < fixed or data[:8] != MANIFEST_MAGIC:
        raise FormatError(f"{path}: " + ("truncated manifest" if len(data) >= 8 and data[:8] == MANIFEST_MAGIC
                                         else "not a per-rank checkpoint's manifest (bad magic)"))
    (version,) = struct.unpack_from("<Q", data, 8)
    if version != PARTS_VERSION:
        raise FormatError(f"{path}: manifest version {version}, this script reads {PARTS_VERSION}")
    (stored,) = struct.unpack_from("<Q", data, len(data) - 8)
    if stored != zlib.crc32(data[:-8]):
        raise FormatError(f"{path}: the manifest fails its checksum (crc32 {zlib.crc32(data[:-8]):08x}, it says "
                          f"{stored:08x}): the file is damaged")
    header = unpack_checkpoint_header(data[16:16 + CHECKPOINT_HEADER_BYTES], path)
    if header.total_padded != ParamLayout(header.shape).total_padded:
        raise FormatError(f"{path}: total_padded {header.total_padded}, the layout of its shape needs "
                          f"{ParamLayout(header.shape).total_padded}")
    at = 16 + CHECKPOINT_HEADER_BYTES
    try:
        (parts,) = struct.unpack_from("<Q", data, at)
        group_bytes = struct.unpack_from(f"<{CHECKPOINT_ARRAYS}Q", data, at + 8)
        (optimizer_header_bytes,) = struct.unpack_from("<Q", data, at + 8 + 8 * CHECKPOINT_ARRAYS)
        at += 16 + 8 * CHECKPOINT_ARRAYS
        optimizer_header = data[at:at + optimizer_header_bytes]
        at += optimizer_header_bytes
        trainer_state = data[at:at + header.trainer_state_bytes]
        at += header.trainer_state_bytes
        part_list = []
        for _ in range(min(parts, 65537)):
            file_bytes, crc, count = struct.unpack_from("<3Q", data, at)
            if count > (len(data) - at) // 16:
                raise struct.error("more ranges than bytes")
            values = struct.unpack_from(f"<{2 * count}Q", data, at + 24)
            part_list.append(CheckpointPart(file_bytes, crc, list(zip(values[0::2], values[1::2]))))
            at += 24 + 16 * count
    except struct.error:
        raise FormatError(f"{path}: corrupt manifest (its sizes and counts disagree with its length)") from None
    manifest = Manifest(header, group_bytes, optimizer_header, trainer_state, part_list)
    problem = "its sizes and counts disagree with its length" if at != len(data) - 8 else _manifest_problem(manifest)
    if problem:
        raise FormatError(f"{path}: corrupt manifest: {problem}")
    return manifest


def file_chunks(path: str, start: int, nbytes: int, chunk_bytes: int) -> Iterable[bytes]:
    """nbytes of the regular file `path` from byte `start`, chunk_bytes at a time (FormatError when it ends early)."""
    try:
        with open_regular(path, "rb") as f:
            f.seek(start)
            while nbytes > 0:
                chunk = f.read(min(chunk_bytes, nbytes))
                if not chunk:
                    raise FormatError(f"{path}: ends early")
                nbytes -= len(chunk)
                yield chunk
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror}") from None


class CheckpointReader:
    """A checkpoint's bytes at the single file's offsets, read from the file itself or from a
    per-rank checkpoint's manifest and part files (every part there, of its size and header, is
    checked on opening; verify() checks the checksums)."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open_regular(path, "rb") as f:
                magic = f.read(8)
        except OSError as e:
            raise FormatError(f"{path}: cannot read: {e.strerror}") from None
        self.manifest = read_manifest(path) if magic == MANIFEST_MAGIC else None
        if self.manifest is None:
            self.header = read_checkpoint_header(path)
            return
        self.header = self.manifest.header
        self.header_bytes = pack_checkpoint_header(self.header)
        self._pieces = []  # (begin, end, part, groups of the part's ranges before it)
        self._part_groups = []
        for p, part in enumerate(self.manifest.parts):
            before = 0
            for begin, end in part.ranges:
                self._pieces.append((begin, end, p, before))
                before += (end - begin) // PARAM_ALIGN_ELEMS
            self._part_groups.append(before)
            self._check_part(p)
        self._pieces.sort()

    def _part_error(self, part: int, what: str) -> FormatError:
        return FormatError(f"{part_path(self.path, part)}: {what} (part {part} of {len(self.manifest.parts)} of {self.path})")

    def _check_part(self, part: int) -> None:
        path, expected = part_path(self.path, part), self.manifest.parts[part].file_bytes
        try:
            with open_regular(path, "rb") as f:
                head = f.read(PART_HEADER_BYTES)
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise self._part_error(part, "missing") from None
        except OSError as e:
            raise self._part_error(part, f"cannot read: {e.strerror}") from None
        if size != expected:
            raise self._part_error(part, f"size {size} bytes, the manifest says {expected} (truncated or damaged)")
        version, step, index, parts = struct.unpack_from("<4Q", head, 8)
        if head[:8] != PART_MAGIC or version != PARTS_VERSION:
            raise self._part_error(part, "not a checkpoint part of this version (bad magic or version)")
        if (step, index, parts) != (self.header.step, part, len(self.manifest.parts)):
            raise self._part_error(part, f"holds part {index} of {parts} of step {step}, the manifest expects part {part} "
                                         f"of {len(self.manifest.parts)} of step {self.header.step} here")

    def verify(self) -> None:
        """Checks a single file's sections (verify_checkpoint) or every part file against the
        CRC-32 its manifest gives; raises FormatError naming the damaged one."""
        if self.manifest is None:
            verify_checkpoint(self.path, self.header)
            return
        for p, part in enumerate(self.manifest.parts):
            crc = 0
            for chunk in file_chunks(part_path(self.path, p), 0, part.file_bytes, _CK_CHUNK_BYTES):
                crc = zlib.crc32(chunk, crc)
            if crc != part.crc:
                raise self._part_error(p, f"fails its checksum (crc32 {crc:08x}, the manifest says {part.crc:08x}): "
                                          "the file is damaged")

    def _array_chunks(self, a: int, x: int, nbytes: int, chunk_bytes: int) -> Iterable[bytes]:
        group_bytes, m = self.manifest.group_bytes[a], self.manifest
        starts = [piece[0] for piece in self._pieces]
        while nbytes > 0:
            begin, end, p, before = self._pieces[bisect.bisect_right(starts, x // group_bytes * PARAM_ALIGN_ELEMS) - 1]
            first, last = begin // PARAM_ALIGN_ELEMS * group_bytes, end // PARAM_ALIGN_ELEMS * group_bytes
            take = min(nbytes, last - x)
            at = PART_HEADER_BYTES + self._part_groups[p] * sum(m.group_bytes[:a]) + before * group_bytes + (x - first)
            yield from file_chunks(part_path(self.path, p), at, take, chunk_bytes)
            x += take
            nbytes -= take

    def chunks(self, offset: int, nbytes: int, chunk_bytes: int = _CK_CHUNK_BYTES) -> Iterable[bytes]:
        """Bytes [offset, offset + nbytes) of the single file, in chunks of at most chunk_bytes."""
        if self.manifest is None:
            yield from file_chunks(self.path, offset, nbytes, chunk_bytes)
            return
        m, groups = self.manifest, self.header.total_padded // PARAM_ALIGN_ELEMS
        regions = [(self.header_bytes, None), (None, 0), (m.optimizer_header, None)] + \
                  [(None, a) for a in range(1, CHECKPOINT_ARRAYS)] + [(m.trainer_state, None)]
        start = 0
        for blob, a in regions:
            length = len(blob) if blob is not None else groups * m.group_bytes[a]
            if nbytes > 0 and offset < start + length:
                take = min(nbytes, start + length - offset)
                if blob is not None:
                    for at in range(offset - start, offset - start + take, chunk_bytes):
                        yield blob[at:min(at + chunk_bytes, offset - start + take)]
                else:
                    yield from self._array_chunks(a, offset - start, take, chunk_bytes)
                offset += take
                nbytes -= take
            start += length
        if nbytes > 0:
            raise FormatError(f"{self.path}: a read past the end of the checkpoint (at byte {offset})")


# ---- debug state files (scripts/train_llama.py --debug-state) --------------------------------
# int32 header[256], then float32 params, int32 tokens, int32 targets, float32 logits, float32
# loss, float32 grads, float32 losses (see train_llama.py).

DEBUG_STATE_MAGIC = 20241129
DEBUG_STATE_VERSION = 1
DEBUG_STATE_HEADER_INTS = 256


def pack_debug_state_header(shape: ModelShape, batch: int, seq: int, steps: int, lr: float, beta1: float,
                            beta2: float, eps: float, weight_decay: float, grad_clip: float) -> bytes:
    header = bytearray(4 * DEBUG_STATE_HEADER_INTS)
    ints = [DEBUG_STATE_MAGIC, DEBUG_STATE_VERSION, shape.vocab_size, shape.dim, shape.n_layers, shape.n_heads,
            shape.n_kv_heads, shape.ffn_dim, shape.max_seq_len, batch, seq, steps, shape.rope_original_max_seq_len]
    struct.pack_into(f"<{len(ints)}i", header, 0, *ints)
    floats = [shape.rope_theta, shape.norm_eps, shape.rope_scaling_factor, shape.rope_low_freq_factor,
              shape.rope_high_freq_factor, lr, beta1, beta2, eps, weight_decay, grad_clip]
    struct.pack_into(f"<{len(floats)}f", header, 4 * 16, *floats)
    return bytes(header)


# ---- logits files (our trainer's logits dump, checked by check_hf_export.py) -----------------
# int32 [n_tokens, vocab], int32 tokens[n_tokens], float32 logits[n_tokens, vocab].

def pack_logits_header(tokens: List[int], vocab: int) -> bytes:
    return struct.pack(f"<2i{len(tokens)}i", len(tokens), vocab, *tokens)


def read_logits_file(path: str) -> Tuple[List[int], int, bytes]:
    """(tokens, vocab, float32 logits bytes) of a logits file."""
    try:
        with open_regular(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror}") from None
    if len(data) < 8:
        raise FormatError(f"{path}: truncated header")
    n_tokens, vocab = struct.unpack_from("<2i", data, 0)
    expected = 8 + 4 * n_tokens + 4 * n_tokens * vocab
    if n_tokens <= 0 or vocab <= 0 or len(data) != expected:
        raise FormatError(f"{path}: {len(data)} bytes, header [{n_tokens}, {vocab}] needs {expected}")
    tokens = list(struct.unpack_from(f"<{n_tokens}i", data, 8))
    return tokens, vocab, data[8 + 4 * n_tokens:]
