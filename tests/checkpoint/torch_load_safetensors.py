"""Loads safetensors files written by `strata checkpoint export` with torch alone (torch 1.13 has
no safetensors loader: the header is parsed here and the tensors built with torch.frombuffer).

Usage: torch_load_safetensors.py FP32_FILE BF16_FILE FP16_FILE EXPECTED_JSON
EXPECTED_JSON maps tensor names to element counts. Checks every name and shape, that the fp32 file
holds finite values, and that the bf16 and fp16 exports equal torch's own rounding of the fp32
values (round to nearest even), element for element. Exit 0 ok, 1 mismatch, 77 no torch.
"""
import json
import struct
import sys

try:
    import torch
except ImportError:
    print("torch is not importable", file=sys.stderr)
    sys.exit(77)

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def load(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        dtype = DTYPES[t["dtype"]]
        if end > begin:
            x = torch.frombuffer(bytearray(data[base + begin : base + end]), dtype=dtype)
        else:
            x = torch.empty(0, dtype=dtype)
        out[name] = x.reshape(t["shape"])
    return out, meta


def main():
    f32, meta = load(sys.argv[1])
    bf16, _ = load(sys.argv[2])
    f16, _ = load(sys.argv[3])
    expected = json.loads(sys.argv[4])
    ok = True
    if sorted(f32) != sorted(expected) or sorted(bf16) != sorted(expected) or sorted(f16) != sorted(expected):
        print("names differ:", sorted(f32), sorted(expected))
        return 1
    for name, numel in expected.items():
        a = f32[name]
        if a.dtype != torch.float32 or bf16[name].dtype != torch.bfloat16 or f16[name].dtype != torch.float16:
            print(name, "has the wrong dtype")
            ok = False
        if a.numel() != numel or list(a.shape) != [numel]:
            print(name, "has shape", list(a.shape), "expected", [numel])
            ok = False
        if not torch.isfinite(a).all():
            print(name, "has non-finite values")
            ok = False
        if not torch.equal(bf16[name], a.to(torch.bfloat16)):
            print(name, "bf16 export differs from torch's rounding")
            ok = False
        if not torch.equal(f16[name], a.to(torch.float16)):
            print(name, "fp16 export differs from torch's rounding")
            ok = False
        print(f"{name}: {a.dtype} {list(a.shape)} first values {a[:3].tolist()}")
    print("metadata:", json.dumps(meta, sort_keys=True))
    print("torch", torch.__version__, "loaded", len(f32), "tensors from each file:", "ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
