"""A small, strict safetensors reader for torch versions without the `safetensors` package
(Debian 12's python3-torch 1.13 has none).

    import strata.safetensors
    model.load_state_dict(strata.safetensors.load_file("model.safetensors"))

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length N,
N bytes of JSON (an object: tensor name -> {"dtype", "shape", "data_offsets": [begin, end]}, plus
an optional "__metadata__" object of strings), then the data. This reader checks everything before
it allocates anything: the header's length against the file and against MAX_HEADER_BYTES, the
JSON (UTF-8, an object, no duplicate keys, no fields beyond the three), every dtype, shape and
offset pair (end - begin = elements x element size; the tensors tile the data exactly, without
gap or overlap, as the format requires), so that what it allocates is at most the file's own
data. Any violation raises strata.InvalidArgumentError (a ValueError) naming the file and the
tensor; an I/O failure raises OSError. Tensors come back as CPU tensors in the file's dtype and
shape (each its own storage).
"""
import json
import os
import sys

import torch

from .errors import InvalidArgumentError

__all__ = ["load_file", "load_metadata", "MAX_HEADER_BYTES"]

MAX_HEADER_BYTES = 100 * 1000 * 1000  # what the reference implementation accepts
_MAX_DIMS = 64

_DTYPES = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
    "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}


def _bad(path, what):
    raise InvalidArgumentError("strata.safetensors: %s: %s" % (path, what))


def _no_duplicates(path):
    def hook(pairs):
        d = {}
        for k, v in pairs:
            if k in d:
                _bad(path, "the header has the key %r twice" % k)
            d[k] = v
        return d
    return hook


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _read_header(f, path, size):
    if size < 8:
        _bad(path, "%d bytes: too short for a safetensors file (8-byte header length)" % size)
    n = int.from_bytes(f.read(8), "little")
    if n < 2 or n > size - 8 or n > MAX_HEADER_BYTES:
        _bad(path, "header length %d does not fit (file of %d bytes, at most %d header bytes)"
             % (n, size, MAX_HEADER_BYTES))
    raw = f.read(n)
    if len(raw) != n:
        raise OSError("strata.safetensors: %s: short read of the header (%d of %d bytes)"
                      % (path, len(raw), n))
    try:
        text = raw.decode("utf-8")
        header = json.loads(text, object_pairs_hook=_no_duplicates(path))
    except (UnicodeDecodeError, ValueError) as e:
        if isinstance(e, InvalidArgumentError):
            raise
        _bad(path, "the header is not UTF-8 JSON (%s)" % e)
    if not isinstance(header, dict):
        _bad(path, "the header is not a JSON object")
    return header, 8 + n


def _check_metadata(path, meta):
    if not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        _bad(path, "__metadata__ is not an object of strings")


def _check_entry(path, name, e, data_bytes):
    """(dtype, shape, begin, end) of one tensor entry, checked."""
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        _bad(path, "tensor %r: expected exactly dtype, shape, data_offsets" % name)
    if e["dtype"] not in _DTYPES:
        _bad(path, "tensor %r: dtype %r is not one of %s" % (name, e["dtype"], " ".join(_DTYPES)))
    shape, offsets = e["shape"], e["data_offsets"]
    if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
            or not all(_int(d) and d >= 0 for d in shape)):
        _bad(path, "tensor %r: shape %r is not a list of at most %d non-negative integers"
             % (name, shape, _MAX_DIMS))
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_int(o) for o in offsets):
        _bad(path, "tensor %r: data_offsets %r is not [begin, end]" % (name, offsets))
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        _bad(path, "tensor %r: data_offsets [%d, %d] outside the %d data bytes"
             % (name, begin, end, data_bytes))
    numel = 1
    for d in shape:
        numel *= d
    dtype, size = _DTYPES[e["dtype"]]
    if numel * size != end - begin:
        _bad(path, "tensor %r: shape %s of %s needs %d bytes, data_offsets give %d"
             % (name, shape, e["dtype"], numel * size, end - begin))
    return dtype, shape, begin, end


def _parse(path, header, data_bytes):
    entries = {}
    for name, e in header.items():
        if name == "__metadata__":
            _check_metadata(path, e)
            continue
        entries[name] = _check_entry(path, name, e, data_bytes)
    pos = 0
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != pos:
            _bad(path, "tensor %r starts at data byte %d, expected %d (the tensors must tile the "
                 "data without gap or overlap)" % (name, begin, pos))
        pos = end
    if pos != data_bytes:
        _bad(path, "the tensors hold %d data bytes, the file has %d" % (pos, data_bytes))
    return entries


def load_metadata(path):
    """The header's "__metadata__" (a dict of strings; {} when there is none), checked."""
    with open(os.fspath(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header, start = _read_header(f, path, size)
        _parse(path, header, size - start)
        return dict(header.get("__metadata__", {}))


def load_file(path, device="cpu"):
    """Every tensor of the safetensors file at `path`: {name: tensor}, in the file's dtypes and
    shapes, on `device` (read to the CPU first)."""
    if sys.byteorder != "little":
        raise InvalidArgumentError("strata.safetensors: a little-endian host is needed")
    path = os.fspath(path)
    out = {}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header, start = _read_header(f, path, size)
        entries = _parse(path, header, size - start)
        for name, (dtype, shape, begin, end) in entries.items():
            t = torch.empty(shape, dtype=dtype)
            if end > begin:
                f.seek(start + begin)
                buf = bytearray(end - begin)
                got = f.readinto(buf)
                if got != end - begin:
                    raise OSError("strata.safetensors: %s: short read of tensor %r (%d of %d bytes "
                                  "at offset %d)" % (path, name, got, end - begin, start + begin))
                t = torch.frombuffer(buf, dtype=dtype).reshape(shape)
            out[name] = t.to(device) if device != "cpu" else t
    return out
