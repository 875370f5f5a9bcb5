"""
Block-causal generation from a rolling KV cache, for any diffusers WanTransformer3DModel: the
self-forcing line of streaming video models (Self-Forcing, CausVid, LongLive, MemFlow, Reward Forcing)
run on diffusers' own modules. Used by streaming/wan_causal.py (Wan 2.1 1.3B, each released model's layout,
LAYOUTS) and streaming/toy_ar.py (the toy world, scaled down). docs/streaming.md explains it; in four lines:

    the clip is cut into blocks of `block` latent frames, generated one after another;
    a block's self-attention sees the `sink` first frames, the frames of the last `window - sink`
      (its own block included) and nothing later (window None: every earlier frame): cached keys/values,
      RoPE at absolute frame positions;
    a block is denoised in few steps (x0 = x_t - sigma v, then re-noised to the next sigma), and its
      clean x0 is written to the cache by one more forward at timestep 0; the text keys are cached once.

LAYOUTS holds the released models' layouts as their inference code samples them: LongLive (window 12, sink
3, 4 steps warped at shift 5), Self-Forcing (global causal attention, no sink, the same steps), CausVid
(global, steps 1000/757/522 unwarped: the model called at t, sigma the shift-8 grid's nearest point).
MemFlow's memory bank is not built (streaming/wan_causal.py refuses it).

Only the attention processors are new (StreamSelf, StreamCross): patch embedding, timestep and text
embedding, norms, feed-forward and output are diffusers' WanTransformer3DModel.forward itself, called once
per block and step (so FSDP2 and LoRA wrap it as they wrap the bidirectional Wan). forward_masked runs a
whole sequence of frames at once under a frame-level mask instead of the cache (teacher-forced training:
clean frames then noisy ones, streaming/toy_ar.py). recache runs cached frames once more under a new prompt
(LongLive's prompt switch, as KVPO releases it: kvpo/segments.py).

Tested by: python -m pytest tests/test_wan_causal.py tests/test_layouts.py (generation from the cache
equals one masked full forward of diffusers' stock model per block and step, inside the window and past
it, for each layout) tests/test_kvpo_release.py (the re-cache against one masked stock forward)
"""
import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

# The layouts of the released models on Wan 2.1 1.3B, as their own inference code samples them (docs/streaming.md
# section 1). window None: global causal attention (every earlier frame); max_frames: the latent frames its cache
# holds (None: any, the window rolls); warp: a step's sigma is t/1000 warped at the shift, the model called at
# 1000 sigma (False: the model is called at t itself, sigma the shift grid's point nearest t, CausVid's lookup).
# frames: the latent frames its released inference makes (LongLive's num_output_frames 120: 477 video frames).
LAYOUTS = {
    'longlive': dict(name='longlive', block=3, sink=3, window=12, max_frames=None, frames=120,
                     timesteps=(1000, 750, 500, 250), shift=5.0, warp=True, renoise='fresh'),
    'self_forcing': dict(name='self_forcing', block=3, sink=0, window=None, max_frames=21, frames=21,
                         timesteps=(1000, 750, 500, 250), shift=5.0, warp=True, renoise='fresh'),
    'causvid': dict(name='causvid', block=3, sink=0, window=None, max_frames=21, frames=21,
                    timesteps=(1000, 757, 522), shift=8.0, warp=False, renoise='fresh'),
}
LAYOUT = LAYOUTS['longlive']  # the default: block, sink, window, timesteps, shift, renoise ('ode': an Euler step)
GRID = 1000  # points of the released schedulers' shifted grid (linspace(1, 0, 1001)[:-1], shifted)


def _shift(layout, s):
    a = layout['shift']
    return a * s / (1 + (a - 1) * s)


def sigmas(layout):
    """The sampler's sigmas: warped, t / 1000 at the shift ((1000, 750, 500, 250) at shift 5 -> 1, 0.9375,
    0.8333, 0.625); not warped, the point of the shifted grid nearest t / 1000 (CausVid: 1, 0.7568, 0.5217)."""
    if layout.get('warp', True):
        return [_shift(layout, t / 1000) for t in layout['timesteps']]  # floats: no tensor op
    grid = [_shift(layout, 1 - i / GRID) for i in range(GRID)]
    return [min(grid, key=lambda g: abs(1000 * g - t)) for t in layout['timesteps']]


