"""Loading a checkpoint into an already built model, optionally only slices of its tensors.

`load_checkpoint_into(model, path, slices=...)` fills a model built beforehand (typically on the
meta device, then reshaped for one rank by parallel transforms) from a Hugging Face layout
checkpoint. A parameter that holds a slice of its checkpoint tensor says which one in `slices`
(name -> (dim, start, stop[, blocks])); only those bytes are read, by a minimal safetensors
reader that
counts them (`ReadStats`). The model knows nothing of ranks: the slices are plain ranges.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path

import attrs
import numpy as np
import torch

from .config import ConfigError, ModelConfig
from .hf_config import fp8_config_of, from_hf_config, load_config_json
from .kimi import KimiForCausalLM
from .layers.moe import expert_format
from .loader import (
    CheckpointError,
    CheckpointIndex,
    _a_log_padding_problems,
    _check_parts,
    _plan,
    expert_format_of,
    resolve_dtype,
)
from .weight_map import TensorSpec, combine_parts, tensor_specs

# --- Loading into a built model, optionally only slices of tensors ------------------------------

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
# Slices along a later dim: holes up to this are read through (one read instead of one per
# leading index: a TEP w2 [E, D, I] is E * D ranges otherwise), in spans of at most _MAX_SPAN.
MAX_GAP_BYTES = 1 << 20
_MAX_SPAN = 64 << 20


class _SafetensorsFile:
    """A minimal safetensors reader that reads exactly the bytes asked for and counts them.

    The format: an 8-byte little-endian header length N, N bytes of JSON (name -> dtype, shape,
    data_offsets [begin, end) relative to the end of the header), then the data, row-major and
    little-endian. `read` seeks to each needed byte range and `readinto`s a preallocated tensor
    (or, for the many small ranges of a slice along a later dim, reads spans through holes of
    at most `max_gap` bytes), so `bytes_read` is the data asked for plus the holes read
    through (exactly the data with `max_gap=0`), `reads` the read calls; `header_bytes` is
    8 + N.
    """

    def __init__(self, path: Path, max_gap: int = 0):
        self.path = path
        self.max_gap = max_gap
        self.bytes_read = 0
        self.reads = 0
        self._file = path.open("rb")
        try:
            size = path.stat().st_size
            head = self._file.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {length} exceeds the file ({size} bytes)")
            header = json.loads(self._file.read(length))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            self.header_bytes = 8 + length
            data_size = size - self.header_bytes
            self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                dtype = _ST_DTYPES.get(info.get("dtype"))
                if dtype is None:
                    raise ValueError(f"{name}: unsupported dtype {info.get('dtype')!r}")
                shape = tuple(int(n) for n in info["shape"])
                begin, end = (int(n) for n in info["data_offsets"])
                if end - begin != math.prod(shape) * dtype.itemsize or end > data_size:
                    raise ValueError(f"{name}: data offsets [{begin}, {end}) do not fit")
                self.tensors[name] = (dtype, shape, begin)
        except Exception:
            self._file.close()
            raise

    def close(self) -> None:
        self._file.close()

    def read(
        self,
        name: str,
        dim: int | None = None,
        start: int = 0,
        stop: int | None = None,
        flat: bool = False,
    ) -> torch.Tensor:
        """The tensor `name`, or [start, stop) along `dim` of it (of its flattened form when
        `flat`). Dim 0 (or the whole dim) is one contiguous range. Along dim d > 0 the slice
        is one range per index of the leading d dims, `stride` bytes apart; ranges whose holes
        are at most `max_gap` bytes are read as one span (up to `_MAX_SPAN` bytes a read) and
        sliced in memory, the others one by one. `bytes_read` counts what was read, holes
        included."""
        dtype, stored_shape, begin = self.tensors[name]
        shape = (math.prod(stored_shape),) if flat or not stored_shape else stored_shape
        if dim is None:
            dim, start, stop = 0, 0, shape[0]
        dim %= len(shape)
        stop = shape[dim] if stop is None else stop
        outer = math.prod(shape[:dim])
        inner = math.prod(shape[dim + 1 :]) * dtype.itemsize
        out = torch.empty((*shape[:dim], stop - start, *shape[dim + 1 :]), dtype=dtype)
        chunk = (stop - start) * inner  # bytes of the slice per leading index
        stride = shape[dim] * inner  # bytes between the starts of consecutive ranges
        if out.numel():
            rows = out.reshape(-1).view(torch.uint8).numpy().reshape(outer, chunk)
            first = self.header_bytes + begin + start * inner
            if chunk == stride or outer == 1:  # one contiguous range
                self._read_into(name, first, rows.reshape(-1))
            elif stride - chunk > self.max_gap:  # big holes: one range per leading index
                for i in range(outer):
                    self._read_into(name, first + i * stride, rows[i])
            else:  # small holes: spans of `per` ranges, read through and sliced in memory
                per = max(1, min(outer, _MAX_SPAN // stride))
                span = np.empty(per * stride, dtype=np.uint8)
                for i in range(0, outer, per):
                    n = min(per, outer - i)
                    self._read_into(name, first + i * stride, span[: (n - 1) * stride + chunk])
                    rows[i : i + n] = span[: n * stride].reshape(n, stride)[:, :chunk]
        return out if flat or len(shape) == len(stored_shape) else out.reshape(stored_shape)

    def _read_into(self, name: str, offset: int, buf: np.ndarray) -> None:
        self._file.seek(offset)
        got = self._file.readinto(memoryview(buf))
        self.bytes_read += got
        self.reads += 1
        if got != buf.nbytes:
            raise OSError(f"{name}: file ended after {got} of {buf.nbytes} bytes")


@attrs.frozen
class ReadStats:
    """What `load_checkpoint_into` read: `bytes_read` tensor data bytes (the slices asked for,
    plus the holes read through between the ranges of a slice along a later dim: exactly the
    slices with `max_gap_bytes=0`), `header_bytes` of safetensors headers (8-byte length +
    JSON, every shard the index names is opened once), from `files` files, in `reads` read
    calls; `checkpoint_bytes`: the data bytes of every checkpoint tensor the model uses (what
    a load without slices reads)."""

    bytes_read: int
    header_bytes: int
    files: int
    checkpoint_bytes: int
    reads: int = 0


def _cut(cut: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(dim, start, stop, blocks) of a slice given as (dim, start, stop) or with its blocks."""
    dim, start, stop, *rest = cut
    return dim, start, stop, rest[0] if rest else 1


