#!/usr/bin/env python3
"""torch_ref.py - checks fsdp.c's GPT against nanoGPT's model in PyTorch.

Usage: torch_ref.py DIR, where DIR was written by test_nn's
gpt_matches_pytorch_nanogpt: index.json (config, B, T, loss, and per parameter
its FQN, shape and raw float32 files of values and gradient), tokens.bin and
targets.bin (int32, (B, T)), logits.bin (float32, (B, T, vocab)).

Rebuilds nanoGPT's GPT (GELU tanh approximation, weight tying, no dropout),
loads the same weights by FQN, runs forward, mean cross-entropy and backward,
and compares: the FQN list and order (named_parameters), the loss (relative
1e-5), the logits (|a-b| <= 1e-4 + 1e-4 |b|), and every gradient (max |a-b|
<= 1e-4 * max |b| of that tensor, + 1e-7). Exits 1 on any mismatch.
"""
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, C, n_head, block_size):
        super().__init__()
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.n_head = n_head
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        hs = C // self.n_head
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.c_fc = nn.Linear(C, 4 * C)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, C, n_head, block_size):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C)
        self.attn = CausalSelfAttention(C, n_head, block_size)
        self.ln_2 = nn.LayerNorm(C)
        self.mlp = MLP(C)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg["n_embd"]
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg["vocab_size"], C),
            wpe=nn.Embedding(cfg["block_size"], C),
            h=nn.ModuleList([Block(C, cfg["n_head"], cfg["block_size"]) for _ in range(cfg["n_layer"])]),
            ln_f=nn.LayerNorm(C),
        ))
        self.lm_head = nn.Linear(C, cfg["vocab_size"], bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx):
        T = idx.size(1)
        pos = torch.arange(0, T, dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def load(path, dtype, shape):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=dtype).reshape(shape).clone()


def main():
    d = sys.argv[1]
    idx = json.load(open(os.path.join(d, "index.json")))
    B, T, V = idx["B"], idx["T"], idx["vocab_size"]
    model = GPT(idx)
    ok = True
    names = [n for n, _ in model.named_parameters()]
    ours = [p["fqn"] for p in idx["params"]]
    if names != ours:
        print("FQN mismatch:\n torch: %s\n fsdp:  %s" % (names, ours))
        return 1
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in idx["params"]:
            params[p["fqn"]].copy_(load(os.path.join(d, p["param"]), torch.float32, p["shape"]))
    tok = load(os.path.join(d, "tokens.bin"), torch.int32, (B, T)).long()
    tgt = load(os.path.join(d, "targets.bin"), torch.int32, (B, T)).long()
    logits = model(tok)
    loss = F.cross_entropy(logits.view(-1, V), tgt.view(-1))
    loss.backward()

    rel = abs(idx["loss"] - loss.item()) / abs(loss.item())
    print("loss: fsdp %.7f torch %.7f rel %.2e" % (idx["loss"], loss.item(), rel))
    if not rel <= 1e-5:  # NaN fails too
        print("MISMATCH loss")
        ok = False
    ours_logits = load(os.path.join(d, "logits.bin"), torch.float32, (B, T, V))
    ref = logits.detach()
    diff = (ours_logits - ref).abs()
    bad = (~(diff <= 1e-4 + 1e-4 * ref.abs())).sum().item()  # NaN counts as out of tolerance
    print("logits: max abs diff %.3e (max |logit| %.3f), %d out of tolerance" % (diff.max().item(), ref.abs().max().item(), bad))
    if bad:
        print("MISMATCH logits")
        ok = False
    for p in idx["params"]:
        g = load(os.path.join(d, p["grad"]), torch.float32, p["shape"])
        r = params[p["fqn"]].grad
        err = (g - r).abs().max().item()
        scale = r.abs().max().item()
        good = bool(torch.isfinite(g).all()) and err <= 1e-4 * scale + 1e-7
        print("%-40s max|grad| %.3e  max diff %.3e  rel %.2e %s" % (p["fqn"], scale, err, err / max(scale, 1e-30), "" if good else "MISMATCH"))
        ok = ok and good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
