"""SwAV's loss in PyTorch, written from the paper's definition (Caron et al.,
2020, Alg. 1 and the distributed Sinkhorn-Knopp of its appendix) as an
independent reference for src/nn/swav.c (tests/test_mpi_swav.c).
Usage: swav_ref.py DIR. DIR/case.json holds n_crops, B, K, assign, tau, eps,
iters, queue_len; DIR/scores.bin (n_crops*B, K) and DIR/queue_<a>.bin
float32. Writes DIR/ref_loss.txt and DIR/ref_grad.bin (float64)."""
import json, os, sys
import torch

d = sys.argv[1]
c = json.load(open(os.path.join(d, 'case.json')))
nc, B, K = c['n_crops'], c['B'], c['K']
raw = open(os.path.join(d, 'scores.bin'), 'rb').read()
S = torch.frombuffer(bytearray(raw), dtype=torch.float32).double().reshape(nc * B, K).requires_grad_(True)

def sinkhorn(out, eps, iters):
    Q = torch.exp(out / eps).t()  # K x n
    Q /= Q.sum()
    Kp, n = Q.shape
    for _ in range(iters):
        Q /= Q.sum(dim=1, keepdim=True); Q /= Kp
        Q /= Q.sum(dim=0, keepdim=True); Q /= n
    Q *= n
    return Q.t()

loss = 0
for a, crop in enumerate(c['assign']):
    with torch.no_grad():
        out = S[crop * B:(crop + 1) * B]
        lq = c['queue_len'][a]
        if lq:
            qraw = open(os.path.join(d, 'queue_%d.bin' % a), 'rb').read()
            qs = torch.frombuffer(bytearray(qraw), dtype=torch.float32).double().reshape(lq, K)
            out = torch.cat([qs, out])
        q = sinkhorn(out, c['eps'], c['iters'])[-B:]
    sub = 0
    for v in range(nc):
        if v == crop:
            continue
        p = torch.log_softmax(S[v * B:(v + 1) * B] / c['tau'], dim=1)
        sub -= torch.mean(torch.sum(q * p, dim=1))
    loss += sub / (nc - 1)
loss /= len(c['assign'])
loss.backward()
open(os.path.join(d, 'ref_loss.txt'), 'w').write('%.17g\n' % loss.item())
open(os.path.join(d, 'ref_grad.bin'), 'wb').write(S.grad.numpy().tobytes())
