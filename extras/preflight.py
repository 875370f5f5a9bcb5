"""
Every path a run will read, checked before anything loads: the model directory, the reward's folders
(videoalign_dir and qwen_dir when reward_model='videoalign'), the watchers' (clip_dir, pickscore_dir
when eval_metrics names them) and the prompt files. A missing one is a line naming it and the command
that fetches it (the README's `hf download ...`); all of them at once, before the prompt encoding and
the 8.3B load and broadcast (5-10 minutes of 8 GPUs each, were a folder found missing only after them).
Then the disk: out_dir must have room for keep_checkpoints checkpoints and the one being written, at the
model's size (133 GB each at 8.3B: a full disk would otherwise stop every rank at the first save, 30-45
minutes in). And the reward, loaded and scoring one clip before the policy loads (reward_first).

    missing(config) -> ['<setting> <path>: <file> not found; get it with: hf download ...', ...]
    disk(config)    -> ["out_dir 'out': 3 checkpoints of 133 GB need 400 GB, 212 GB free ..."] or []
    check(config)   # collective: every rank stops with the same lines if any rank misses a path or room
    reward_fn, manifold_distance = reward_first(config, device, family)   # collective too

What is checked is the file each loader opens first (model_index.json, VideoReward's model_config.json
and checkpoint-*/model.pth, the config.json of Qwen2-VL, CLIP and PickScore, CLIP's
preprocessor_config.json): a folder left by an interrupted download is caught too, a truncated weight
file only by its loader.

Tested by: python -m pytest tests/test_launch_second.py tests/test_preflight_room.py
"""
import glob
import os
import shutil
import traceback

import torch
import torch.distributed as dist

from extras import metrics
from infra import checkpoint, parallel, prompt_cache, rundir, sp
from infra.versions import check as check_versions
from models import DEFAULT, family, load_family
from models import videoalign
from models.policy import latent_shape, load_decoder, transformer_config

GET_MODEL = 'hf download {} --local-dir {}'  # the model: its family's HUB_ID (models/<family>.py)
LOCAL = 'weights/HunyuanVideo-1.5-480p_t2v'  # where the README puts it
# a checkpoint's bytes per trained parameter: fp32 weights 4, optimizer state 8 at most (AdamW's two
# moments; Muon's momentum 4), the anchor 4 (results/README.md: 16.0 as written, 133 GB at 8.3B)
BYTES_A_PARAM = 16


def missing(config):
    """One line per path of `config` (train.py's settings) that the run would fail to read."""
    c, out = config, []

    def need(setting, path, files, how):
        # files: relative names (a glob pattern allowed), the first absent one is named
        for f in files:
            if not glob.glob(os.path.join(glob.escape(path), f)):
                out.append(f'{setting} {path!r}: {f} not found; get it with: {how}')
                return
    hub = load_family(DEFAULT).HUB_ID
    need('model', c['model'], ['model_index.json'], GET_MODEL.format(hub, c['model']) if c['model'] != hub else
         GET_MODEL.format(hub, LOCAL) + f' and pass --model={LOCAL}')  # the default names the hub, not a folder
    if c['reward_model'] == 'videoalign':
        how = videoalign.GET_CKPT.format(c['videoalign_dir'])
        need('videoalign_dir', c['videoalign_dir'], ['model_config.json', 'checkpoint-*/model.pth'], how)
        need('qwen_dir', c['qwen_dir'], ['config.json'], videoalign.GET_QWEN.format(c['qwen_dir']))
    names = [n.strip() for n in c['eval_metrics'].split(',')] if c['eval_metrics'] else []
    if 'clipscore' in names:
        need('clip_dir', c['clip_dir'], ['config.json', 'preprocessor_config.json'],
             metrics.GET_CLIP.format(c['clip_dir']))
    if 'pickscore' in names:
        need('pickscore_dir', c['pickscore_dir'], ['config.json'], metrics.GET_PICK.format(c['pickscore_dir']))
    for setting in ('train_prompts', 'eval_prompts'):
        if not os.path.isfile(c[setting]):
            out.append(f'{setting} {c[setting]!r} not found (a prompt a line, or a CSV with a prompt column)')
    return out


def trained_params(config):
    """The parameters a checkpoint of this run holds, counted on the meta device (no weight read):
    every trainable weight of the transformer, or with lora_rank r the adapters, r x (in + out) for each
    linear layer LoRA adapts (the frozen base is not saved: infra/checkpoint.py)."""
    fam = family(config['model'])
    net = fam.load_transformer(config['model'], meta=True)
    r = config.get('lora_rank', 0)
    if not r:
        return sum(p.numel() for p in net.parameters() if p.requires_grad)
    adapted = lambda name: any(name == t or name.endswith('.' + t) for t in fam.LORA_TARGETS)  # noqa: E731
    return sum(r * (m.in_features + m.out_features) for name, m in net.named_modules()
               if isinstance(m, torch.nn.Linear) and adapted(name))


