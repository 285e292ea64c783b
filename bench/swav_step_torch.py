#!/usr/bin/env python3
"""swav_step_torch.py - a SwAV training step in PyTorch 1.13, the reference
for bench/swav_step.sh: the model and crops of `fsdp-train --task swav` with
a ResNet-18 trunk (torchvision's BasicBlock ResNet, the cifar stem: a 3x3
stride-1 conv1 and no max pool, layers rebuilt for a width w, no fc), SwAV's
head (Linear-BN-ReLU-Linear, L2 normalisation, prototypes without bias),
2 global crops of G x G and V small crops of S x S per image, each
resolution through the model in one batch, codes of the global crops by
Sinkhorn-Knopp (3 iterations, eps 0.05), the swapped-prediction loss
(temperature 0.1), backward, an SGD step with LARC trust ratios (biases and
batch norm excluded, as SwAV's LARC with clip off) and the prototypes'
rows renormalised. The crops are random tensors made before the clock
starts (the data pipeline is not timed here; fsdp-train's step_ms includes
its crops).

Usage: swav_step_torch.py THREADS STEPS BATCH WIDTH G V S HIDDEN DIM K
Prints one line per step: "step_ms X".
"""
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models.resnet import BasicBlock, ResNet


def trunk(width):
    m = ResNet(BasicBlock, [2, 2, 2, 2], num_classes=10)
    m.inplanes = width
    m.conv1 = nn.Conv2d(1, width, 3, 1, 1, bias=False)
    m.bn1 = nn.BatchNorm2d(width)
    m.maxpool = nn.Identity()
    m.layer1 = m._make_layer(BasicBlock, width, 2)
    m.layer2 = m._make_layer(BasicBlock, 2 * width, 2, stride=2)
    m.layer3 = m._make_layer(BasicBlock, 4 * width, 2, stride=2)
    m.layer4 = m._make_layer(BasicBlock, 8 * width, 2, stride=2)
    m.fc = nn.Identity()
    return m


class SwAV(nn.Module):
    def __init__(self, width, hidden, dim, k):
        super().__init__()
        self.trunk = trunk(width)
        f = 8 * width
        self.projection_head = nn.Sequential(nn.Linear(f, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
                                             nn.Linear(hidden, dim))
        self.prototypes = nn.Linear(dim, k, bias=False)

    def forward(self, crops):  # a list of batches, one per resolution
        feats = torch.cat([self.trunk(x) for x in crops])
        z = F.normalize(self.projection_head(feats), dim=1)
        return z, self.prototypes(z)


@torch.no_grad()
def sinkhorn(scores, eps=0.05, iters=3):
    q = torch.exp(scores / eps).t()
    q /= q.sum()
    k, b = q.shape
    for _ in range(iters):
        q /= q.sum(dim=1, keepdim=True)
        q /= k
        q /= q.sum(dim=0, keepdim=True)
        q /= b
    return (q * b).t()


def lars_step(model, lr, momentum=0.9, wd=1e-6, eta=0.001, state={}):
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = p.grad
            if p.ndim > 1:  # LARC's trust ratio; biases and batch norm plain SGD
                g = g + wd * p
                pn, gn = p.norm(), g.norm()
                if pn > 0 and gn > 0:
                    g = g * (eta * pn / gn)
            buf = state.get(name)
            if buf is None:
                buf = state[name] = g.clone()
            else:
                buf.mul_(momentum).add_(g)
            p.add_(buf, alpha=-lr)
        w = model.prototypes.weight
        w.copy_(F.normalize(w, dim=1))


def main():
    threads, steps, B, width, G, V, S, hidden, dim, k = map(int, sys.argv[1:11])
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = SwAV(width, hidden, dim, k)
    model.train()
    xg = torch.randn(2 * B, 1, G, G)
    xs = torch.randn(V * B, 1, S, S) if V else None
    n_crops, tau = 2 + V, 0.1
    for _ in range(steps):
        t0 = time.perf_counter()
        z, scores = model([xg, xs] if V else [xg])
        loss = 0
        for i in range(2):
            q = sinkhorn(scores[i * B:(i + 1) * B].detach())
            for v in range(n_crops):
                if v == i:
                    continue
                loss = loss - torch.mean(torch.sum(q * F.log_softmax(scores[v * B:(v + 1) * B] / tau, dim=1), dim=1))
        loss = loss / (2 * (n_crops - 1))
        model.zero_grad(set_to_none=True)
        loss.backward()
        lars_step(model, 0.1)
        print(f"step_ms {(time.perf_counter() - t0) * 1e3:.3f}", flush=True)


if __name__ == "__main__":
    main()
