"""
The optimizer of the policy: AdamW, or the released code's Muon + AdamW split (its default).

    optimizers = build(policy, 'muon', lr=1e-5, weight_decay=0.01)   # a list of torch optimizers
    for o in optimizers: o.step()

Muon (torch.optim.Muon) for every trainable 2-D weight matrix: the Nesterov momentum of the
gradient is orthogonalised by 5 Newton-Schulz iterations (U S V^T -> ~U V^T, in bf16) and applied
with lr * 0.2 * sqrt(max(rows, cols)) (torch's adjust_lr_fn='match_rms_adamw' is exactly the rule of
the released HunyuanVideo-1.5 hyvideo/optim/muon.py, adjust_lr_for_muon), decoupled weight decay
lr * wd. AdamW, betas (0.95, 0.95), eps 1e-8 (the released Muon's "AdamW backup"), for the rest:
biases and norm gains (0-D/1-D). Matrices include the embedders (patch/text/time projections,
cond_type_embed) and the final projection proj_out, as the released split (ndim >= 2) does.

FSDP2: Newton-Schulz needs the whole matrix, and FSDP2's gradient is a Shard(0) DTensor (rows split
over ranks). Muon.step below keeps the momentum sharded (an elementwise update), gathers the
whole momentum matrix (full_tensor: one all-gather per matrix), orthogonalises it on every rank and
keeps its own rows (distribute_tensor with src_data_rank=None: a local slice, no communication).
The released code does the same (full_tensor, then DTensor.from_local, replicated). Under HSDP the
gradient is (Replicate, Shard(0)) on a 2-D mesh and full_tensor gathers over the shard group only
(a node's ranks; tests/test_nodes.py). torch.optim.Muon as shipped also runs on DTensors, through
DTensor's op dispatch (collectives inside each of the 5 iterations), but its result differed from
the whole-matrix one by up to 1.4e-2 on entries of ~0.1 (a 16x64 bf16 test on 2 ranks), and
tests/test_optimizer.py shows its weights diverge. Cost per optimizer step and rank: an all-gather
of every 2-D gradient in fp32 (the volume of FSDP's own weight all-gather, ~4 bytes x parameters)
and the Newton-Schulz flops of the whole model, repeated on every rank (not split across ranks);
measured on the toy: results/README.md section 4.

Where this differs from the released code and why:
- torch.optim.Muon accepts 2-D matrices only: a >2-D weight (HunyuanVideo's Conv3d patch embedder
  x_embedder.proj, 0.2% of the toy's weights) goes to AdamW; the released code flattens it into Muon.
- torch's momentum is an EMA (buf.lerp_(g, 1 - mu)); the released one is a sum (buf = mu buf + g).
  The two differ by the factor 1 - mu, which the Newton-Schulz normalisation removes (up to eps).
- a matrix without a gradient is skipped (torch); the released Muon steps it with a zero gradient
  (decay and momentum keep moving it).

torch's Newton-Schulz and lr rule are private functions of torch.optim._muon (present in 2.9-2.13); where
a torch lacks them, newton_schulz() and adjust_lr() below (the same math) stand in, said once in the log.

Tested by: python -m pytest tests/test_optimizer.py   (2 FSDP ranks vs one process, torchrun on CPU;
           tests/test_private_torch.py: the stand-ins with torch's private functions hidden)
"""
import math

import torch
import torch.optim._muon as torch_muon  # the module of torch.optim.Muon (public since 2.9)
from torch.distributed.tensor import DTensor, distribute_tensor

from infra.parallel import reshard

KINDS = ('muon', 'adamw')  # the `optimizer` setting of train.py
MOMENTUM = 0.95            # Muon's Nesterov momentum: the released value, fixed (not a setting)
ADAMW_BETAS = (0.95, 0.95)  # betas of the AdamW part of the muon setting (the released Muon's backup)
ADAMW_EPS = 1e-8           # eps of that AdamW part
ADJUST_LR = 'match_rms_adamw'  # lr * 0.2 * sqrt(max(A, B)): the released adjust_lr_for_muon
_SAID = set()  # the private torch functions found missing, each said once


def _torch_private(name):
    """torch.optim._muon's private function `name`, or None where this torch lacks it (said once)."""
    fn = getattr(torch_muon, name, None)
    if fn is None and name not in _SAID:
        _SAID.add(name)
        print(f'optimizer: torch {torch.__version__} has no torch.optim._muon.{name}: infra/optimizer.py\'s '
              'own stands in (the same math)', flush=True)
    return fn


