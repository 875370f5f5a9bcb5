# GRPO with an SDE on the story toy (kvpo/grpo_ar.py), beside KVPO on it (kvpo/config/toy_story.py): the same
# stories an iteration, model, optimizer, EMA and held-out stories, paired seed by seed in bench/kvpo_verdicts.py.
#   python -m kvpo.grpo_ar kvpo/config/grpo_toy.py kvpo/config/grpo_toy_story.py
model = 'assets/toy_story'
train_prompts = 'assets/toy_story/train_stories.txt'
eval_prompts = 'assets/toy_story/eval_prompts.txt'
eval_stories = 'assets/toy_story/eval_stories.txt'
frames = 16
switch_frames = (4, 8, 12)      # the text keys replaced at each switch (no re-cache: as KVPO's toy_story.py)
train_steps = 2                 # of the 4 SDE steps (KVPO's replay trains 2 of the 4 too)
out_dir = 'out-grpo-ar-toy-story'
