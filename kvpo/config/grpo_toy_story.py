# GRPO with an SDE on the story toy (kvpo/grpo_ar.py), beside KVPO on it (kvpo/config/toy_story.py): the same
# stories an iteration, model, optimizer, EMA and held-out stories, paired seed by seed in bench/kvpo_verdicts.py.
#   python -m kvpo.grpo_ar kvpo/config/grpo_toy.py kvpo/config/grpo_toy_story.py
train_prompts = 'prompts/toy_stories.txt'
eval_stories = 'prompts/toy_stories_eval.txt'
frames = 16
switch_frames = (4, 8, 12)      # the text keys replaced at each switch (no re-cache: as KVPO's toy_story.py)
out_dir = 'out-grpo-ar-toy-story'
