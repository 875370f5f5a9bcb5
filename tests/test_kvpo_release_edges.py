"""
KVPO's released choices at the edges the toy's settings never reach (kvpo/), each against a reference written
here. python -m pytest tests/test_kvpo_release_edges.py
- the release's routing reads (router's release_reads) at every block a fork could take, for two cache sizes,
  against a brute-force emulation of its ring buffer: a fork whose block just fills the cache reads what it
  planned (the cache has not rolled), the next one reads a block later;
- the global reward's clips: every segment's clip has global_clip frames inside the video, centred in its
  segment as far as the video's ends allow (a last segment shorter than a clip: the clip ends at the video's end);
- the checkpoint's own LoRA at the index's lora_alpha (not the rank): the forward equals the base weights plus
  alpha / r B A merged here;
- the gradient replay writes its cache as the rollout did: with context noise and a prompt switch inside a
  4-block span, backward's gradient (one branch at a time) equals autograd's through kvpo.scores, and a branch
  routed as the window replays to a TVE of 0 with a zero gradient (theta == theta_old: nothing to move);
- kvpo.train run as a user runs it (the distilled toy, 2 videos an iteration, 2 iterations): the shuffled control
  draws its own permutation for every video (iteration and video), and constant_with_warmup's learning rate
  is diffusers' own schedule stepped every old_every rollouts (logged lr: the first window of 2 rollouts at 0);
  GRPO-SDE's control beside it (kvpo/grpo_ar.py, its advantages phase): each group its own permutation of its
  own advantages, by iteration and prompt.
"""
import json
import os
import runpy
import sys

import pytest
import torch

from kvpo import kvpo, optim, segments
import streaming
from streaming import toy_ar

sys.path.insert(0, os.path.dirname(__file__))
from test_kvpo import SHAPE, text, tiny  # noqa: E402
from test_train import metrics  # noqa: E402

STUDENT = ('--model=assets/toy_story', '--context_noise=0.0')  # the story toy's streaming student, 9-frame clips


# ----------------------------------------------------------------------------- the release's routing reads
def ring_buffer_reads(fork, older, keep, sink=3, block=3, m=4):
    """What the released code reads for planned frames `older` at the fork block (as tests/test_kvpo_release.py's
    emulation): a ring buffer of keep frames (the sink pinned, then the newest keep - sink, the block itself
    inserted before attention); each frame's slot sink + (f - visible start), visible start = max(sink, the
    block's start - the non-sink frames up to the buffer's end); the frame that slot holds."""
    end = fork + block
    slots = list(range(sink)) + list(range(max(sink, end - (keep - sink)), end))  # slot -> frame
    start = max(sink, fork - (len(slots) - sink))
    return [slots[sink + f - start] if start <= f < fork - m else None for f in older]


class Frames:
    def __init__(self, frames):
        self.frames = frames


@pytest.mark.parametrize('keep', [33, 24])
def test_release_reads_at_every_fork_against_its_ring_buffer(keep):
    L = streaming.LAYOUT  # block 3, sink 3, window 12; m 4, P 5
    shifted = []
    for fork in range(12, 67, 3):
        cached = Frames(list(range(3)) + list(range(max(3, fork + 3 - (keep - 3)), fork)))  # at the fork block
        older = [f for f in kvpo.pool(fork, L, 4, 5, keep) if ring_buffer_reads(fork, [f], keep) != [None]][:5]
        if not older:
            continue
        got = kvpo.router(fork, older, L, 4, 5, keep, True)(cached, fork, fork + 3)[3:3 + len(older)]
        assert got == ring_buffer_reads(fork, older, keep), (fork, older, got)
        assert kvpo.router(fork, older, L, 4, 5, keep, False)(cached, fork, fork + 3)[3:3 + len(older)] == older
        shifted += [fork] if got != older else []
    assert shifted and min(shifted) == keep  # the first fork whose block rolls the cache: fork + 3 > keep


