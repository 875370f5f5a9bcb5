"""
Prompt segments of a long video, as LongLive's interactive mode and KVPO's released long setting use them
(docs/kvpo.md section 1): the prompt switches at given latent frames (released: 39, 75, 111 of 147, chunk
starts, so 4 segments); at a switch the KV cache's text keys and values are replaced by the new prompt's,
and the global reward scores one clip centred in each segment, with that segment's prompt:

    segments  [0, s_1), [s_1, s_2), ..., [s_n, F)
    clip_j    global_clip frames centred at (a_j + b_j) // 2, shifted to lie inside [0, F)
    r_global  = mean_j r(clip_j, prompt_j)   (per reward component)

With no switch this is one segment, and the one global clip is the video's middle (the toy's setting).
At a switch, as released (diversity_sampling.py's recache_after_switch), the last `window` (12) frames'
self-attention keys and values are also recomputed under the new prompt from their clean latents
(streaming.recache); without it (kvpo/train.py switch_recache=False) only the text keys change. A prompt file
holds a video's prompts on one line, as KVPO's does: `n,[prompt 1],[prompt 2],[prompt 3],[prompt 4]` (stories).
Where this differs from the released code: the clips are placed on latent frames (released: on decoded
video frames, the same centres to within a latent frame). A world whose later prompts only continue the first
(streaming/toy_story.py: "it turns up") scores the whole video against the whole story instead (its family's
story_score). Held-out stories (evaluate): each video of a story file generated unrouted, scored the same way.
Tested by: python -m pytest tests/test_kvpo_release.py
"""
import re

import torch

import reward
import streaming


def bounds(frames, switches):
    """[(start, end)] of each prompt segment of a video of `frames` latent frames switching at `switches`."""
    edges = [0] + [s for s in switches if 0 < s < frames] + [frames]
    return list(zip(edges, edges[1:]))


def segment_of(frame, switches):
    """The index of the segment holding latent frame `frame`."""
    return sum(frame >= s for s in switches)


