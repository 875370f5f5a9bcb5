"""
Settings out of range or misspelt (configurator.RULES) stop train.py, sample.py and the benches with
one line that names the setting, the value and what is allowed, before anything is loaded or
written:
- every range and every list of names, each with a bad value and a good value at the edge of the
  range, run through the real scripts in this process (runpy: the imports are paid once), stopped
  right after their settings block by a sentinel; the expected limits are written out here, not
  read from the table;
- a case of train.py and of sample.py as a user runs it (subprocesses): a one-line message, no
  traceback, and out_dir exactly as it was.
"""
import os
import runpy
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Passed(Exception):
    """Raised by the first thing a script does after its settings: the values were accepted."""


def stop(*args, **kwargs):
    raise Passed


# (setting, bad values, a good value at the edge, words of what is allowed) of train.py
TRAIN = [
    ('num_steps', [0, -3], 1, 'at least 1'),
    ('eta', [0.0, -1.0], 1e-3, 'greater than 0'),  # train.py: at eta 0 no step is stochastic
    ('timestep_fraction', [0.0, 1.5], 1.0, 'greater than 0 and at most 1'),
    ('clip_range', [0.0, -1e-4], 1e-6, 'greater than 0'),
    ('group_size', [1, 0], 2, 'at least 2'),
    ('learning_rate', [-1e-5], 0.0, 'at least 0'),
    ('num_frames', [80, 0, 2], 5, '1 + 4k'),
    ('height', [40, 0], 16, 'multiple of 16'),
    ('width', [100, -16], 32, 'multiple of 16'),
    ('shift', [0.0], 0.5, 'greater than 0'),
    ('cfg', [0.5, 0.0], 1.0, 'at least 1'),
    ('fps', [0], 1, 'greater than 0'),
    ('prompts_per_iter', [0], 1, 'at least 1'),
    ('rollout_batch', [0], 1, 'at least 1'),
    ('train_batch', [0], 1, 'at least 1'),
    ('updates_per_iter', [0], 1, 'at least 1'),
    ('adv_clip', [0.0], 0.1, 'greater than 0'),
    ('anchor_every', [0], 1, 'at least 1'),
    ('beta_pos', [-1.0], 0.0, 'at least 0'),
    ('beta_vel', [-0.1], 0.0, 'at least 0'),
    ('kl_max', [0.0], 1e-7, 'greater than 0'),  # 1e-7: kl_init's default (kl_min <= kl_init <= kl_max)
    ('kl_init', [0.0], 1e-5, 'greater than 0'), ('kl_warmup', [-1], 0, 'at least 0'), ('alarm_z', [0.0], 0.5, 'greater than 0'),
    ('kl_ratio_target', [-1.0], 0.0, 'at least 0'),
    ('advantage', ['ppo'], 'taros', "'grpo', 'per_component', 'taros'"), ('kl_estimator', ['mc'], 'sample', "'exact', 'sample'"),
    ('kl_target', [-1e-5], 1e-9, 'greater than 0'),
    ('weight_decay', [-0.01], 0.0, 'at least 0'),
    ('grad_clip', [0.0], 0.5, 'greater than 0'),
    ('lora_rank', [-1], 0, 'at least 0'),
    ('max_iters', [-1], 0, 'at least 0'),
    ('eval_every', [-1], 0, 'at least 0'),
    ('eval_samples', [0], 1, 'at least 1'),
    ('eval_videos', [-1], 0, 'at least 0'),
    ('save_every', [-1], 0, 'at least 0'),
    ('keep_checkpoints', [0], 1, 'at least 1'),
    ('diag_every', [-1], 0, 'at least 0'),
    ('eval_steps', [-1], 0, 'at least 0'),  # unchecked, -1 evaluates pure noise: no sampling step
    ('sde_window', [-1], 0, 'at least 0'),  # unchecked, -1 trains without a word
    ('sp_size', [0, -2], 1, 'at least 1'),
    ('dist_timeout', [0, -5], 1, 'greater than 0'),
    ('sampler', ['fast', 'ode', 'SAGE'], 'cps', "'sage', 'cps'"),
    ('kl_strategy', ['dul', ''], 'stepwise', "'none', 'fixed', 'stepwise', 'moving', 'dual'"),
    ('optimizer', ['sgd'], 'muon', "'muon', 'adamw'"),
    ('median', ['upper'], 'lower', "'mean_of_middle', 'lower'"),
    ('credit', ['tvr'], 'tvrl', "'none', 'tvrl'"),
    ('credit_granularity', ['pixel'], 'frame', "'window', 'frame'"),
    ('credit_window', [(1, 2, 3), (1, 3), (0, 1, 1)], (1, 1, 1), '3 odd sizes'),
    ('kl_update', ['iter'], 'step', "'step', 'backward'"),
    ('prompt_noise', ['same'], 'fixed', "'fresh', 'fixed'"),
    ('init_from', ['latest'], 'resume', "'scratch', 'resume'"),
    ('attention', ['flash', 'masked'], 'diffusers', "'valid_tokens', 'masked_keys', 'diffusers'"),
    ('attention_backend', ['flash_attn', 'Native', ''], 'xformers', 'a diffusers attention backend'),
    ('reward_model', ['clip'], 'videoalign', "'videoalign', 'world'"),
    ('device', ['gpu', 'cuda:0'], 'cpu', "'cuda', 'cpu'"),
    ('export_dtype', ['fp16'], '', "'bfloat16', 'float16', 'float32', ''"),
    ('eval_metrics', ['clip', 'clipscore,pick'], 'pickscore, clipscore', "'clipscore', 'pickscore'"),
    ('kl_direction', [0, 2], -1, 'one of 1, -1'),
    ('reward_weights', [(1.0, 1.0), (1.0, -1.0, 1.0)], (0.0, 0.0, 1.0), '3 weights'),
]
# sample.py: its own sampler list (ODE) and eta 0; prompts that name a missing file
SAMPLE = [
    ('sampler', ['fast', 'euler'], 'ode', "'ode', 'dance', 'flow', 'sage', 'cps'"),
    ('eta', [-1.0, -1e-9], 0.0, 'at least 0'),
    ('num_steps', [0], 1, 'at least 1'),
    ('num_prompts', [0], 1, 'at least 1'),
    ('samples', [0], 1, 'at least 1'),
    ('num_frames', [4], 1, '1 + 4k'),
    ('height', [24], 48, 'multiple of 16'),
    ('prompts', ['prompts/missing.txt', 'missing.csv', 'nowhere/a red circle'], 'a red circle moving left',
     'file not found'),
]
BENCH = [('sections', ['7', '1,9'], '0,5', "'0', '1'"), ('ablations', ['z'], 'a,h', "'a', 'b'"),
         ('threads', [0], 1, 'at least 1'), ('seeds', [0], 1, 'at least 1'), ('eta', [-0.5], 0.5, 'greater than 0'),
         ('group', [1], 2, 'at least 2'), ('bench_prompts', [0, 17], 16, 'at least 1 and at most 16'),
         ('grad_clips', [0, 17], 1, 'at least 1 and at most 16'), ('search_iters', [0], 1, 'at least 1'),
         ('train_iters', [0], 1, 'at least 1'), ('train_prompts_per_iter', [0], 1, 'at least 1'),
         ('acting_kl_max', [0.0], 1e-6, 'greater than 0'), ('budget_min', [-1.0], 0.0, 'at least 0'),
         ('first_seed', [-1], 0, 'at least 0'), ('first_seed', [3, 4], 2, 'below seeds (3)'),  # 3: nothing to run
         ('cost_iters', [1], 2, 'at least 2')]
