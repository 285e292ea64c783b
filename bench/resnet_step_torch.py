#!/usr/bin/env python3
"""resnet_step_torch.py - PyTorch's side of bench/resnet_step.sh: torchvision's
ResNet-18 (conv1 with 1 input channel, 10 classes; stem imagenet = torchvision's
7x7 stride-2 conv + max-pool, cifar = 3x3 stride-1 conv, no max-pool) trained
with SGD (momentum 0.9) on random 28x28x1 images (Fashion-MNIST's shape),
NCHW tensors as PyTorch's default.
Usage: resnet_step_torch.py STEM PRECISION BATCH STEPS THREADS
(PRECISION: FP32, or AMP_BF16 = torch.autocast("cpu", torch.bfloat16)).
Prints "torch_step_ms <median> <best>" over steps 3..STEPS (ms).
"""
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models import resnet18

stem, prec, batch, steps, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
torch.manual_seed(0)
m = resnet18(num_classes=10)
if stem == "imagenet":
    m.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
else:
    m.conv1 = nn.Conv2d(1, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
m.train()
opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(batch, 1, 28, 28)
t = torch.randint(0, 10, (batch,))
times = []
for s in range(steps):
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec == "AMP_BF16"):
        loss = F.cross_entropy(m(x), t)
    loss.backward()
    opt.step()
    times.append(time.perf_counter() - t0)
print(f"torch_step_ms {1e3 * statistics.median(times[2:]):.2f} {1e3 * min(times[2:]):.2f}")
