#!/usr/bin/env python3
"""torchvision_init_ref.py - torchvision's side of t_vision_init.sh.

  torchvision_init_ref.py write DIR
      DIR/tv.safetensors: torchvision's resnet18 (conv1 with 1 input channel,
      10 classes, imagenet stem) from seed 0, its batch-norm buffers moved off
      their initial values (running_mean, running_var random, every
      num_batches_tracked 7), written by hand in the safetensors format (an
      8-byte little-endian header length, a JSON header, the raw data) under
      the state dict's names; DIR/missing.safetensors without
      layer1.0.bn2.running_var, DIR/noparam.safetensors without
      layer2.0.downsample.0.weight; DIR/shape.safetensors with fc.weight (10, 256);
      DIR/data: 24 training and 16 test images of 28x28 in the MNIST layout
      (IDX, uncompressed). Then trains that model in PyTorch as fsdp-train
      does with --batch 8 --steps 3 --optim sgd --lr LR --momentum 0
      --weight-decay 0 --clip 0 --warmup 0 --lr-schedule constant --augment
      none --shuffle off (images 8s..8s+7 at step s, normalised
      (p/255 - 0.2860) / 0.3530, mean cross-entropy), evaluates the test
      images in eval mode, and writes DIR/ref.json: the 3 losses, every
      buffer after the 3 steps, eval_loss and eval_acc.
  torchvision_init_ref.py compare DIR FULL LOG
      FULL: fsdp-train's --save-full file; LOG: its --log. Its buffers equal
      ref.json's (running statistics within 1e-4 of each tensor's largest
      magnitude, num_batches_tracked exactly) and the last log line's
      eval_loss (1e-4 relative) and eval_acc (exactly) equal PyTorch's, and
      so do its 3 training losses (2e-5 relative).
      Exits 1 naming the first difference.
"""
import json
import os
import struct
import sys

import numpy as np

LR = 0.01
B, STEPS, N_TRAIN, N_TEST = 8, 3, 24, 16
MEAN, STD = 0.2860, 0.3530


def write_safetensors(path, tensors):
    """tensors: list of (name, numpy array) in file order."""
    header, off, blobs = {}, 0, []
    for name, a in tensors:
        a = np.array(a, order="C")  # (ascontiguousarray would make a 0-d tensor 1-d)
        dt = {np.dtype("float32"): "F32", np.dtype("int64"): "I64"}[a.dtype]
        raw = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for raw in blobs:
            f.write(raw)


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        dt = {"F32": "<f4", "I64": "<i8"}[t["dtype"]]
        s, e = t["data_offsets"]
        out[name] = np.frombuffer(data[s:e], dtype=dt).reshape(t["shape"])
    return out


def write(d):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torchvision.models import resnet18

    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
    g = torch.Generator().manual_seed(1)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.copy_(0.2 * torch.randn(mod.num_features, generator=g))
            mod.running_var.copy_(0.5 + torch.rand(mod.num_features, generator=g))
            mod.num_batches_tracked.fill_(7)
    sd = [(k, v.detach().numpy().copy()) for k, v in m.state_dict().items()]
    write_safetensors(os.path.join(d, "tv.safetensors"), sd)
    write_safetensors(os.path.join(d, "missing.safetensors"), [(k, v) for k, v in sd if k != "layer1.0.bn2.running_var"])
    write_safetensors(os.path.join(d, "noparam.safetensors"),
                      [(k, v) for k, v in sd if k != "layer2.0.downsample.0.weight"])
    write_safetensors(os.path.join(d, "shape.safetensors"),
                      [(k, v[:, :256].copy() if k == "fc.weight" else v) for k, v in sd])

    rng = np.random.default_rng(5)
    os.makedirs(os.path.join(d, "data"))
    sets = {}
    for split, n in (("train", N_TRAIN), ("t10k", N_TEST)):
        img = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        lab = rng.integers(0, 10, size=n, dtype=np.uint8)
        with open(os.path.join(d, "data", f"{split}-images-idx3-ubyte"), "wb") as f:
            f.write(struct.pack(">IIII", 0x803, n, 28, 28) + img.tobytes())
        with open(os.path.join(d, "data", f"{split}-labels-idx1-ubyte"), "wb") as f:
            f.write(struct.pack(">II", 0x801, n) + lab.tobytes())
        x = (torch.from_numpy(img.astype(np.float32)) / 255.0 - MEAN) / STD
        sets[split] = (x.unsqueeze(1), torch.from_numpy(lab.astype(np.int64)))

    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=0.0, weight_decay=0.0)
    m.train()
    x, t = sets["train"]
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(m(x[s * B:(s + 1) * B]), t[s * B:(s + 1) * B])
        loss.backward()
        losses.append(loss.item())
        opt.step()
    m.eval()
    with torch.no_grad():
        x, t = sets["t10k"]
        y = m(x)
        loss = F.cross_entropy(y, t).item()
        acc = (y.argmax(1) == t).float().mean().item()
    ref = {"losses": losses, "eval_loss": loss, "eval_acc": acc,
           "buffers": {k: v.numpy().tolist() for k, v in m.state_dict().items()
                       if k.endswith(("running_mean", "running_var", "num_batches_tracked"))}}
    with open(os.path.join(d, "ref.json"), "w") as f:
        json.dump(ref, f)


def compare(d, full, log):
    ref = json.load(open(os.path.join(d, "ref.json")))
    ours = read_safetensors(full)
    for k, v in ref["buffers"].items():
        if k not in ours:
            sys.exit(f"{full}: buffer {k} missing")
        a, b = np.asarray(v, dtype=np.float64), ours[k].astype(np.float64)
        if k.endswith("num_batches_tracked"):
            if a.item() != b.item():
                sys.exit(f"{k}: {b.item()}, PyTorch {a.item()}")
            continue
        err = np.abs(a - b).max() / max(np.abs(a).max(), 1e-12)
        if err > 1e-4:
            sys.exit(f"{k}: differs from PyTorch's by {err:.2e} of its largest magnitude")
    steps = [s for s in map(json.loads, open(log)) if "step" in s]
    if [s["step"] for s in steps] != list(range(1, STEPS + 1)):
        sys.exit(f"{log}: steps {[s['step'] for s in steps]}")
    for s, want in zip(steps, ref["losses"]):
        if abs(s["loss"] - want) > 2e-5 * abs(want):
            sys.exit(f"step {s['step']}: loss {s['loss']}, PyTorch {want}")
    last = steps[-1]
    r = abs(last["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
    if r > 1e-4 or last["eval_acc"] != ref["eval_acc"]:
        sys.exit(f"eval loss {last['eval_loss']} acc {last['eval_acc']}, PyTorch {ref['eval_loss']} {ref['eval_acc']}"
                 f" (rel {r:.2e})")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        write(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "compare":
        compare(*sys.argv[2:])
    else:
        sys.exit(__doc__)
