#!/usr/bin/env python3
"""torch_vision_ref.py - checks fsdp.c's vision layers against PyTorch.

Usage: torch_vision_ref.py DIR, where DIR was written by test_nn_vision's
vision_layers_match_pytorch: index.json lists cases, each with the layer
("spec": kind conv | bn | bn1d | l2norm | swavhead | relu | maxpool | avgpool | flatten | basicblock |
bottleneck (torchvision's) and its arguments), the input shape, its parameters' FQNs (values in
c<i>_p<j>.bin) and buffers' FQNs, and a number of train steps followed by
one eval step. Step s of case i has raw float32 files c<i>_s<s>_{x,y,dy,dx}.bin,
the parameter gradients of that step alone c<i>_s<s>_g<j>.bin and the
buffers after it c<i>_s<s>_b<j>.bin (num_batches_tracked as int64).

Builds the same torch module, loads the parameters, and for each step runs
forward (train mode, then eval mode for the last) and backward with the same
dy, comparing the output, the input gradient and every parameter gradient
(max |a-b| <= 1e-5 * max |b| + 1e-6) and the buffers after the step
(running statistics the same way, num_batches_tracked exactly).
Exits 1 on any mismatch.
"""
import json
import os
import sys

import numpy as np
import torch
import torch.nn as nn

torch.set_num_threads(1)


def load(d, name, shape, dtype=np.float32):
    a = np.fromfile(os.path.join(d, name), dtype=dtype)
    return torch.from_numpy(a.reshape(shape).copy())


def build(spec):
    k = spec["kind"]
    if k == "conv":
        return nn.Conv2d(spec["in"], spec["out"], tuple(spec["k"]), stride=tuple(spec["s"]),
                         padding=tuple(spec["p"]), dilation=tuple(spec["d"]), groups=spec["g"],
                         bias=spec["bias"])
    if k == "bn":
        return nn.BatchNorm2d(spec["c"], eps=spec["eps"], momentum=spec["momentum"])
    if k == "relu":
        return nn.ReLU()
    if k == "maxpool":
        return nn.MaxPool2d(spec["k"], spec["s"], spec["p"])
    if k == "avgpool":
        return nn.AdaptiveAvgPool2d(1)
    if k == "flatten":
        return nn.Flatten()
    if k == "basicblock":
        from torchvision.models.resnet import BasicBlock
        ds = None
        if spec["stride"] != 1 or spec["inplanes"] != spec["planes"]:
            ds = nn.Sequential(nn.Conv2d(spec["inplanes"], spec["planes"], 1, stride=spec["stride"], bias=False),
                               nn.BatchNorm2d(spec["planes"]))
        return BasicBlock(spec["inplanes"], spec["planes"], spec["stride"], ds)
    if k == "bottleneck":
        from torchvision.models.resnet import Bottleneck
        ds = None
        if spec["stride"] != 1 or spec["inplanes"] != 4 * spec["planes"]:
            ds = nn.Sequential(nn.Conv2d(spec["inplanes"], 4 * spec["planes"], 1, stride=spec["stride"], bias=False),
                               nn.BatchNorm2d(4 * spec["planes"]))
        return Bottleneck(spec["inplanes"], spec["planes"], spec["stride"], ds)
    if k == "bn1d":
        return nn.BatchNorm1d(spec["c"], eps=spec["eps"], momentum=spec["momentum"])
    if k == "l2norm":
        class L2Norm(nn.Module):
            def forward(self, x):
                return nn.functional.normalize(x, dim=1, p=2)
        return L2Norm()
    if k == "swavhead":
        # VISSL's SwAVPrototypesHead, as its paper and config describe it:
        # an MLP projection, L2 normalisation, bias-free prototype layers;
        # the output is [z, scores_0, ...] concatenated along dim 1
        class SwAVHead(nn.Module):
            def __init__(self, s):
                super().__init__()
                layers = [nn.Linear(s["in"], s["hidden"] or s["out"])]
                if s["hidden"]:
                    layers += [nn.BatchNorm1d(s["hidden"]), nn.ReLU(), nn.Linear(s["hidden"], s["out"])]
                self.projection_head = nn.Sequential(*layers)
                for j in range(s["heads"]):
                    self.add_module(f"prototypes{j}", nn.Linear(s["out"], s["k"], bias=False))
                self.heads = s["heads"]

            def forward(self, x):
                z = nn.functional.normalize(self.projection_head(x), dim=1, p=2)
                return torch.cat([z] + [getattr(self, f"prototypes{j}")(z) for j in range(self.heads)], dim=1)
        return SwAVHead(spec)
    raise SystemExit("unknown kind " + k)


def main():
    d = sys.argv[1]
    with open(os.path.join(d, "index.json")) as f:
        cases = json.load(f)
    bad = 0

    def close(what, got, want):
        nonlocal bad
        got = got.reshape(-1).double()
        want = want.reshape(-1).double()
        if got.shape != want.shape:
            print(f"{what}: {got.numel()} values, torch has {want.numel()}")
            bad += 1
            return
        diff = (got - want).abs().max().item() if want.numel() else 0.0
        tol = 1e-5 * (want.abs().max().item() if want.numel() else 0.0) + 1e-6
        if not diff <= tol:
            print(f"{what}: max |diff| {diff:.3g} > {tol:.3g}")
            bad += 1

    for i, c in enumerate(cases):
        spec, shape, steps = c["spec"], c["shape"], c["steps"]
        m = build(spec)
        params = dict(m.named_parameters())
        if sorted(params) != sorted(c["params"]):
            print(f"case {i} ({spec['kind']}): parameters {c['params']}, torch has {sorted(params)}")
            bad += 1
            continue
        bufs = dict(m.named_buffers())
        if sorted(bufs) != sorted(c["buffers"]):
            print(f"case {i} ({spec['kind']}): buffers {c['buffers']}, torch has {sorted(bufs)}")
            bad += 1
            continue
        with torch.no_grad():
            for j, name in enumerate(c["params"]):
                params[name].copy_(load(d, f"c{i}_p{j}.bin", params[name].shape))
        for s in range(steps + 1):
            m.train(s < steps)
            tag = f"case {i} ({spec['kind']}) step {s}{' (eval)' if s == steps else ''}"
            x = load(d, f"c{i}_s{s}_x.bin", shape).requires_grad_(True)
            m.zero_grad(set_to_none=False)
            y = m(x)
            close(tag + " output", load(d, f"c{i}_s{s}_y.bin", y.shape), y.detach())
            dy = load(d, f"c{i}_s{s}_dy.bin", y.shape)
            y.backward(dy)
            close(tag + " input gradient", load(d, f"c{i}_s{s}_dx.bin", shape), x.grad)
            for j, name in enumerate(c["params"]):
                close(f"{tag} {name} gradient", load(d, f"c{i}_s{s}_g{j}.bin", params[name].shape), params[name].grad)
            for j, name in enumerate(c["buffers"]):
                b = bufs[name]
                if b.dtype == torch.int64:
                    got = load(d, f"c{i}_s{s}_b{j}.bin", b.shape, np.int64)
                    if not torch.equal(got, b):
                        print(f"{tag} {name}: {got.tolist()}, torch has {b.tolist()}")
                        bad += 1
                else:
                    close(f"{tag} {name}", load(d, f"c{i}_s{s}_b{j}.bin", b.shape), b.detach())
    print(f"torch_vision_ref: {len(cases)} cases, {bad} mismatches")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
