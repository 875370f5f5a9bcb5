"""Sequence parallel (sp.py): a clip's tokens split over gloo ranks give the velocity, the gradient and
the pass counts of 1 process running diffusers' own attention processor, at sp 4 and at dp 2 x sp 2
(tests/sp_layout_worker.py, one torchrun launch of 4 ranks); train.py at sp 2 equals 1 process and
resumes across sp. python -m pytest tests/test_sp.py"""
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
from models.policy import load_transformer, velocity  # noqa: E402
from test_train import run_here  # noqa: E402
from tiny_hunyuan import make_tiny_hunyuan  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root


def text_batch(lengths, g):
    """batch_text's four tensors for prompts with (Qwen, ByT5) valid lengths, right-padded."""
    L1, L2 = max(a for a, _ in lengths), max(max(b, 1) for _, b in lengths)
    e1, e2 = torch.randn(len(lengths), L1, 16, generator=g), torch.randn(len(lengths), L2, 8, generator=g)
    m1 = torch.stack([torch.arange(L1) < a for a, _ in lengths]).float()  # (B, L1)
    m2 = torch.stack([torch.arange(L2) < b for _, b in lengths]).float()  # (B, L2); 0 valid: no quoted text
    return [e1 * m1[..., None], m1, e2 * m2[..., None], m2]


