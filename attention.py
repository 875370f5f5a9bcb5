"""
The attention settings every model family shares. A family file (hunyuan15.py) sets its blocks'
attention processor from the `attention` setting:

    python train.py config/toy.py --attention=diffusers     # diffusers' own processor instead

    masked_keys   padding excluded as keys only, a (B, S) key mask through diffusers' dispatcher:
                  no S x S mask exists, and diffusers' context parallelism (sp.py) composes with it
    diffusers     the family's diffusers processor as shipped (HunyuanVideo 1.5: a dense (B, 1, S, S) mask)

Tested by: python -m pytest tests/test_attention.py
"""
ATTENTIONS = ('masked_keys', 'diffusers')  # the `attention` setting; the first is the default