COMPUTE = [('prompts', [0], 1, 'at least 1'), ('evals', [0], 1, 'at least 1'), ('smooth', [0], 1, 'at least 1'),
           ('max_iters_factor', [0.5], 1.0, 'at least 1'), ('full_iters', [0], 1, 'at least 1'),
           ('full_gpus', [0], 1, 'at least 1'), ('iters', [0], 1, 'at least 1'), ('workers', [0], 1, 'at least 1'),
           ('worker', [-1], 0, 'at least 0'), ('worker', [1, 2], 0, 'below workers (1)'),  # 1 of 1: no runs
           ('budget_min', [-1.0], 0.0, 'at least 0'), ('seeds', [0], 1, 'at least 1')]
VERDICTS = [('prompts', [0, 3], 2, 'an even count'), ('iters', [0], 1, 'at least 1'),
            ('eval_every', [-1], 0, 'at least 0'), ('tr_kl_max', [0.0], 1e-3, 'greater than 0'),
            ('tr_updates', [0], 1, 'at least 1'), ('match_tol', [0.0], 0.01, 'greater than 0'),
            ('late_iters', [-1], 0, 'at least 0'), ('thresholds', [(), (0.65, 2.5), (0.0,)], (2.0,), 'in (0, 2]'),
            ('worker', [1], 0, 'below workers (1)'), ('workers', [0], 1, 'at least 1')]
