"""
metrics.py against independent references, with tiny random CLIP models in the released layout
(tests/tiny_clip.py):
- preprocessing: transformers' own CLIPImageProcessor (its PIL backend) on 8-bit PIL frames, for
  upscaled, downscaled, portrait and landscape frames: at most one level of 255 apart;
- scores: each frame scored alone with the PIL processor, each prompt tokenised alone, embeddings from
  CLIPModel.get_text_features / get_image_features, then the definition (2.5 * max(cos, 0); and
  exp(logit_scale) * cos), then the mean over frames; prompts longer than 77 tokens are truncated;
- the two definitions on given cosines, negative ones included;
- missing weights name the `hf download` command; an empty list loads nothing; a typo is an error.
"""
import numpy as np
import pytest
import torch
from PIL import Image

from extras import metrics
from tiny_clip import make_tiny_clip

PROMPTS = ['a red circle moving left', 'a dog runs in the park at night ' * 12]  # the second: > 77 tokens


@pytest.fixture(scope='module')
def dirs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('clip'))
    return {k: make_tiny_clip(root, k) for k in ('clip', 'pickscore')}


def clips(shape, seed=0):
    """(B, F, 3, H, W) in [0, 1]: smooth colour fields with a moving bright square, distinct per clip."""
    B, n, _, H, W = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(B, 1, 3, 4, 4, generator=g).expand(B, n, 3, 4, 4).flatten(0, 1)
    x = torch.nn.functional.interpolate(x, size=(H, W), mode='bilinear').view(shape).clone()
    for f in range(n):
        x[:, f, :, H // 4:H // 2, f * W // (2 * n):f * W // (2 * n) + W // 4] = 0.95
    return x


def pil(frame):
    return Image.fromarray((frame.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy())


def reference(path, frames, prompts, formula, pil_pixels=True):
    """The slow way: one frame and one prompt at a time, through transformers' own API; the pixels from
    transformers' PIL processor, or (pil_pixels=False) from metrics.preprocess to isolate everything else."""
    from transformers import AutoTokenizer, CLIPImageProcessorPil, CLIPModel
    model, tok = CLIPModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    proc = CLIPImageProcessorPil.from_pretrained(path)
    settings = metrics.image_settings(path, '')
    out = []
    with torch.no_grad():
        for video, prompt in zip(frames, prompts):
            ids = tok(prompt, truncation=True, max_length=77, return_tensors='pt')
            t = model.get_text_features(**ids).pooler_output[0]
            per_frame = []
            for f in video:
                x = proc(images=pil(f), return_tensors='pt')['pixel_values'] if pil_pixels else \
                    metrics.preprocess(f[None], *settings)  # (1, 3, 224, 224)
                e = model.get_image_features(pixel_values=x).pooler_output[0]
                cos = float(e @ t / (e.norm() * t.norm()))
                per_frame.append(formula(model, cos))
            out.append(sum(per_frame) / len(per_frame))
    return torch.tensor(out)


@pytest.mark.parametrize('H,W', [(24, 24), (40, 56), (300, 200), (480, 848)])
def test_preprocess_matches_clip_image_processor(dirs, H, W):
    from transformers import CLIPImageProcessorPil
    frames = clips((1, 2, 3, H, W))[0]
    for path in dirs.values():
        proc = CLIPImageProcessorPil.from_pretrained(path)
        ref = torch.from_numpy(np.stack(proc(images=[pil(f) for f in frames])['pixel_values']))
        ours = metrics.preprocess(frames, *metrics.image_settings(path, ''))
        assert ours.shape == ref.shape == (2, 3, 224, 224)
        std = torch.tensor(proc.image_std).view(1, 3, 1, 1)
        levels = ((ours - ref) * std * 255).abs()
        assert levels.max() <= 1 + 1e-3, levels.max()  # torch's float kernel vs PIL's fixed point: one level
        assert levels.mean() < 0.2  # and most pixels identical (measured: 84-94%)


def test_scores_match_per_frame_reference(dirs):
    frames = clips((2, 3, 3, 40, 56))
    clip_fn = metrics.load_clipscore(dirs['clip'])
    pick_fn = metrics.load_pickscore(dirs['pickscore'])
    got_c, got_p = clip_fn(frames, PROMPTS), pick_fn(frames, PROMPTS)
    clipscore = lambda m, cos: 2.5 * max(cos, 0.0)  # noqa: E731
    pickscore = lambda m, cos: m.logit_scale.exp().item() * cos  # noqa: E731
    assert got_c.shape == got_p.shape == (2,) and got_c.dtype == torch.float32
    # the same pixels: batching, padding, truncation, pooling, formula and frame mean agree to float error
    torch.testing.assert_close(got_c, reference(dirs['clip'], frames, PROMPTS, clipscore, False), atol=1e-5, rtol=0)
    torch.testing.assert_close(got_p, reference(dirs['pickscore'], frames, PROMPTS, pickscore, False), atol=1e-3, rtol=0)
    # transformers' PIL pixels (one level of 255 apart on some pixels; random tiny towers amplify it:
    # measured 2e-3 and 0.02, i.e. cosines within 8e-4 and 2e-4)
    torch.testing.assert_close(got_c, reference(dirs['clip'], frames, PROMPTS, clipscore), atol=5e-3, rtol=0)
    torch.testing.assert_close(got_p, reference(dirs['pickscore'], frames, PROMPTS, pickscore), atol=0.1, rtol=0)
    # the scores discriminate: another clip for the same prompts scores differently
    assert (pick_fn(clips((2, 3, 3, 40, 56), seed=1), PROMPTS) - got_p).abs().max() > 0.1
    # every frame counts: changing the last frame alone changes the clip's mean
    other = frames.clone()
    other[:, -1] = 1 - other[:, -1]
    assert (pick_fn(other, PROMPTS) - got_p).abs().min() > 1e-3


def test_definitions(dirs):
    cos = torch.tensor([[-0.3, 0.0, 0.2, 0.9]])
    torch.testing.assert_close(metrics.load_clipscore(dirs['clip']).scale(cos), torch.tensor([[0.0, 0.0, 0.5, 2.25]]))
    pick = metrics.load_pickscore(dirs['pickscore'])  # tiny_clip sets logit_scale = log 100, as released
    torch.testing.assert_close(pick.scale(cos), 100 * cos)


def test_load_metrics_names_and_missing_weights(dirs, tmp_path):
    assert metrics.load_metrics('', dirs['clip'], dirs['pickscore']) == {}
    both = metrics.load_metrics('clipscore, pickscore', dirs['clip'], dirs['pickscore'])
    assert list(both) == ['clipscore', 'pickscore']
    with pytest.raises(ValueError, match='unknown visual metric'):
        metrics.load_metrics('clipscor', dirs['clip'], dirs['pickscore'])
    nope = str(tmp_path / 'nope')
    with pytest.raises(FileNotFoundError, match=f'hf download openai/clip-vit-large-patch14 --local-dir {nope}'):
        metrics.load_metrics('clipscore', nope, dirs['pickscore'])
    with pytest.raises(FileNotFoundError, match=f'hf download yuvalkirstain/PickScore_v1 --local-dir {nope}'):
        metrics.load_metrics('pickscore', dirs['clip'], nope)
