"""model.py against the diffusers HunyuanVideo 1.5 pipeline itself, on a tiny random-weight pipeline
of the real classes (tests/tiny_hunyuan.py): prompt encoding, the guided velocity, the ODE sampling
loop, the decoder and latent shape, the toy/real switch and mp4 writing.
python -m pytest tests/test_model.py"""
import os
import sys

import imageio
import numpy as np
import pytest
import torch
from diffusers import HunyuanVideo15Pipeline

from models import policy as model
import sde

sys.path.insert(0, os.path.dirname(__file__))
from tiny_hunyuan import make_tiny_hunyuan  # noqa: E402

PROMPTS = ['a red car', 'a "quoted" sign']  # the second one also goes through ByT5
CFG = 6.0  # the 480p guidance scale (the tiny pipeline's guider has the same)


@pytest.fixture(scope='session')
def root(tmp_path_factory):
    return make_tiny_hunyuan(tmp_path_factory.mktemp('tiny_hunyuan'))  # built once per session


@pytest.fixture(scope='session')
def pipe(root):
    return HunyuanVideo15Pipeline.from_pretrained(root, torch_dtype=torch.float32)  # the reference


@pytest.fixture(scope='session')
def encoded(pipe):
    # the pipeline's own text inputs, as its __call__ makes them: 1000 + 256 padded tokens
    with torch.no_grad():
        return {'pos': pipe.encode_prompt(PROMPTS, device='cpu', batch_size=2),
                'neg': pipe.encode_prompt(None, device='cpu', batch_size=2)}  # '' (no negative prompt)


def trimmed(full):
    # {i: the i-th prompt's four tensors cut to its valid tokens (at least one)}, written here
    # independently of model.encode_prompts, from the pipeline's padded output
    e1, m1, e2, m2 = full
    out = {}
    for i in range(e1.shape[0]):
        n1, n2 = max(1, int(m1[i].count_nonzero())), max(1, int(m2[i].count_nonzero()))
        out[i] = (e1[i, :n1], m1[i, :n1], e2[i, :n2], m2[i, :n2])
    return out


def latents(B=2, seed=0):
    return torch.randn(B, 4, 3, 2, 2, generator=torch.Generator().manual_seed(seed))  # 9 frames, 32x32


# ----------------------------------------------------------------------------- text

def test_encode_prompts_is_the_pipeline_encoder(root):
    long = 'z' * 300  # 300 byte tokens + 5 template tokens: a count bf16 cannot hold (304 or 306)
    prompts = PROMPTS + ['', long]
    cache = model.encode_prompts(root, prompts + PROMPTS[:1])  # duplicates are encoded once
    assert sorted(cache) == sorted(prompts)
    ref_pipe = HunyuanVideo15Pipeline.from_pretrained(root, transformer=None, torch_dtype=torch.bfloat16)
    ps = sorted(prompts)  # model.encode_prompts batches the sorted unique prompts
    with torch.no_grad():
        e1, m1, e2, m2 = ref_pipe.encode_prompt(ps, device='cpu', batch_size=len(ps))
    assert m1.dtype == torch.bfloat16  # the pipeline casts its masks to the encoder dtype
    for i, p in enumerate(ps):
        c1, cm1, c2, cm2 = cache[p]
        n1, n2 = int(m1[i].count_nonzero()), int(m2[i].count_nonzero())  # exact, unlike a bf16 sum
        assert n1 > 0 and m1[i, :n1].all() and not m1[i, n1:].any()  # right padding: valid tokens first
        assert c1.shape == (n1, e1.shape[-1]) and bool(cm1.bool().all())
        torch.testing.assert_close(c1, e1[i, :n1])
        if n2 == 0:  # no quoted text: one masked all-zero ByT5 token
            assert c2.shape == (1, e2.shape[-1]) and not c2.float().any() and not cm2.any()
        else:
            assert m2[i, :n2].all() and not m2[i, n2:].any()
            assert c2.shape == (n2, e2.shape[-1]) and bool(cm2.bool().all())
            torch.testing.assert_close(c2, e2[i, :n2])
    assert int(m1[ps.index(long)].count_nonzero()) == 305
    assert int(m2[ps.index(PROMPTS[1])].count_nonzero()) > 0  # the quoted prompt did use ByT5


