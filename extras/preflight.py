"""
Every path a run will read, checked before anything loads: the model directory, the reward's folders
(videoalign_dir and qwen_dir when reward_model='videoalign'), the watchers' (clip_dir, pickscore_dir
when eval_metrics names them) and the prompt files. A missing one is a line naming it and the command
that fetches it (the README's `hf download ...`); all of them at once, before the prompt encoding and
the 8.3B load and broadcast (5-10 minutes of 8 GPUs each, were a folder found missing only after them).

    missing(config) -> ['<setting> <path>: <file> not found; get it with: hf download ...', ...]
    check(config)   # collective: every rank stops with the same lines if any rank misses a path

What is checked is the file each loader opens first (model_index.json, VideoReward's model_config.json
and checkpoint-*/model.pth, the config.json of Qwen2-VL, CLIP and PickScore, CLIP's
preprocessor_config.json): a folder left by an interrupted download is caught too, a truncated weight
file only by its loader.

Tested by: python -m pytest tests/test_launch_second.py
"""
import glob
import os

import torch.distributed as dist

from extras import metrics
from models import DEFAULT, load_family
from models import videoalign

GET_MODEL = 'hf download {} --local-dir {}'  # the model: its family's HUB_ID (models/<family>.py)
LOCAL = 'weights/HunyuanVideo-1.5-480p_t2v'  # where the README puts it


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


def check(config):
    """Collective: stop every rank with one line per missing path (any rank's: a node whose copy of
    the weights is incomplete stops the run, not only itself, so no rank waits in a collective)."""
    lines = missing(config)
    if dist.is_initialized():
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, lines)
        lines = list(dict.fromkeys(line for rank_lines in seen for line in rank_lines))  # each once
    if lines:
        raise SystemExit('missing before anything loaded:\n  ' + '\n  '.join(lines))