def disk(config):
    """One line if out_dir's file system cannot hold keep_checkpoints checkpoints plus the one being
    written (a save writes a temporary beside the kept ones and rotates only after publishing it); the
    checkpoints out_dir already holds count as written. [] if it can."""
    out_dir, keep = config['out_dir'], config['keep_checkpoints']
    size = BYTES_A_PARAM * trained_params(config)
    held = min(len(checkpoint.found(out_dir)), keep)  # a resumed run's: on the disk already
    need = (keep + 1 - held) * size
    where = os.path.abspath(out_dir)
    while not os.path.exists(where):  # out_dir not made yet: the file system it will be made on
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    if free >= need:
        return []
    return [f'out_dir {out_dir!r}: {keep} kept checkpoints + 1 being written, {human(size)} each, need '
            f'{human(need)} more; {human(free)} free (free space, or lower keep_checkpoints)']


def human(n):
    return f'{n / 1e9:.3g} GB' if n >= 1e9 else f'{n / 1e6:.3g} MB'


def check(config):
    """Collective: stop every rank with one line per missing path (any rank's: a node whose copy of
    the weights is incomplete stops the run, not only itself, so no rank waits in a collective); with
    every path there, one line if out_dir lacks room for the checkpoints (a config without out_dir
    writes none)."""
    lines = missing(config)
    if not lines and 'out_dir' in config:
        lines = disk(config)
    stop_all(lines, 'before anything loaded')


def start(config, master, log=print):
    """Everything checked before anything loads, in order: every rank sees rank 0's out_dir (or all
    stop), sp_size divides the heads and the video tokens, diffusers and transformers within the tested range (one line if not), out_dir locked and
    the run it holds claimed (rundir.claim: its checkpoints, newest first, and its history), every
    path the run reads and the disk its checkpoints need (check). Returns claim()'s (ckpts, history)."""
    parallel.check_shared(config['out_dir'], 'out_dir', master)
    if config.get('sp_size', 1) > 1:  # the heads and the video tokens split over sp
        c = config
        sp.check(c['sp_size'], transformer_config(c['model']),
                 latent_shape(c['model'], c['num_frames'], c['height'], c['width']))
    check_versions(log)
    claimed = rundir.claim(config, master, log=log)
    check(config)
    return claimed


def stop_all(lines, when):
    """Every rank stops with every rank's lines (each once) if any rank has one (collective)."""
    if dist.is_initialized():
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, lines)
        lines = list(dict.fromkeys(line for rank_lines in seen for line in rank_lines))  # each once
    if lines:
        raise SystemExit(f'stopped {when}:\n  ' + '\n  '.join(lines))


def reward_first(config, device, fam=None, decode=None):
    """(reward_fn, manifold_distance) of config's reward_model (videoalign.load_reward), once it has scored
    one clip of the run's size (random latents decoded, the first training prompt): called before the
    policy loads, a reward whose weights, keys or dtype fail stops the run in seconds instead of after
    the 8.3B load. Collective: a rank whose reward raises stops every rank, with its line. A non-finite
    score is one warning line, not a stop: a clip the reward cannot score is the method's NaN reward
    (it leaves its group), and a reward that scores every clip NaN stops the run at its first
    iteration, before any weight moves (reward.check_valid)."""
    c, line, loaded = config, [], (None, None)
    try:
        loaded = videoalign.load_reward(c['reward_model'], c['videoalign_dir'], c['qwen_dir'], device, family=fam)
        shape = latent_shape(c['model'], c['num_frames'], c['height'], c['width'])  # the run's clip:
        latents = torch.randn(1, *shape, generator=torch.Generator().manual_seed(0)).to(device)
        frames = (decode or load_decoder(c['model'], device))(latents)  # (1, F, 3, H, W): the run's decoder
        prompt = prompt_cache.read_prompts(c['train_prompts'])[0][0]
        scores = loaded[0](frames, [prompt], c['fps'])
        bad = {k: v.tolist() for k, v in scores.items() if torch.is_tensor(v) and not torch.isfinite(v).all()}
        if bad:
            print(f'warning: reward_model {c["reward_model"]!r} scored a random {c["num_frames"]}x{c["height"]}x'
                  f'{c["width"]} clip non-finite: {bad}', flush=True)
    except Exception as e:  # the traceback on this rank's log; one line on every rank
        traceback.print_exc()
        line = [f'reward_model {c["reward_model"]!r} (videoalign_dir {c["videoalign_dir"]!r}, qwen_dir '
                f'{c["qwen_dir"]!r}) failed to load or score one clip: {type(e).__name__}: {str(e)[:300]}']
    stop_all(line, 'before the policy loaded')
    return loaded