def test_batch_text_pads_back(encoded):
    cache = {p: t for p, t in zip(PROMPTS, trimmed(encoded['pos']).values())}
    full = encoded['pos']
    text = model.batch_text(cache, PROMPTS, 'cpu')
    for j, t in enumerate(text):
        assert t.dtype == torch.float32
        L = max(cache[p][j].shape[0] for p in PROMPTS)
        assert t.shape[:2] == (2, L)
        for i, p in enumerate(PROMPTS):
            n = cache[p][j].shape[0]
            assert torch.equal(t[i, :n], cache[p][j].float())
            assert not t[i, n:].any()  # zero padding, masked out
            if j % 2 == 1:  # the masks agree with the pipeline's over the common length
                assert torch.equal(t[i], full[j][i, :L].float())


# ----------------------------------------------------------------------------- velocity, sampling

def pipeline_velocity(transformer, x, s, text):
    # one transformer call exactly as HunyuanVideo15Pipeline.__call__ makes it for t2v
    e1, m1, e2, m2 = text
    B = x.shape[0]
    hidden = torch.cat([x, torch.zeros_like(x), torch.zeros(B, 1, *x.shape[2:])], 1)
    image = torch.zeros(B, 729, transformer.config.image_embed_dim)  # vision_num_semantic_tokens
    return transformer(hidden_states=hidden, image_embeds=image, timestep=1000 * s,
                       encoder_hidden_states=e1, encoder_attention_mask=m1,
                       encoder_hidden_states_2=e2, encoder_attention_mask_2=m2, return_dict=False)[0]


@torch.no_grad()
def test_velocity_is_the_pipeline_cfg(pipe, encoded):
    tr, x, s = pipe.transformer, latents(), torch.tensor([0.9, 0.35])
    v_c = pipeline_velocity(tr, x, s, encoded['pos'])
    v_u = pipeline_velocity(tr, x, s, encoded['neg'])
    ref = v_u + CFG * (v_c - v_u)
    assert (v_c - v_u).abs().max() > 1e-3  # the prompt matters, so the check has teeth
    # the full padded text (only the image token count differs from the pipeline)
    v = model.velocity(tr, x, s, list(encoded['pos']), CFG, list(encoded['neg']))
    torch.testing.assert_close(v, ref, atol=1e-5, rtol=1e-5)
    # trimmed, re-padded text and one image token: the same velocity
    pos, neg = trimmed(encoded['pos']), trimmed(encoded['neg'])
    cache = {**{p: pos[i] for i, p in enumerate(PROMPTS)}, '': neg[0]}
    text, text_neg = model.batch_text(cache, PROMPTS, 'cpu'), model.batch_text(cache, ['', ''], 'cpu')
    assert text[0].shape[1] < 100  # really trimmed (the pipeline pads to 1000)
    v = model.velocity(tr, x, s, text, CFG, text_neg)
    torch.testing.assert_close(v, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.velocity(tr, x, s, text), v_c, atol=1e-5, rtol=1e-5)  # cfg 1


@torch.no_grad()
def test_ode_sample_is_the_pipeline_loop(pipe, encoded):
    N, x = 3, latents(seed=1)
    assert pipe.guider.guidance_scale == CFG
    ref = pipe(prompt=PROMPTS, latents=x.clone(), num_frames=9, height=32, width=32,
               num_inference_steps=N, output_type='latent').frames  # (B, C, F, h, w)
    sigmas = sde.sigmas(N, pipe.scheduler.config.shift)
    assert torch.equal(sigmas, pipe.scheduler.sigmas.float())
    pos, neg = trimmed(encoded['pos']), trimmed(encoded['neg'])
    cache = {**{p: pos[i] for i, p in enumerate(PROMPTS)}, '': neg[0]}
    text, text_neg = model.batch_text(cache, PROMPTS, 'cpu'), model.batch_text(cache, ['', ''], 'cpu')
    out, traj = model.sample(pipe.transformer, x, sigmas, text, CFG, text_neg, 'ode', 0.0,
                             model.generators([1, 2]), keep=model.RECORDS)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert traj['xs'].shape == (2, N + 1) + x.shape[1:] and traj['means'].shape == (2, N) + x.shape[1:]
    assert torch.equal(traj['xs'][:, 0], x) and torch.equal(traj['xs'][:, -1], out)
    assert not traj['logps'].any() and not traj['stds'].any()  # ODE steps: no noise, no log-prob