# ----------------------------------------------------------------------------- the global clips
@pytest.mark.parametrize('frames, switches, clip', [
    (147, (39, 75, 111), 9), (147, (39, 75, 141), 9), (147, (4, 75, 143), 9), (40, (), 9), (30, (27,), 12),
    (9, (), 9), (20, (2, 18), 5)])
def test_every_global_clip_is_whole_inside_the_video_and_centred(frames, switches, clip):
    edges = [0, *switches, frames]
    got = segments.global_clips(frames, switches, clip)
    assert len(got) == len(edges) - 1
    for (lo, hi), a, b in zip(got, edges, edges[1:]):
        want = min(max(0, (a + b) // 2 - clip // 2), frames - clip)  # centred, then moved inside [0, frames)
        assert (lo, hi) == (want, want + clip), ((a, b), (lo, hi), want)


# ----------------------------------------------------------------------------- the checkpoint's LoRA alpha
def test_checkpoint_lora_scaled_by_the_index_lora_alpha(tmp_path):
    from diffusers import WanTransformer3DModel
    from streaming import wan_causal
    from tiny_wan_causal import make_tiny_causal, original_name
    root, r, alpha = str(tmp_path), 8, 2.0
    path, sd = make_tiny_causal(root)
    g, file, merged = torch.Generator().manual_seed(0), {}, dict(sd)
    for k, w in sd.items():
        if k.endswith('.weight') and w.dim() == 2 and k.startswith('blocks.'):  # the blocks' 10 Linear each
            A, B = 0.2 * torch.randn(r, w.shape[1], generator=g), 0.2 * torch.randn(w.shape[0], r, generator=g)
            merged[k] = w + alpha / r * B @ A
            for part, t in (('lora_A', A), ('lora_B', B)):
                file[f'base_model.model.{original_name(k)[:-len(".weight")]}.{part}.weight'] = t
    torch.save({'generator_lora': file}, os.path.join(root, 'lora.pt'))
    index = os.path.join(path, 'model_index.json')
    json.dump({**json.load(open(index)), 'lora': os.path.join(root, 'lora.pt'), 'lora_alpha': alpha}, open(index, 'w'))
    net = optim.load_generator(path, 'cpu', r, 'checkpoint', 'float32')
    ref = wan_causal.build(WanTransformer3DModel.load_config(wan_causal._index(path)['wan'], subfolder='transformer'),
                           net.layout)
    ref.load_state_dict(merged, assign=True)
    gen = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(1, 16, 3, 4, 4, generator=gen), torch.randn(1, 5, 16, generator=gen)
    with torch.no_grad():
        v, want = (streaming.forward_masked(n.eval(), x, torch.full((1, 3), 0.7), ctx, range(3),
                                            torch.ones(3, 3, dtype=torch.bool)) for n in (net, ref))
    assert (v - want).abs().max() < 1e-4 * want.abs().max(), (v - want).abs().max()


# ----------------------------------------------------------------------------- the gradient replay
def test_the_gradient_replay_writes_and_switches_as_the_rollout():
    """Context noise 0.05 and a switch at frame 7 inside the span [5, 9): 4 recorded blocks a branch."""
    net, c0, c1 = tiny(toy_ar.LAYOUT, 1), text(1), text(2)
    ctx, fork = [(0, c0), (7, c1)], 5
    routing = dict(fork=fork, older=[[3, 4], [1, 2], [1, 3]])  # branch 0 routed as the window: the anchor
    _, traj, state = kvpo.rollout(net, ctx, 9, SHAPE, routing, 1, 1, 1, 9, span_end=9, context_noise=0.05)
    assert traj['x'].shape[1] == 4
    params = [p for p in net.parameters() if p.requires_grad]
    grads = lambda: [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]  # noqa: E731
    w = torch.tensor([0.7, -1.3, 0.4])
    objective = lambda s: ((w * s).sum(), {})  # noqa: E731
    net.zero_grad()
    s = kvpo.scores(net, ctx, state, fork, traj, 9, grad_steps=2)
    assert abs(s[0].item()) < 1e-10 and (s[1:] < -1e-6).all()  # theta_old: the anchor's replay is the rollout
    objective(s)[0].backward()
    want = grads()
    net.zero_grad()
    kvpo.backward(net, ctx, state, fork, traj, 9, objective, grad_steps=2)
    got = grads()
    norm = sum(a.square().sum() for a in want).sqrt()
    assert norm > 0 and sum((a - b).square().sum() for a, b in zip(got, want)).sqrt() < 1e-5 * norm
    net.zero_grad()  # the anchor-like branch alone: s_0 is at its maximum 0, so its gradient is 0
    kvpo.backward(net, ctx, state, fork, {k: v[:1] if torch.is_tensor(v) and k in ('x', 'x0') else v
                                          for k, v in traj.items()}, 9, lambda s: (s.sum(), {}), grad_steps=2)
    assert sum(a.abs().sum() for a in grads()) < 1e-9 * norm


# ----------------------------------------------------------------------------- the loop's control and schedule
def test_kvpo_train_shuffles_each_video_and_steps_the_schedule_every_old_every(tmp_path, monkeypatch):
    """The fused advantages replaced by 0..K-1 (what the loss then receives is the permutation itself);
    --adv_shuffle, 2 videos an iteration, 2 iterations, warm-up 1 step of old_every 2 rollouts: lr 0 in both
    (a schedule stepped every rollout would have reached its full lr at the second)."""
    from diffusers.optimization import get_constant_schedule_with_warmup
    seen, loss = [], kvpo.loss

    def recording(s, s_old, s_init, adv, safe, *a, **k):
        seen.append(adv.tolist())
        return loss(s, s_old, s_init, adv, safe, *a, **k)
    monkeypatch.setattr(kvpo, 'loss', recording)
    monkeypatch.setattr(kvpo, 'fuse', lambda a_local, *a, **k: torch.arange(float(len(a_local))))
    out = str(tmp_path / 'run')
    monkeypatch.setattr(sys, 'argv', [
        'kvpo.train', 'kvpo/config/toy.py', *STUDENT, '--prompts_per_iter=2', '--max_iters=2',
        '--eval_every=0', '--save_every=0', f'--out_dir={out}', '--adv_shuffle=True', '--old_every=2', '--warmup=1',
        '--lr_schedule=constant_with_warmup', '--learning_rate=1e-4'])
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runpy.run_module('kvpo.train', run_name='__main__')
    K = len(seen[0])
    assert len(seen) == 4 and all(sorted(p) == list(range(K)) for p in seen), seen  # 2 videos x 2 iterations
    assert len({tuple(p) for p in seen}) == 4, seen  # every video its own draw (K = 6: 720 permutations)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-4)
    sched, want = get_constant_schedule_with_warmup(opt, num_warmup_steps=1), []
    for it in range(2):
        want.append(opt.param_groups[0]['lr'])
        if it % 2 == 1:  # the released trainer steps its scheduler once per old_every rollouts
            opt.step()
            sched.step()
    assert [r['lr'] for r in metrics(out) if 'loss' in r] == pytest.approx(want, abs=1e-12)


def test_grpo_ar_shuffles_each_group_with_its_own_draw(tmp_path):
    from test_kvpo_edges import setup
    import reward
    G = setup('kvpo.grpo_ar', ['kvpo/config/grpo_toy.py', '--prompts_per_iter=1', '--group=6', '--adv_shuffle=True'],
              str(tmp_path / 'run'))
    sc = {k: torch.linspace(0, 1, 6) ** (i + 1) for i, k in enumerate(reward.DIMS)}  # distinct composites
    real = reward.group_advantages(reward.combine(sc, G['reward_weights'])[None], G['adv_clip'])[0][0]
    assert len(set(real.tolist())) == 6
    perms = []
    for it, j in ((0, 0), (0, 1), (1, 0), (1, 1)):
        adv = G['advantages'](sc, it, j)[0].cpu()
        perm = [real.tolist().index(a) for a in adv.tolist()]  # where each of the real advantages went
        assert sorted(perm) == list(range(6)), (it, j, adv, real)
        perms.append(tuple(perm))
    assert len(set(perms)) == 4, perms  # every (iteration, prompt) its own draw (720 permutations)
