"""A small GPT (token + position embedding, causal self-attention, LayerNorm, GELU MLP, head tied
to the token embedding) and an offline byte-level corpus, for examples/train_gpt.py and strata's
Python tests (tests/python). Plain torch: nothing here knows about strata.
"""
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256  # bytes


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, heads, seq_len):
        super().__init__()
        assert d_model % heads == 0
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.register_buffer("mask", torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool)),
                             persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d_model, heads, seq_len):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, seq_len)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d_model=192, layers=6, heads=6, seq_len=64, vocab=VOCAB):
        super().__init__()
        self.seq_len = seq_len
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList([Block(d_model, heads, seq_len) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        for n, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if n.endswith(("proj.weight", "out.weight")) else 0.02)
            elif n.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        # The loss in FP32 whatever the model's dtype.
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def num_params(model):
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# ---- data ----
_LICENSES = "/usr/share/common-licenses"


def generated_corpus(n_bytes=200_000, seed=0):
    """Deterministic pseudo-English, for machines without Debian's license texts."""
    g = torch.Generator().manual_seed(seed)
    words = ("the model state of each rank lives in tiers gpu host memory and nvme while the "
             "optimizer streams chunks through pinned buffers reading ahead and writing behind "
             "so that training runs close to the speed of the slowest link").split()
    out, size = [], 0
    while size < n_bytes:
        n = int(torch.randint(4, 14, (1,), generator=g))
        idx = torch.randint(0, len(words), (n,), generator=g).tolist()
        s = " ".join(words[i] for i in idx).capitalize() + ". "
        out.append(s)
        size += len(s)
    return "".join(out).encode()[:n_bytes]


def load_corpus(path=None):
    """Bytes of text: `path` if given, else Debian's license texts (/usr/share/common-licenses, in
    every Debian install, about 250 kB), else a generated corpus."""
    if path:
        with open(path, "rb") as f:
            return f.read()
    data = b""
    if os.path.isdir(_LICENSES):
        for name in sorted(os.listdir(_LICENSES)):
            p = os.path.join(_LICENSES, name)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    data += f.read()
    return data if len(data) > 10_000 else generated_corpus()


def global_batch(data, step, global_rows, seq_len, seed=1234):
    """(inputs, targets), each global_rows x seq_len int64, for one step: the same on every rank
    and in every run (rows sampled with a generator seeded by (seed, step))."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq_len - 1, (global_rows,), generator=g)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = torch.stack([buf[s:s + seq_len + 1] for s in starts.tolist()]).long()
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