FULLSIZE = [('gpus', [0], 1, 'at least 1'), ('clips', [0], 1, 'at least 1'), ('gpu_gb', [0.0], 1.0, 'greater than 0'),
            ('tflops', [0.0, -1.0], 1.0, 'greater than 0'), ('videoalign_params', [-1.0], 0.0, 'at least 0'),
            ('metrics_params', [-1.0], 0.0, 'at least 0'), ('processor', ['flash'], 'diffusers', "'masked_keys'"),
            ('only', ['train,gpu'], 'lora,sp', "'train', 'rollout', 'lora', 'diffusers', 'sp'"),
            ('sizes', [((352, 620),), (), ((352,),)], ((16, 16),), 'pairs, each a multiple of 16'),
            ('sp_clips', [((80, 480, 848),), ((81, 480, 840),)], ((1, 16, 16),), '1 + 4k frames'),
            ('lora_sizes', [((81, 352),)], ((5, 32, 32),), '1 + 4k frames'),
            ('text_tokens', [(0, 256), (1000,)], (1, 1), 'token counts >= 1'),
            ('sp_sizes', [(0, 2), ()], (1,), 'degrees >= 1'), ('num_steps', [0], 1, 'at least 1'),
            ('wan_models', [('5b',), ()], ('14b',), "'1.3b', '14b'"),
            ('wan_clip', [(80, 480, 832), (81, 480, 840), (81, 480)], (1, 16, 16), '1 + 4k frames'),
            ('wan_clips_1gpu', [0], 1, 'at least 1'), ('wan_sp', [-1], 0, 'at least 0')]
OTHER = {'bench.gpu_check': [('blocks', [0], 1, 'at least 1'), ('phase_timeout', [0, -1], 1, 'greater than 0'),
                             ('width', [100], 16, 'multiple of 16')],
         'bench.rehearsal': [('blocks', [0], 1, 'at least 1'), ('num_frames', [8], 9, '1 + 4k')],
         'bench.checkpoint': [('parts', ['checkpoint,disk'], 'prompts', "'checkpoint', 'prompts'")]}


def fmt(v):  # the command-line form of a value (strings stay bare words, tuples python literals)
    return v if isinstance(v, str) and v else repr(v)


def run_script(monkeypatch, script, args):
    """Run a script in this process with argv; 'passed' if its settings were accepted, else its error."""
    monkeypatch.setattr(sys, 'argv', [script] + args)
    try:
        if script.startswith('-m '):
            runpy.run_module(script[3:], run_name='__main__')
        else:
            runpy.run_path(os.path.join(ROOT, script), run_name='__main__')
    except Passed:
        return 'passed'
    except SystemExit as e:
        return str(e.code)
    raise AssertionError(f'{script} {args} ran past its sentinel')


@pytest.mark.filterwarnings('ignore:.*found in sys.modules:RuntimeWarning')  # bench.compute imported them
@pytest.mark.parametrize('script,cases,base', [
    ('train.py', TRAIN, ['config/toy.py']),
    ('sample.py', SAMPLE, ['--checkpoint=']),
    ('-m bench.toy', BENCH, []),
    ('-m bench.compute', COMPUTE, []),
    ('-m bench.verdicts', VERDICTS, []),
    ('-m bench.fullsize', FULLSIZE, []),
] + [(f'-m {m}', cases, []) for m, cases in OTHER.items()])
def test_every_range_one_line_before_anything(monkeypatch, tmp_path, script, cases, base):
    from infra import configurator
    from models import policy as model
    from infra import preemption
    from bench import common
    from test_verdicts import load
    monkeypatch.chdir(ROOT)
    load('verdicts'), load('fullsize')  # imported by bench.compute: their own settings at the defaults
    # the first thing each script does after its settings: preemption.Preemption (train.py, after the
    # distributed setup), model.family (sample.py), bench.common.setup (bench.toy, .compute, .verdicts,
    # after their one-line checks of two settings together); the other benches: configure's return
    monkeypatch.setattr(preemption, 'Preemption', stop)
    monkeypatch.setattr(model, 'family', stop)
    monkeypatch.setattr(common, 'setup', stop)
    if script[3:] in OTHER or script == '-m bench.fullsize':
        configure = configurator.configure
        monkeypatch.setattr(configurator, 'configure', lambda *a, **kw: stop(configure(*a, **kw)))
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'kept.txt').write_text('written before')
    before = {f: os.path.getmtime(out / f) for f in os.listdir(out)}
    flag = '--out_dir' if script in ('train.py', 'sample.py', '-m bench.fullsize') else '--out'
    args = base + [f'{flag}={out}']
    assert run_script(monkeypatch, script, args) == 'passed'  # the defaults pass
    for key, bad, good, allowed in cases:
        for v in bad:
            message = run_script(monkeypatch, script, args + [f'--{key}={fmt(v)}'])
            assert message.startswith(f'config error: {key} must be ') and allowed in message, (key, v, message)
            assert f'got {v!r}' in message and '\n' not in message, (key, v, message)
        assert run_script(monkeypatch, script, args + [f'--{key}={fmt(good)}']) == 'passed', (key, good)
    assert {f: os.path.getmtime(out / f) for f in os.listdir(out)} == before


