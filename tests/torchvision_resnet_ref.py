#!/usr/bin/env python3
"""torchvision_resnet_ref.py - checks fsdp.c's ResNet against torchvision's.

Usage: torchvision_resnet_ref.py DIR, where DIR was written by test_resnet:
index.json lists cases, each a model config (arch, in_chans, num_classes,
stem, width), the model's state-dict keys in order ("names": parameters and
persistent buffers, module by module as PyTorch's state_dict), its FLOPs per
image of H x W as fsdp_resnet_flops_per_image counts them, and, when "data"
is true, raw files: parameters c<i>_p<j>.bin (float32, "params" order), an
input c<i>_x.bin (N, in_chans, H, W) and int32 targets c<i>_t.bin, the buffers
before c<i>_bi<j>.bin, then what fsdp.c computed: logits c<i>_y.bin (train
mode if "train", else eval mode), the cross-entropy loss
c<i>_loss.bin, the input gradient c<i>_dx.bin, parameter gradients
c<i>_g<j>.bin, buffers after that forward c<i>_b<j>.bin ("buffers" order;
num_batches_tracked int64) and eval-mode logits c<i>_ye.bin.

The torch model is torchvision's ResNet with conv1 replaced for in_chans
(and the cifar stem: a 3x3 stride-1 conv1, maxpool an Identity) and, for a
width other than 64, layer1..4 and fc rebuilt with torchvision's own
_make_layer from that width. Values must agree to 1e-4 of the largest
magnitude of each tensor (num_batches_tracked exactly). Exits 1 on any
mismatch.
"""
import json
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

torch.set_num_threads(1)
LAYERS = {"resnet18": [2, 2, 2, 2], "resnet34": [3, 4, 6, 3], "resnet50": [3, 4, 6, 3]}


def build(c):
    block = Bottleneck if c["arch"] == "resnet50" else BasicBlock
    layers = LAYERS[c["arch"]]
    m = ResNet(block, layers, num_classes=c["num_classes"])
    w = c["width"]
    if c["stem"] == "imagenet":
        m.conv1 = nn.Conv2d(c["in_chans"], w, 7, 2, 3, bias=False)
    else:
        m.conv1 = nn.Conv2d(c["in_chans"], w, 3, 1, 1, bias=False)
        m.maxpool = nn.Identity()
    if w != 64:
        m.bn1 = nn.BatchNorm2d(w)
        m.inplanes = w
        m.layer1 = m._make_layer(block, w, layers[0])
        m.layer2 = m._make_layer(block, 2 * w, layers[1], stride=2)
        m.layer3 = m._make_layer(block, 4 * w, layers[2], stride=2)
        m.layer4 = m._make_layer(block, 8 * w, layers[3], stride=2)
        m.fc = nn.Linear(8 * w * block.expansion, c["num_classes"])
    return m


def flops(m, c):
    total = [0]

    def conv_hook(mod, inp, out):
        k = mod.kernel_size[0] * mod.kernel_size[1]
        total[0] += 2 * out[0].numel() * (mod.in_channels // mod.groups) * k

    def fc_hook(mod, inp, out):
        total[0] += 2 * mod.in_features * mod.out_features

    hs = []
    for mod in m.modules():
        if isinstance(mod, nn.Conv2d):
            hs.append(mod.register_forward_hook(conv_hook))
        elif isinstance(mod, nn.Linear):
            hs.append(mod.register_forward_hook(fc_hook))
    m.eval()
    with torch.no_grad():
        m(torch.zeros(1, c["in_chans"], c["H"], c["W"]))
    for h in hs:
        h.remove()
    return total[0]


def main():
    d = sys.argv[1]
    with open(os.path.join(d, "index.json")) as f:
        cases = json.load(f)
    bad = 0

    def load(name, shape, dtype=np.float32):
        a = np.fromfile(os.path.join(d, name), dtype=dtype)
        return torch.from_numpy(a.reshape(shape).copy())

    def close(what, got, want):
        nonlocal bad
        got = got.reshape(-1).double()
        want = want.reshape(-1).double()
        if got.shape != want.shape:
            print(f"{what}: {got.numel()} values, torch has {want.numel()}")
            bad += 1
            return
        diff = (got - want).abs().max().item()
        tol = 1e-4 * want.abs().max().item() + 1e-7
        if not diff <= tol:
            print(f"{what}: max |diff| {diff:.3g} > {tol:.3g}")
            bad += 1

    for i, c in enumerate(cases):
        tag = f"case {i} ({c['arch']}, {c['stem']}, width {c['width']})"
        torch.manual_seed(0)
        m = build(c)
        keys = list(m.state_dict().keys())
        if keys != c["names"]:
            extra = [k for k in c["names"] if k not in keys]
            missing = [k for k in keys if k not in c["names"]]
            print(f"{tag}: names differ from torchvision's state_dict keys: ours only {extra[:5]}, "
                  f"torchvision only {missing[:5]}, order same: {sorted(keys) == sorted(c['names'])}")
            bad += 1
            continue
        fl = flops(m, c)
        if abs(fl - c["flops"]) > 1e-9 * fl:
            print(f"{tag}: {c['flops']} FLOPs per {c['H']}x{c['W']} image, torch's convs and fc make {fl}")
            bad += 1
        if not c["data"]:
            continue
        params = dict(m.named_parameters())
        bufs = dict(m.named_buffers())
        with torch.no_grad():
            for j, name in enumerate(c["params"]):
                params[name].copy_(load(f"c{i}_p{j}.bin", params[name].shape))
            for j, name in enumerate(c["buffers"]):
                b = bufs[name]
                b.copy_(load(f"c{i}_bi{j}.bin", b.shape, np.int64 if b.dtype == torch.int64 else np.float32))
        shape = [c["N"], c["in_chans"], c["H"], c["W"]]
        x = load(f"c{i}_x.bin", shape).requires_grad_(True)
        t = load(f"c{i}_t.bin", [c["N"]], np.int32).long()
        m.train(c["train"])
        y = m(x)
        close(tag + " logits", load(f"c{i}_y.bin", y.shape), y.detach())
        loss = F.cross_entropy(y, t)
        close(tag + " loss", load(f"c{i}_loss.bin", [1]), loss.detach().reshape(1))
        loss.backward()
        close(tag + " input gradient", load(f"c{i}_dx.bin", shape), x.grad)
        for j, name in enumerate(c["params"]):
            close(f"{tag} {name} gradient", load(f"c{i}_g{j}.bin", params[name].shape), params[name].grad)
        for j, name in enumerate(c["buffers"]):
            b = bufs[name]
            if b.dtype == torch.int64:
                got = load(f"c{i}_b{j}.bin", b.shape, np.int64)
                if not torch.equal(got, b):
                    print(f"{tag} {name}: {got.tolist()}, torch has {b.tolist()}")
                    bad += 1
            else:
                close(f"{tag} {name}", load(f"c{i}_b{j}.bin", b.shape), b)
        m.eval()
        with torch.no_grad():
            ye = m(x)
        close(tag + " eval logits", load(f"c{i}_ye.bin", ye.shape), ye)
    if bad:
        print(f"torchvision_resnet_ref: {bad} mismatches")
        sys.exit(1)
    print(f"torchvision_resnet_ref: {len(cases)} cases match")


if __name__ == "__main__":
    main()
