"""A checkpoint's model as one file that plain PyTorch (or any safetensors reader) loads without
the service: `playbook export CHECKPOINT --out FILE`. The state dict of the workload's model,
consolidated from a sharded checkpoint's shards when it is one.

The safetensors format is written here (its specification is short: an 8-byte little-endian
header length, a JSON header naming each tensor's dtype, shape and byte range, then the bytes),
so the service needs no package for it."""

from __future__ import annotations

import io
import json
import struct

import torch

FORMATS = ("torch", "safetensors")

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def to_bytes(state_dict: dict[str, torch.Tensor], fmt: str, metadata: dict[str, str]) -> bytes:
    """The state dict (CPU tensors) as a file of format `fmt`: torch's own (`torch.load`, with
    `weights_only=True`) or safetensors. `metadata` goes into safetensors' header."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    if fmt == "torch":
        buffer = io.BytesIO()
        torch.save({k: v.clone() for k, v in tensors.items()}, buffer)  # no storage shared by tied weights
        return buffer.getvalue()
    return safetensors_bytes(tensors, metadata)


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    chunks, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks)