def newton_schulz(G, coefficients, steps, eps):
    """~U V^T of G = U S V^T (singular values pushed near 1, roughly 0.5-1.5, not exactly), in bf16: from
    X = G / |G|_F (so every singular value <= 1), `steps` quintic iterations X <- a X + (b A + c A^2) X with
    A = X X^T, on the orientation with fewer rows (the smaller Gram matrix A)."""
    tall = G.size(0) > G.size(1)
    X = G.bfloat16().T if tall else G.bfloat16()  # (rows <= cols)
    X = X / X.norm().clamp(min=eps)
    a, b, c = coefficients
    for _ in range(steps):
        A = X @ X.T
        X = torch.addmm(X, torch.addmm(A, A, A, beta=b, alpha=c), X, beta=a)  # fused: one bf16 rounding a product
    return X.T if tall else X


def orthogonalise(update, group):
    """torch's Newton-Schulz of Muon (private), else newton_schulz(): the same iteration."""
    fn = _torch_private('_zeropower_via_newtonschulz') or newton_schulz
    return fn(update, group['ns_coefficients'], group['ns_steps'], group['eps'])


def adjust_lr(lr, shape):
    """Muon's lr for an (A, B) matrix under ADJUST_LR: lr * 0.2 * sqrt(max(A, B)) (torch's private
    _adjust_lr where present)."""
    fn = _torch_private('_adjust_lr')
    return fn(lr, ADJUST_LR, shape) if fn else lr * 0.2 * math.sqrt(max(shape[0], shape[1]))


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose Newton-Schulz step sees the whole matrix under FSDP2 (see above)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            mu = group['momentum']
            for p in group['params']:
                if p.grad is None:
                    continue
                state = self.state[p]
                if 'momentum_buffer' not in state:
                    state['momentum_buffer'] = torch.zeros_like(p.grad)  # sharded like the gradient
                buf = state['momentum_buffer']
                buf.lerp_(p.grad, 1 - mu)  # elementwise: on the local shard
                update = p.grad.lerp(buf, mu) if group['nesterov'] else buf
                if isinstance(update, DTensor):  # gather the matrix, orthogonalise, keep our rows
                    full = orthogonalise(update.full_tensor(), group)
                    ortho = distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)
                else:
                    ortho = orthogonalise(update, group)
                p.mul_(1 - group['lr'] * group['weight_decay'])  # decoupled decay with the plain lr
                p.add_(ortho, alpha=-adjust_lr(group['lr'], p.shape))  # (A, B): the global shape
        return None


def clip_grad_norm(optimizers, max_norm):
    """torch's clip_grad_norm_ over the optimizers' parameters, in place; the global norm before the
    clip as a float (NaN or inf as found). Under FSDP2 the gradients are sharded DTensors: the norm
    is of all ranks' shards (a collective), the value of its full tensor."""
    params = [p for o in optimizers for g in o.param_groups for p in g['params']]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


def zero_grad(optimizers):
    """Free the gradients through the optimizers' own (sharded) tensors. Never model.zero_grad() under
    FSDP2: after a no-grad forward the root unit stays unsharded (docs/method.md section 12.2), its
    parameters() are then the unsharded copies, and their .grad is cleared while the sharded gradients
    the optimizer reads keep accumulating over iterations."""
    for o in optimizers:
        o.zero_grad(set_to_none=True)


def build(model, kind, lr, weight_decay):
    """A list of torch optimizers over the model's trainable parameters (call after FSDP sharding)."""
    if kind not in KINDS:
        raise SystemExit(f'optimizer must be one of {KINDS}, got {kind!r}')
    reshard(model)  # the sharded parameters, even after a forward (see zero_grad)
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == 'adamw':
        return [torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)]
    matrices = [p for p in params if p.ndim == 2]
    rest = [p for p in params if p.ndim != 2]  # biases, norm gains; >2-D kernels (see the docstring)
    out = [Muon(matrices, lr=lr, weight_decay=weight_decay, momentum=MOMENTUM, nesterov=True,
                adjust_lr_fn=ADJUST_LR)] if matrices else []
    if rest:
        out.append(torch.optim.AdamW(rest, lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=weight_decay))
    return out