def _sliced_shape(spec: TensorSpec, cut: tuple[int, ...] | None) -> tuple[int, ...]:
    if cut is None:
        return spec.shape
    dim, start, stop, blocks = _cut(cut)
    return (*spec.shape[:dim], blocks * (stop - start), *spec.shape[dim + 1 :])


def _read_parts(
    spec: TensorSpec,
    names: list[str],
    cut: tuple[int, ...] | None,
    read,
) -> tuple[list[str], list[torch.Tensor]]:
    """The checkpoint parts of `spec`, only the part of each that slice `cut` needs; returns the
    names read and their tensors (a stack sliced along dim 0 reads only its experts; a slice of
    `blocks` > 1 takes [start, stop) of each of the concatenated parts, e.g. one rank's channels
    of each of the q|k|v conv blocks)."""
    if cut is None:
        return names, [read(n) for n in names]
    dim, start, stop, blocks = _cut(cut)
    if blocks > 1:
        if spec.combine != "cat" or dim != 0 or blocks != len(names):
            raise ValueError(
                f"{spec.target}: a slice of {blocks} blocks needs a tensor concatenated from "
                f"{blocks} parts along dim 0"
            )
        return names, [read(n, 0, start, stop) for n in names]
    if spec.combine == "copy":
        return names, [read(names[0], dim, start, stop)]
    if spec.combine == "a_log":  # [H], [1, 1, H, 1] or [head_dim] padded: heads are flat
        return names, [read(names[0], 0, start, stop, flat=True)]
    if spec.combine == "stack":
        if dim == 0:
            return names[start:stop], [read(n) for n in names[start:stop]]
        return names, [read(n, dim - 1, start, stop) for n in names]
    if spec.combine == "cat":  # [3P, W] from parts [P, 1, W] (or [P, W])
        rows, kept, parts = spec.part_shape[0], [], []
        for i, name in enumerate(names):
            if dim == 0:
                lo, hi = max(start, i * rows) - i * rows, min(stop, (i + 1) * rows) - i * rows
                if lo < hi:
                    kept.append(name)
                    parts.append(read(name, 0, lo, hi))
            else:
                kept.append(name)
                parts.append(read(name, -1, start, stop))
        return kept, parts
    raise ValueError(f"unknown combine {spec.combine!r}")