def model_times(layout):
    """The timesteps / 1000 the model is called at, step by step: its sigma (warped), or t / 1000 (not warped)."""
    return sigmas(layout) if layout.get('warp', True) else [t / 1000 for t in layout['timesteps']]


def visible_frames(cached, start, end, layout):
    """Absolute frames (sorted) of `cached` that a block of frames [start, end) attends to besides itself:
    the sink and the last window - sink frames up to the block's end (window None: every earlier frame)."""
    if layout['window'] is None:
        return [f for f in cached if f < start]
    lo = end - (layout['window'] - layout['sink'])
    return [f for f in cached if f < start and (f < layout['sink'] or f >= lo)]


class KVCache:
    """Per layer the self-attention keys and values of the finished frames, (B, n, T, H, D) with their
    absolute frame positions, and the text's cross-attention keys and values (computed once). Tensors
    are replaced, never written in place, so save() is a list of references and costs nothing.
    keep: frames held (None: the fewest the window needs, sink + window - sink - block; every frame for
    global attention); a router
    (KVPO) keeps more and sets `route(cache, start, end) -> frames` to choose what a block attends to."""

    def __init__(self, layout, keep=None):
        self.layout, self.route = layout, None
        self.keep = keep or (layout['window'] and layout['window'] - layout['block'])  # None: keep all
        self.k, self.v, self.pos, self.text = {}, {}, {}, {}  # by layer

    @property
    def frames(self):
        return list(self.pos.get(0, []))

    @property
    def end(self):
        """The frame after the newest cached one: where generation goes on."""
        return self.pos[0][-1] + 1 if self.pos.get(0) else 0

    def select(self, start, end):
        if self.route is not None:
            return self.route(self, start, end)
        return visible_frames(self.frames, start, end, self.layout)

    def read(self, layer, frames):
        """Keys and values (B, len(frames) * T, H, D) of frames, in their order."""
        if not frames:
            return None, None
        idx = torch.tensor([self.pos[layer].index(f) for f in frames], device=self.k[layer].device)
        return self.k[layer][:, idx].flatten(1, 2), self.v[layer][:, idx].flatten(1, 2)

    def write(self, layer, frames, k, v):
        """Append frames' keys and values k, v (B, len(frames) * T, H, D); drop all but the sink and the
        newest keep - sink frames."""
        k, v = (t.unflatten(1, (len(frames), -1)) for t in (k, v))  # (B, f, T, H, D)
        if layer in self.k:
            k, v = torch.cat([self.k[layer], k], 1), torch.cat([self.v[layer], v], 1)
        pos = self.pos.get(layer, []) + list(frames)
        if self.keep is None:  # global attention: nothing is dropped
            self.k[layer], self.v[layer], self.pos[layer] = k, v, pos
            return
        sink = sum(p < self.layout['sink'] for p in pos)
        idx = list(range(sink)) + list(range(max(sink, len(pos) - (self.keep - sink)), len(pos)))
        if len(idx) < len(pos):
            k, v, pos = k[:, idx], v[:, idx], [pos[i] for i in idx]
        self.k[layer], self.v[layer], self.pos[layer] = k, v, pos

    def save(self):
        return {name: dict(getattr(self, name)) for name in ('k', 'v', 'pos', 'text')}

    def restore(self, state):
        for name, d in state.items():
            setattr(self, name, dict(d))

    def read_frames(self, frames):
        """{layer: (k, v) (B, len(frames), T, H, D)}: the chosen frames of every layer."""
        idx = {l: [self.pos[l].index(f) for f in frames] for l in self.k}
        return {l: (self.k[l][:, i], self.v[l][:, i]) for l, i in idx.items()}

    def replace_frames(self, frames, kv):
        """Put kv = {layer: (k, v) (B, len(frames), T, H, D)} (read_frames' form) in place of those frames."""
        for l, (k, v) in kv.items():
            i = torch.tensor([self.pos[l].index(f) for f in frames], device=k.device)
            self.k[l], self.v[l] = self.k[l].index_copy(1, i, k), self.v[l].index_copy(1, i, v)

    def nbytes(self):
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values()) + \
            sum(t.numel() * t.element_size() for kv in self.text.values() for t in kv)


