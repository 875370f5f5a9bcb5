# KVPO on the distilled streaming toy (streaming/toy_sf.py): the released 4-step sampler (sigmas 1, .9375, .8333,
# .625, fresh re-noising, no guidance), the toy's layout (block 1, sink 1, window 4). An overlay of the toy's
# config, whose every other setting it keeps (the first 2 of the 4 steps carry gradient, as released); the
# verdicts of bench/kvpo_verdicts.py run on it, at this lr 1e-4 and the released 1e-5.
#   python -m kvpo.train kvpo/config/toy.py kvpo/config/toy_sf.py
model = 'assets/toy_sf'
train_prompts = 'assets/toy_sf/train_prompts.txt'
eval_prompts = 'assets/toy_sf/eval_prompts.txt'
out_dir = 'out-kvpo-toy-sf'
context_noise = 0.0             # the toy was distilled with its cache written from x0 itself (streaming/toy_sf.py)