def load_checkpoint_into(
    model: KimiForCausalLM,
    path: str | Path,
    *,
    slices: Mapping[str, tuple[int, ...]] | None = None,
    dtype: torch.dtype | str | None = "auto",
    device: torch.device | str = "cpu",
    strict: bool = True,
    config: ModelConfig | None = None,
    max_gap_bytes: int = MAX_GAP_BYTES,
) -> ReadStats:
    """Load the checkpoint at `path` into `model`, already built (on the meta device, say), in
    place; the tensors named in `slices` hold only a slice of the checkpoint's tensor.

    slices: our qualified parameter / buffer name -> (dim, start, stop) or (dim, start, stop,
        blocks) (the tensor split in `blocks` equal blocks along dim, [start, stop) of each):
        that tensor of `model`
    holds [start, stop) along `dim` of the full tensor, and only those bytes are read. Routed
    experts (stacked from one checkpoint tensor per expert) sliced along dim 0 read only the
    experts in [start, stop); a slice along a later dim is one byte range per index of the
    leading dims: ranges at most `max_gap_bytes` apart are read as one span through the holes
    (few reads, more bytes: `ReadStats.bytes_read` counts them), farther ones one by one
    (`max_gap_bytes=0`: exactly the slice's bytes). A sliced A_log's zero padding (K3) is not
    read, so not checked.
    config: the configuration the model was built from (default `model.config`; a model
    reshaped after building, e.g. to fewer local heads, gives the one it was built from).
    It must be the checkpoint's, and the model's experts in the checkpoint's format
    (`use_mxfp4_experts` before loading an MXFP4 checkpoint). dtype, device and strict are as
    for `load_checkpoint`. With `tie_word_embeddings` the head is the embedding: a
    checkpoint that stores `lm_head.weight` anyway (a redundant copy some writers keep) has it
    not read, and the model's head stays the embedding as loaded (sliced or not). Every
    shard's header is read (shape checks); tensors are read with a minimal reader
    (`_SafetensorsFile`), never memory-mapped.
    Raises CheckpointError (missing / unexpected / mis-shaped tensors, bad slices, tensors of
    the model the checkpoint does not provide) before anything is assigned.
    """
    root = Path(path)
    raw = load_config_json(root)
    experts = expert_format_of(raw)
    if fp8_config_of(raw) is not None:
        raise CheckpointError(
            other=[
                f"{root}: an FP8 block-scaled checkpoint (quantization_config quant_method "
                "fp8): only load_checkpoint reads these (one rank); slices of FP8 weights and "
                "their block scales are not read by load_checkpoint_into yet"
            ]
        )
    config = model.config if config is None else config
    stored = from_hf_config(raw)
    if stored != config:
        raise ConfigError(
            f"{root}: the checkpoint's config is not the model's (build the model from "
            "`from_hf_config` of the checkpoint)"
        )
    if expert_format(model) != experts:
        raise CheckpointError(
            other=[
                f"the checkpoint's routed experts are {experts}, the model's "
                f"{expert_format(model)} (use_mxfp4_experts before loading MXFP4 experts)"
            ]
        )
    dtype = resolve_dtype(dtype, raw)
    slices = {name: tuple(int(x) for x in cut) for name, cut in (slices or {}).items()}
    index = CheckpointIndex.open(root)
    specs = tensor_specs(config, experts)
    by_target = {spec.target: spec for spec in specs}
    state = model.state_dict(keep_vars=True)

    problems = []
    for name, cut in sorted(slices.items()):
        dim, start, stop, blocks = _cut(cut)
        spec = by_target.get(name)
        if spec is None:
            problems.append(f"slice of {name}: no such checkpoint-backed tensor")
        elif not (
            0 <= dim < len(spec.shape)
            and blocks >= 1
            and spec.shape[dim] % blocks == 0
            and 0 <= start < stop <= spec.shape[dim] // blocks
        ):
            problems.append(
                f"slice of {name}: [{start}, {stop}) along dim {dim} is outside its shape "
                f"{list(spec.shape)}"
            )
    for spec in specs:
        want = _sliced_shape(spec, slices.get(spec.target))
        have = state.get(spec.target)
        if have is None:
            problems.append(f"{spec.target}: not in the model")
        elif tuple(have.shape) != want and not problems:
            problems.append(
                f"{spec.target}: the model holds shape {list(have.shape)}, the checkpoint "
                f"{'slice ' if spec.target in slices else ''}gives {list(want)}"
            )
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    problems += [
        f"{name}: the model's, not in the checkpoint's layout"
        for name in sorted(set(state) - set(by_target) - tied)
    ]
    if problems:
        raise CheckpointError(other=problems)

    files: dict[str, _SafetensorsFile] = {}
    try:
        shapes, file_problems = {}, list(index.unreadable)
        by_file: dict[str, list[str]] = {}
        for normal, (file, _) in index.entries.items():
            by_file.setdefault(file, []).append(normal)
        for file, names in by_file.items():
            if not (root / file).is_file():
                file_problems.append(
                    f"{file}: no such file (the index places {len(names)} tensors there)"
                )
                continue
            try:
                files[file] = _SafetensorsFile(root / file, max_gap_bytes)
            except (OSError, ValueError, KeyError, TypeError) as err:
                file_problems.append(f"{file}: unreadable ({err})")
                continue
            for normal in names:
                theirs = index.entries[normal][1]
                if theirs not in files[file].tensors:
                    file_problems.append(f"{theirs}: not in {file}, where the index places it")
                    continue
                shapes[normal] = files[file].tensors[theirs][1]
        if tied:
            shapes.pop("lm_head.weight", None)  # a redundant stored copy: not read
        plan = _plan(specs, index, strict, shapes=(shapes, file_problems))

        def read(normal: str, *args, **kwargs) -> torch.Tensor:
            file, theirs = index.entries[normal]
            return files[file].read(theirs, *args, **kwargs)

        tensors: dict[str, torch.Tensor] = {}
        checkpoint_bytes = 0
        for spec in specs:
            names = plan.sources[spec.target]
            for name in names:
                file, theirs = index.entries[name]
                dt, shape, _ = files[file].tensors[theirs]
                checkpoint_bytes += math.prod(shape) * dt.itemsize
            cut = slices.get(spec.target)
            known = len(problems)
            try:
                names, parts = _read_parts(spec, names, cut, read)
            except OSError as err:
                problems.append(f"{spec.target}: unreadable ({err})")
                continue
            if spec.combine == "a_log" and cut is None:
                problems += _a_log_padding_problems(spec, names[0], parts[0])
            target_dtype = _check_parts(spec, names, parts, dtype, problems)
            if len(problems) > known:
                continue
            tensors[spec.target] = combine_parts(spec, parts).to(device=device, dtype=target_dtype)
        stats = ReadStats(
            bytes_read=sum(f.bytes_read for f in files.values()),
            header_bytes=sum(f.header_bytes for f in files.values()),
            files=len(files),
            checkpoint_bytes=checkpoint_bytes,
            reads=sum(f.reads for f in files.values()),
        )
    finally:
        for handle in files.values():
            handle.close()
    if problems:
        raise CheckpointError(other=problems)
    # A tied head is the embedding as loaded (sliced or not): re-tied, never loaded itself.
    result = model.load_state_dict(tensors, strict=False, assign=True)
    assert not result.unexpected_keys and set(result.missing_keys) <= tied, result
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return stats