# ----------------------------------------------------------------------------- frames

@torch.no_grad()
def test_decoder_is_the_pipeline_decode(root, pipe):
    z = latents()  # a batch of two: the pipeline's own t2v call decodes one video at a time
    frames = model.load_decoder(root, 'cpu')(z)
    assert frames.shape == (2, 9, 3, 32, 32) and frames.dtype == torch.float32
    assert frames.min() >= 0 and frames.max() <= 1
    vae = pipe.vae  # float32 reference, one sample at a time, the pipeline's own postprocessing
    video = torch.cat([vae.decode(z[i:i + 1] / vae.config.scaling_factor, return_dict=False)[0]
                       for i in range(2)])  # (B, 3, F, H, W) in [-1, 1]
    ref = pipe.video_processor.postprocess_video(video, output_type='pt')  # (B, F, 3, H, W) in [0, 1]
    assert (frames - ref).abs().max() < 3e-2  # the decoder runs in bf16
    assert (frames - ref).abs().mean() < 5e-3


@torch.no_grad()
@pytest.mark.parametrize('F,H,W', [(9, 32, 32), (17, 48, 64)])
def test_latent_shape_is_the_vae_encode_shape(root, pipe, F, H, W):
    shape = pipe.vae.encode(torch.zeros(1, 3, F, H, W)).latent_dist.mean.shape[1:]
    assert model.latent_shape(root, F, H, W) == tuple(shape)
    assert pipe.prepare_latents(1, pipe.num_channels_latents, H, W, F).shape[1:] == shape


def test_family_is_read_from_model_index(root, tmp_path):
    from models import hunyuan15
    from models import toy
    assert model.family(root) is hunyuan15 and model.family('assets/toy') is toy
    assert model.family_of(model.load_transformer('assets/toy')) is hunyuan15  # the toy's transformer class
    os.makedirs(tmp_path / 'transformer')  # no model_index.json: says how to get the weights
    with pytest.raises(SystemExit, match='hf download hunyuanvideo-community'):
        model.family(str(tmp_path))
    (tmp_path / 'model_index.json').write_text('{"_class_name": "CogVideoXPipeline"}')
    with pytest.raises(SystemExit, match='CogVideoXPipeline; supported: HunyuanVideo15Pipeline'):
        model.family(str(tmp_path))


@pytest.mark.parametrize('H,W', [(32, 48), (31, 33)])  # odd sides are padded to even ones
def test_save_mp4_reads_back(tmp_path, H, W):
    frames = torch.rand(9, 3, H, W, generator=torch.Generator().manual_seed(0))
    frames[:, :, : H // 2] = 0.9  # a flat region H.264 keeps almost exactly
    path = str(tmp_path / 'clip.mp4')
    model.save_mp4(frames, path, fps=8)
    video = np.stack(imageio.mimread(path))  # (F, H', W', 3) uint8
    assert video.shape == (9, H + H % 2, W + W % 2, 3)
    flat = video[:, 2:H // 2 - 2, 2:W - 2].astype(np.float32) / 255
    assert abs(flat.mean() - 0.9) < 0.03


def test_lora_base_in_bf16_adapters_in_fp32():
    # LoRA on one GPU: the frozen base in bf16 (the default there), adapters, AdamW state, anchor fp32
    from infra.anchor import Anchor
    net = model.load_policy('assets/toy', 'cpu', lora_rank=4, base_dtype=torch.bfloat16)
    frozen = [p for p in net.parameters() if not p.requires_grad]
    trained = [p for p in net.parameters() if p.requires_grad]
    assert frozen and trained and all(p.dtype == torch.bfloat16 for p in frozen)
    assert all(p.dtype == torch.float32 for p in trained)
    assert all(w.dtype == torch.float32 for w in Anchor(net, 'dual', every=10).state_dict().values())
    assert model.load_policy('assets/toy', 'cpu', lora_rank=4).dtype == torch.float32  # CPU default: fp32
