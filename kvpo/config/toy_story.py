# KVPO on the story toy (streaming/toy_story.py): 4 prompt segments of 4 frames, the first naming the object, the
# later ones only what it does next ("it turns up"), so colour and shape must come from the KV cache; the student
# distilled from a teacher of its own architecture (assets/toy_story, the released 4-step sampler). An overlay of
# the toy's config (the same student; K = 6, m = 1, P = 2, lr 1e-4, EMA 0.9, 30 iterations; its held-out captions
# stay the eval_* clips); bench/kvpo_verdicts.py --world=story.
#   python -m kvpo.train kvpo/config/toy.py kvpo/config/toy_story.py
train_prompts = 'prompts/toy_stories.txt'      # a story a line: '0,[caption],[it turns ...] x 3'
eval_stories = 'prompts/toy_stories_eval.txt'  # the held-out captions' stories (eval_story_*)
frames = 16                     # 4 segments of 4 frames
switch_frames = (4, 8, 12)
switch_recache = False          # text keys only, as the student was distilled (toy_story.generate_story)
chunk_first = 16                # one chunk: the fork's chunk is the story, the reward scores the whole of it
chunk_then = 16
cache_frames = 16               # the whole story: pools of up to 12 older frames
out_dir = 'out-kvpo-toy-story'
