"""
Prompt segments of a long video, as LongLive's interactive mode and KVPO's released long setting use them
(docs/kvpo.md section 1): the prompt switches at given latent frames (released: 39, 75, 111 of 147, chunk
starts, so 4 segments); at a switch the KV cache's text keys and values are replaced by the new prompt's,
and the global reward scores one clip centred in each segment, with that segment's prompt:

    segments  [0, s_1), [s_1, s_2), ..., [s_n, F)
    clip_j    global_clip frames centred at (a_j + b_j) // 2, shifted to lie inside [0, F)
    r_global  = mean_j r(clip_j, prompt_j)   (per reward component)

With no switch this is one segment, and the one global clip is the video's middle (the toy's setting).
Where this differs from the released code: the clips are placed on latent frames (released: on decoded
video frames, the same centres to within a latent frame); the self-attention keys of the last window of
frames are not recomputed under the new prompt (LongLive's re-cache does that): only the text keys change.
Tested by: python -m pytest tests/test_kvpo_release.py
"""
import torch


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


@torch.no_grad()
def recache_text(net, cache, text):
    """Replace the cache's text keys and values (every layer's cross-attention) by those of `text`, without
    gradient, as a forward computes them (diffusers' text embedder, then streaming.StreamCross's projections):
    a new segment's prompt, read by every later block."""
    e = net.condition_embedder.text_embedder(text)  # (B, L, inner dim): what the blocks' cross-attention reads
    cache.text = {i: (b.attn2.norm_k(b.attn2.to_k(e)).unflatten(2, (b.attn2.heads, -1)),  # (B, L, H, D)
                      b.attn2.to_v(e).unflatten(2, (b.attn2.heads, -1))) for i, b in enumerate(net.blocks)}