def test_none_only_where_the_default_is_none():
    from infra.configurator import configure
    g = dict(eta=0.5, num_steps=None, sampler='sage')
    configure(g, ['--num_steps=None'])  # sample.py's "the world's default"
    with pytest.raises(SystemExit, match=r"^config error: eta must be greater than 0 .*, got None$"):
        configure(dict(g), ['--eta=None'])


def test_bad_values_as_a_user_runs_them(tmp_path):
    # one case a script, its own process as a user runs it (each costs a python + torch import, ~3-5 s):
    # the SystemExit that test_every_range_one_line_before_anything pins is one line, exit status 1
    cases = [(['train.py', 'config/toy.py', '--eval_steps=-1'],
              'config error: eval_steps must be at least 0 (0: num_steps), got -1'),
             (['sample.py', '--prompts=prompts/missing.txt'],
              "config error: prompts must be a prompt, or a .txt/.csv file of prompts, got 'prompts/missing.txt' "
              "(file not found)")]
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'kept.txt').write_text('written before')
    before = {f: os.path.getmtime(out / f) for f in os.listdir(out)}
    for args, message in cases:
        p = subprocess.run([sys.executable] + args + [f'--out_dir={out}'], cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS='1'), timeout=120)
        assert p.returncode == 1 and 'Traceback' not in p.stderr, (args, p.stderr[-2000:])
        assert p.stderr.strip().splitlines()[-1].startswith(message), (args, p.stderr[-2000:])
        assert p.stdout == '' and {f: os.path.getmtime(out / f) for f in os.listdir(out)} == before, (args, p.stdout)


def test_layout_settings_one_line_before_anything(monkeypatch, tmp_path):
    """shard_size (0: one node's ranks, so at least 0) and solo_timeout (minutes, greater than 0) through
    train.py as the table's cases are: a bad value one line, the edge value passes."""
    test_every_range_one_line_before_anything(monkeypatch, tmp_path, 'train.py', [
        ('shard_size', [-1, -8], 0, 'at least 0'), ('solo_timeout', [0, -1.0], 1e-3, 'greater than 0')],
        ['config/toy.py'])


def test_settings_checked_together_one_line(monkeypatch):
    """Rules of several settings at once (a tuple key): lambda_KL's floor, start and ceiling in order,
    and an attention that needs a mask on a backend without one; each one line before anything runs."""
    from infra import preemption
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(preemption, 'Preemption', stop)
    base = ['config/toy.py', '--out_dir=/nonexistent/never-written']
    paper = base + ['--kl_ratio_target=0']  # the paper's controller reads all three
    assert run_script(monkeypatch, 'train.py', paper + ['--kl_init=1e-5', '--kl_min=1e-5']) == 'passed'
    said = run_script(monkeypatch, 'train.py', paper + ['--kl_init=1e-3'])
    assert said == ('config error: lambda_KL needs kl_min <= kl_init <= kl_max (the paper\'s controller: '
                    'kl_ratio_target=0), got 1e-07, 0.001, 1e-05'), said
    # the ratio held (the default) starts from kl_init alone: a start above kl_max is a start
    assert run_script(monkeypatch, 'train.py', base + ['--kl_init=0.1']) == 'passed'
    said = run_script(monkeypatch, 'train.py', base + ['--kl_update=backward'])
    assert said.startswith("config error: kl_ratio_target > 0 holds lambda_KL once per optimizer step") and \
        '\n' not in said, said
    assert run_script(monkeypatch, 'train.py', base + ['--kl_update=backward', '--kl_ratio_target=0']) == 'passed'
    said = run_script(monkeypatch, 'train.py', base + ['--attention=masked_keys', '--attention_backend=_native_flash'])
    assert said.startswith("config error: attention_backend '_native_flash' takes no mask") and '\n' not in said