def test_sp4_and_dp2_sp2_equal_one_process(tmp_path):
    # one launch of 4 ranks, three layouts: sp 4 (one group) and dp 2 x sp 2 (rank // sp is the dp rank,
    # not rank % dp) with the default attention (its own all-to-all), and sp 4 with a mask on diffusers'
    # Ulysses (attention='diffusers', which cp_plan turns into masked keys), against one process with
    # diffusers' own attention processor (dense mask, no padding). A 4-head tiny transformer (Ulysses
    # splits heads); 48 video tokens
    from tiny_hunyuan import TINY
    path = make_tiny_hunyuan(tmp_path / 'tiny4', dict(TINY, transformer=dict(TINY['transformer'], num_attention_heads=4)))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 3, 4, 4, generator=g)  # (B, C, F, H, W): 48 video tokens
    inputs = dict(x=x, s=torch.tensor([0.9, 0.4]), cfg=6.0,
                  layouts=[(4, 'valid_tokens'), (2, 'valid_tokens'), (4, 'diffusers')],
                  text=text_batch([(5, 0), (2, 3)], g),       # mixed prompt lengths, one with ByT5 text:
                  text_neg=text_batch([(3, 0), (3, 0)], g),   # 5 + 3 + 1 image = 9 text tokens: sp 4 pads
                  w=torch.randn(x.shape, generator=g))        # -9 % 4 = 3 (9 % 4 = 1 would not split)
    torch.save(inputs, tmp_path / 'inputs.pt')
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT)
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=4',
           os.path.join(ROOT, 'tests', 'sp_layout_worker.py'), path, str(tmp_path / 'inputs.pt'), str(tmp_path / 'out.pt')]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f'rc {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}'
    got = torch.load(tmp_path / 'out.pt')

    from models import policy as M
    ref = load_transformer(path, attention='diffusers')
    M.PASSES[:] = [0, 0]
    v = velocity(ref, x, inputs['s'], inputs['text'], 6.0, inputs['text_neg'])
    (v * inputs['w']).sum().backward()
    passes = dict(rollout=0, update=0)
    M.count_passes(passes, ('rollout', 'update'))
    assert passes == dict(rollout=0, update=4)  # 2 clips x 2 CFG branches, with grad
    total = torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None]).norm()
    assert len(got) == 3
    for (n, kind), r in got.items():
        assert r['processors'] == {'ValidTokensAttention' if kind == 'valid_tokens' else 'MaskedKeysAttention'}
        # the split happened, in the forward and the checkpointed recomputation: rank 0's share of
        # its group's video + text, the text padded to a multiple of n
        T = 5 + 3 + 1  # Qwen and ByT5 as batch_text padded them for the whole batch, + the image token
        assert r['seen'] == [(48 + T + -T % n) // n] * 2, (n, kind, r['seen'])
        assert r['passes'] == passes, (n, kind, r['passes'])  # counted once per sp group
        assert (r['v'] - v.detach()).abs().max() <= 1e-5 * v.abs().max(), (n, kind, (r['v'] - v).abs().max())
        for k, p in ref.named_parameters():
            if k not in r['grads']:
                assert p.grad is None or not p.grad.any(), (n, kind, k)
                continue
            if p.grad.norm() < 1e-6 * total:  # mathematically 0 (the refiner's key bias shifts all of a
                continue                      # query's scores alike): rounding noise, no relative error
            err = (r['grads'][k] - p.grad).norm() / p.grad.norm()
            assert err <= 1e-5, (n, kind, k, err.item())
        # divide_work: 2n - 1 clips over each group, clip c by the group's sp rank c % n, all clips back
        for dp_rank, work in enumerate(r['work']):
            assert work['clip'].tolist() == list(range(2 * n - 1))
            assert work['rank'].tolist() == [dp_rank * n + c % n for c in range(2 * n - 1)], (n, dp_rank, work)


def test_train_sp2_equals_one_process_and_resumes_across_sp(tmp_path, monkeypatch):
    # the toy world with a 2-head transformer (assets/toy's has 3 heads, which Ulysses cannot split
    # in 2: train.py says so); random weights are enough to compare two runs
    import shutil
    from models import toy
    from diffusers import HunyuanVideo15Transformer3DModel
    evals = tmp_path / 'eval.txt'  # 2 held-out prompts: the evaluations at start and end stay cheap
    evals.write_text(''.join(open(os.path.join(ROOT, 'assets/toy/eval_prompts.txt')).readlines()[:2]))
    torch.manual_seed(0)
    HunyuanVideo15Transformer3DModel(**{**toy.CONFIG, 'num_attention_heads': 2}).save_pretrained(
        tmp_path / 'toy2' / 'transformer')
    for name in ('model_index.json', 'text_embeddings.safetensors'):  # the rest of the toy world
        shutil.copy(os.path.join(ROOT, 'assets/toy', name), tmp_path / 'toy2' / name)
    args = ['train.py', 'config/toy.py', f'--model={tmp_path / "toy2"}', '--prompts_per_iter=2', '--group_size=2',
            '--num_steps=4', '--rollout_batch=4', '--train_batch=2', '--eval_every=0', '--eval_samples=1',
            '--eval_videos=1', '--save_every=1', '--max_iters=3', '--export_dtype=', f'--eval_prompts={evals}',
            '--diag_every=1']  # the gradient-norm diagnostics of clip 0 are compared too
    env = dict(os.environ, OMP_NUM_THREADS='1', TOKENIZERS_PARALLELISM='false')
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2']

    def run(cmd, out, extra=()):  # one process: in this one (test_train.run_here)
        if cmd == [sys.executable]:
            return run_here(monkeypatch, args + [f'--out_dir={out}', *extra])
        p = subprocess.run(cmd + args + [f'--out_dir={out}', *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, f'{cmd}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}'

    one, two, back = tmp_path / 'sp1', tmp_path / 'sp2', tmp_path / 'sp2to1'
    run([sys.executable], one)
    run(torchrun, two, ['--sp_size=2'])                # 1 data-parallel group of 2 ranks
    os.makedirs(back)                                  # sp 2's iteration-2 checkpoint, resumed by 1 process
    shutil.copytree(two / 'ckpt_000002', back / 'ckpt_000002')
    (back / 'latest').write_text('ckpt_000002')
    args.append('--init_from=resume')
    run([sys.executable], back)

    from infra import checkpoint
    import json
    w = {d: checkpoint.read_tensors(str(d / 'ckpt_000003')) for d in (one, two, back)}
    init = HunyuanVideo15Transformer3DModel.from_pretrained(tmp_path / 'toy2' / 'transformer').state_dict()
    norm = lambda d: sum((t.double() ** 2).sum() for t in d.values()) ** 0.5
    moved = norm({k: w[one][k] - init[k] for k in w[one]}) / norm(w[one])
    for d in (two, back):
        rel = norm({k: w[d][k] - w[one][k] for k in w[one]}) / norm(w[one])
        assert rel <= 1e-5 and moved > 100 * rel, (d.name, rel.item(), moved.item())
    # the same rollouts scored the same: rewards and group statistics per iteration
    rows = {d: [json.loads(l) for l in open(d / 'metrics.jsonl') if '"reward"' in l] for d in (one, two)}
    assert [r['iter'] for r in rows[two]] == [1, 2, 3]
    for a, b in zip(rows[one], rows[two]):
        for k in ('reward', 'VQ', 'MQ', 'TA', 'group_std', 'loss', 'kl_pos', 'gnorm_first', 'gnorm_last'):
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), (a['iter'], k, a[k], b[k])
        # the transformer passes of an iteration are counted once per sp group, not once per rank
        assert {k: v for k, v in a.items() if k.startswith('passes_')} == \
            {k: v for k, v in b.items() if k.startswith('passes_')}, (a, b)
    assert rows[two][-1]['passes_update'] > 0