def rope_at(rope, frames, h, w):
    """diffusers' WanRotaryPosEmbed tables (cos, sin) (1, len(frames) h w, 1, D) for tokens of the given
    absolute frame positions (frame-major, then rows, columns): its forward for frames 0..F-1, generalised."""
    split = [rope.t_dim, rope.h_dim, rope.w_dim]
    f = torch.as_tensor(list(frames), device=rope.freqs_cos.device)
    out = []
    for table in (rope.freqs_cos, rope.freqs_sin):
        t, y, x = table.split(split, dim=1)
        n = len(f)
        out.append(torch.cat([t[f].view(n, 1, 1, -1).expand(n, h, w, -1), y[:h].view(1, h, 1, -1).expand(n, h, w, -1),
                              x[:w].view(1, 1, w, -1).expand(n, h, w, -1)], -1).reshape(1, n * h * w, 1, -1))
    return out


def _rotate(x, cos, sin):
    """RoPE on x (B, S, H, D) as WanAttnProcessor applies it (interleaved pairs)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2).type_as(x)


class Context:
    """What the processors read during one transformer call: the cache, the block's frames and the cached
    frames it sees, or (cache None) the mask of a whole masked sequence; the rope tables of its tokens."""
    cache, frames, visible, write, rope, mask = None, (), (), False, None, None
    text_mask = None  # a masked sequence of several prompt segments: (tokens, S L) which text each token reads
    rewrite = ()  # frames of `frames` whose new keys and values replace the cached ones (recache)


class StreamSelf:
    """Self-attention of layer `layer`: the block's queries against the cached frames it sees and its
    own keys (streaming), or a masked full sequence (ctx.cache None). diffusers' projections and norms."""
    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer, ctx, backend=None):
        self.layer, self.ctx, self._attention_backend = layer, ctx, backend

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        ctx = self.ctx
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)  # (B, S, H*D)
        q, k = attn.norm_q(q), attn.norm_k(k)  # RMS norm across heads, as WanAttnProcessor
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))  # (B, S, H, D)
        cos, sin = ctx.rope  # the tokens' absolute positions: diffusers' rotary_emb counts from 0
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values, mask = k, v, ctx.mask
        if ctx.cache is not None:
            ck, cv = ctx.cache.read(self.layer, ctx.visible)
            if ck is not None:
                keys, values = torch.cat([ck.to(k.dtype), k], 1), torch.cat([cv.to(v.dtype), v], 1)
            if ctx.write:  # after the read: the block attends to its own keys once
                ctx.cache.write(self.layer, ctx.frames, k, v)
            if ctx.rewrite:  # a re-cache: these frames' keys and values replace the cached ones (this layer's)
                i = [ctx.frames.index(f) for f in ctx.rewrite]
                ctx.cache.replace_frames(ctx.rewrite, {self.layer: tuple(t.unflatten(1, (len(ctx.frames), -1))[:, i]
                                                                         for t in (k, v))})  # (B, f, T, H, D)
        out = dispatch_attention_fn(q, keys, values, attn_mask=mask, backend=self._attention_backend)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