def global_clips(frames, switches, clip):
    """[(lo, hi)] of the global reward: `clip` frames centred in each segment, kept inside [0, frames)."""
    out = []
    for a, b in bounds(frames, switches):
        lo = max(0, (a + b) // 2 - clip // 2)
        hi = min(frames, lo + clip)
        out.append((max(0, hi - clip), hi))
    return out


def scored_clips(frames, switches, clip, prompts, fork, chunk):
    """{'local': [(a, b, prompt)], 'global': [(lo, hi, prompt), ...]}: the fork's chunk (a, b) with the
    prompt of the fork's segment, and each segment's global clip with that segment's prompt."""
    return {'local': [(*chunk, prompts[segment_of(fork, switches)])],
            'global': [(lo, hi, p) for (lo, hi), p in zip(global_clips(frames, switches, clip), prompts)]}


def text_at(context, start):
    """(text, switch) of the block starting at `start`: context is one text tensor (one segment) or
    [(first frame, text), ...] in order; switch: a segment after the first begins at `start`."""
    if torch.is_tensor(context):
        return context, False
    first, text = [(a, t) for a, t in context if a <= start][-1]
    return text, first == start and first > 0


def stories(lines, n):
    """Each line's n prompts, as KVPO's release reads its prompt file: a line `[p1],[p2],...` (an index and a
    comma may lead) is one video's prompt segments, truncated to n; a line with fewer is skipped; a line
    without brackets is one prompt. One SystemExit if no line has n."""
    out = []
    for line in lines:
        fields = [f.strip() for f in re.findall(r'\[([^\[\]]*)\]', line) if f.strip()] or [line.strip()]
        if len(fields) >= n:
            out.append(fields[:n])
    if not out:
        raise SystemExit(f'no prompt line holds {n} prompts (one video\'s segments a line: "0,[p1],[p2],...", as '
                         f'KVPO\'s prompt file); prompt_story=False draws each segment\'s prompt from the lines')
    return out


@torch.no_grad()
def switch(net, cache, text, start, past=None):
    """A prompt switch at frame `start`: the cache's text keys replaced by `text`'s (recache_text); past, the
    clean latents (1, C, m, h, w) of the frames up to start (None: the text keys alone): its last `window`
    frames' self-attention keys and values recomputed under the new prompt (streaming.recache), as released."""
    recache_text(net, cache, text)
    n = 0 if past is None else min(cache.layout['window'] or start, start, past.shape[2])  # released: min(12, start)
    if n:
        streaming.recache(net, past[:, :, past.shape[2] - n:], text, cache, start - n)


@torch.no_grad()
def recache_text(net, cache, text):
    """Replace the cache's text keys and values (every layer's cross-attention) by those of `text`, without
    gradient, as a forward computes them (diffusers' text embedder, then streaming.StreamCross's projections):
    a new segment's prompt, read by every later block."""
    e = net.condition_embedder.text_embedder(text)  # (B, L, inner dim): what the blocks' cross-attention reads
    cache.text = {i: (b.attn2.norm_k(b.attn2.to_k(e)).unflatten(2, (b.attn2.heads, -1)),  # (B, L, H, D)
                      b.attn2.to_v(e).unflatten(2, (b.attn2.heads, -1))) for i, b in enumerate(net.blocks)}


@torch.no_grad()
def score_video(clips, prompts, switches, clip, decode, reward_fn, fps, story=None):
    """{component: (B,)} of B videos' latents (B, C, F, h, w) of one story (`prompts`, one a segment): the mean
    over the segments' global clips, each with its segment's prompt; story (a family's story_score): the whole
    video against the whole story."""
    if story is not None:
        sc = [story(decode(clips), [list(prompts)] * len(clips), fps)]
    else:
        sc = [reward_fn(decode(clips[:, :, lo:hi]), [p] * len(clips), fps)
              for (lo, hi), p in zip(global_clips(clips.shape[2], switches, clip), prompts)]
    return {k: torch.stack([c[k].float().cpu() for c in sc]).mean(0) for k in reward.DIMS}


@torch.no_grad()
def generate(net, noise, texts, switches, gens=None, recache=False):
    """Latents (B, C, F, h, w) of a story from noise (B, C, F, h, w), block by block (streaming.generate, one
    cache), texts one (B, L, D) a segment, switched at each segment's first frame (switch; recache: the last
    window re-cached under the new prompt, as released)."""
    cache, out = streaming.KVCache(net.layout), []
    for j, (a, b) in enumerate(bounds(noise.shape[2], switches)):
        if j:
            switch(net, cache, texts[j], a, torch.cat(out, 2) if recache else None)
        out.append(streaming.generate(net, noise[:, :, a:b], texts[j], gens, cache=cache))
    return torch.cat(out, 2)


@torch.no_grad()
def evaluate(net, stories, text, shape, switches, score, weights, manifold_distance, decode, seed, rank, world,
             device, recache=False):
    """The held-out stories: story i (rank i % world's) generated unrouted from the noise of (seed, i), scored
    by score(latents, prompts) (score_video's); {'story_<component>', 'story_composite' (at weights),
    'story_manifold'}: means over every rank's stories."""
    from models.policy import generators, noise, seed_of
    rows = []
    for i in range(rank, len(stories), world):
        gens = generators([seed_of(seed, 'eval-story', i)])
        x = generate(net, noise(shape, gens, device), [text(p) for p in stories[i]], switches, gens, recache)
        sc = score(x, stories[i])
        row = {k: v[0].item() for k, v in sc.items()} | dict(composite=reward.combine(sc, weights)[0].item())
        if manifold_distance is not None:
            row['manifold'] = manifold_distance(decode(x))[0].item()
        rows.append(row)
    from infra.parallel import mean_of
    keys = [*reward.DIMS, 'composite'] + (['manifold'] if manifold_distance is not None else [])
    return {f'story_{k}': mean_of([r[k] for r in rows], device) for k in keys}  # every rank the same keys