class StreamCross:
    """Cross-attention to the text, its keys and values computed once per cache (per prompt batch)."""
    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer, ctx, backend=None):
        self.layer, self.ctx, self._attention_backend = layer, ctx, backend

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        cache = self.ctx.cache
        if cache is not None and self.layer in cache.text:
            k, v = cache.text[self.layer]
        else:
            k = attn.norm_k(attn.to_k(encoder_hidden_states)).unflatten(2, (attn.heads, -1))  # (B, L, H, D)
            v = attn.to_v(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            if cache is not None:
                cache.text[self.layer] = (k, v)
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        tm = self.ctx.text_mask  # several segments' texts side by side: each token reads its own segment's
        out = dispatch_attention_fn(q, k.to(q.dtype), v.to(q.dtype), backend=self._attention_backend,
                                    attn_mask=None if tm is None else tm[None, None].to(q.device))
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def install(net, layout):
    """Make diffusers WanTransformer3DModel `net` block-causal: its attention processors replaced (the
    dispatcher backend kept), the layout stored as net.layout. Returns net."""
    net.layout, net.stream_ctx = {**layout, 'timesteps': tuple(layout['timesteps'])}, Context()  # JSON: a list
    for i, b in enumerate(net.blocks):
        b.attn1.processor = StreamSelf(i, net.stream_ctx, b.attn1.processor._attention_backend)
        b.attn2.processor = StreamCross(i, net.stream_ctx, b.attn2.processor._attention_backend)
    return net


def _call(net, x, t, context):
    """diffusers' forward on x (B, C, f, h, w) at timesteps t ((B,), or (B, tokens)), text context."""
    return net(hidden_states=x, timestep=t, encoder_hidden_states=context, return_dict=False)[0]


def forward_block(net, x, s, context, cache, start, write=False):
    """The velocity (B, C, f, h, w) of the block x of frames [start, start + f) at timesteps 1000 s (B,), from the
    cache; write: also append its keys and values (the timestep-0 pass of a finished block)."""
    ctx, (_, ph, pw) = net.stream_ctx, net.config.patch_size
    ctx.cache, ctx.frames, ctx.write, ctx.mask = cache, list(range(start, start + x.shape[2])), write, None
    ctx.visible = cache.select(start, start + x.shape[2])  # once, before any layer writes (and evicts)
    ctx.rope = rope_at(net.rope, ctx.frames, x.shape[3] // ph, x.shape[4] // pw)
    try:
        return _call(net, x, 1000 * s, context)
    finally:
        ctx.cache, ctx.rope = None, None


@torch.no_grad()
def recache(net, x, context, cache, first):
    """LongLive's re-cache at a prompt switch (KVPO: diversity_sampling.py's recache_after_switch, global sink):
    the clean latents x (B, C, n, h, w) of the cached frames [first, first + n) (the last `window` before the
    switch) run once more at timestep 0 under the new prompt's `context`, all at once and unmasked among
    themselves: every frame sees the sink's cached keys (not recomputed: the first prompt's) and the new keys
    of the last window - sink of the n frames (the released window counts from the pass's end, so the first
    frames see later ones and not themselves). The new keys and values of the frames the cache holds (the
    sink's excepted) replace the old. The text keys are the cache's (recompute them first: kvpo/segments.py)."""
    layout, ctx, (_, ph, pw) = cache.layout, net.stream_ctx, net.config.patch_size
    n, T = x.shape[2], x.shape[3] // ph * (x.shape[4] // pw)
    frames = list(range(first, first + n))
    seen = first + n - ((layout['window'] or n) - layout['sink'])  # the frames' own keys from here on
    ctx.cache, ctx.frames, ctx.write = cache, frames, False
    ctx.visible = [f for f in cache.frames if f < layout['sink']]  # the sink as cached
    ctx.rewrite = [f for f in frames if f >= layout['sink'] and f in cache.frames]
    sees = torch.tensor([True] * len(ctx.visible) + [f >= seen for f in frames])  # (keys,): the same for every query
    ctx.mask = sees.repeat_interleave(T)[None, None, None].expand(1, 1, n * T, -1).to(x.device)  # (1, 1, S, keys)
    ctx.rope = rope_at(net.rope, frames, x.shape[3] // ph, x.shape[4] // pw)
    try:
        _call(net, x, torch.zeros(len(x), device=x.device), context)
    finally:
        ctx.cache, ctx.rope, ctx.mask, ctx.rewrite = None, None, None, ()


def forward_masked(net, x, s, context, positions, mask):
    """The velocity of a whole sequence x (B, C, N, h, w) of frames at absolute `positions` (N,), each frame
    at its own sigma s (B, N), attention allowed by the frame-level mask (N, N) bool (query, key). context:
    one text (B, L, D), or prompt segments [(first frame, text), ...]: each frame reads the text of the
    segment its position falls in (the texts side by side, a cross-attention mask), as the cache gave it."""
    ctx, (_, ph, pw) = net.stream_ctx, net.config.patch_size
    T = x.shape[3] // ph * (x.shape[4] // pw)  # tokens a frame
    if not torch.is_tensor(context):  # segments: (tokens, S L) which text each token reads
        firsts, texts = zip(*context)
        seg = torch.tensor([sum(p >= f for f in firsts[1:]) for p in positions]).repeat_interleave(T)
        L = texts[0].shape[1]
        ctx.text_mask = seg[:, None] == torch.arange(len(texts)).repeat_interleave(L)[None]
        context = torch.cat(texts, 1)
    ctx.cache, ctx.rope = None, rope_at(net.rope, positions, x.shape[3] // ph, x.shape[4] // pw)
    ctx.mask = mask.repeat_interleave(T, 0).repeat_interleave(T, 1)[None, None].to(x.device)  # (1, 1, S, S)
    try:
        return _call(net, x, 1000 * s.repeat_interleave(T, 1), context)
    finally:
        ctx.rope, ctx.mask, ctx.text_mask = None, None, None


def frame_mask(n, layout):
    """The frame mask (n, n) bool (query, key) of one clip: frame i sees frame j iff j's block is not after
    i's and j is a sink frame or among the window - sink frames up to i's block's end (window None: any)."""
    pos = torch.arange(n)
    blk = pos // layout['block']
    if layout['window'] is None:
        return blk[None] <= blk[:, None]
    end = (blk + 1) * layout['block']
    inside = (pos[None] < layout['sink']) | (pos[None] >= end[:, None] - (layout['window'] - layout['sink']))
    return (blk[None] <= blk[:, None]) & inside


def teacher_mask(n, layout):
    """The frame mask of [n clean frames, the same n frames noisy] (2n, 2n): every frame sees the clean
    frames of earlier blocks inside its window and its own block's frames of its own kind: what the
    cache gives a block at generation (clean frames at timestep 0, its own noisy block)."""
    pos = torch.arange(n).repeat(2)
    kind = torch.arange(2 * n) // n  # 0 clean, 1 noisy
    blk = pos // layout['block']
    end = (blk + 1) * layout['block']
    inside = torch.ones(2 * n, 2 * n, dtype=torch.bool) if layout['window'] is None else \
        (pos[None] < layout['sink']) | (pos[None] >= end[:, None] - (layout['window'] - layout['sink']))
    earlier = (kind[None] == 0) & (blk[None] < blk[:, None]) & inside
    return earlier | ((kind[None] == kind[:, None]) & (blk[None] == blk[:, None]))


@torch.no_grad()
def generate(net, noise, context, gens=None, cache=None, on_block=None, cfg=1.0, context_neg=None):
    """Latents (B, C, F, h, w) from initial noise (B, C, F, h, w), block by block. gens: one generator
    a sample for the re-noising draws (per block, per step, in that order); cache: a KVCache to continue
    (None: a fresh one; else noise's frames follow its newest frame); on_block(start, x0, cache): called
    after each finished block (KVPO's fork). cfg != 1: classifier-free guidance against context_neg, both
    branches in one batch, each with its own cache rows (the distilled models use none)."""
    layout, sig, times = net.layout, sigmas(net.layout), model_times(net.layout)
    cache = KVCache(layout) if cache is None else cache
    B, F = noise.shape[0], noise.shape[2]
    if layout.get('max_frames') and cache.end + F > layout['max_frames']:  # its released cache has no room
        raise SystemExit(f"{layout.get('name', 'this layout')}: its released sampler holds {layout['max_frames']} "
                         f"latent frames with global attention, asked for {cache.end + F}: not how its code samples")
    guided = cfg != 1.0
    if guided:  # (2B, ...) rows: conditional, then unconditional
        context = torch.cat([context, context_neg])
    out, first = [], cache.end  # absolute frame of noise's first frame
    for i in range(0, F, layout['block']):
        start, x = first + i, noise[:, :, i:i + layout['block']]  # (B, C, f, h, w)
        for k, s in enumerate(sig):
            t = torch.full((len(context),), times[k], device=x.device)  # the model's timestep / 1000 (warped: s)
            v = forward_block(net, torch.cat([x, x]) if guided else x, t, context, cache, start).float()
            if guided:
                v = v[B:] + cfg * (v[:B] - v[B:])
            x0 = x.float() - s * v  # the step's prediction of the clean block, at the step's sigma
            if k + 1 < len(sig):  # re-noise to the next step's sigma: fresh noise (the released sampler), or
                if layout.get('renoise', 'fresh') == 'ode':  # the step's own noise x0 + v: an Euler step of the ODE
                    z = x0 + v
                else:
                    z = torch.randn_like(x0) if gens is None else \
                        torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gens]).to(x0.device)
                x = (1 - sig[k + 1]) * x0 + sig[k + 1] * z
        forward_block(net, torch.cat([x0, x0]) if guided else x0, torch.zeros(len(context), device=x0.device),
                      context, cache, start, write=True)  # context_noise 0
        out.append(x0)
        if on_block is not None:
            on_block(start, x0, cache)
    return torch.cat(out, 2)
