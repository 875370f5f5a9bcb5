"""
bench/trust_region.py's workers share one queue by claiming runs (claim: an exclusive file holding the claimant's
pid): two workers never train the same run, and a claim whose claimant died is taken over, so a killed bench
resumes. python -m pytest tests/test_bench_claims.py
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLAIM = ("import sys; sys.argv = ['bench.trust_region', '--run=False', '--out={out}']\n"
         "from bench import trust_region as T\n"
         "print(T.claim('{name}'))")


def claim_in_another_process(out, name):
    p = subprocess.run([sys.executable, '-c', CLAIM.format(out=out, name=name)], cwd=ROOT, capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip().splitlines()[-1] == 'True'


def test_one_claimant_a_run_and_a_dead_ones_claim_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, 'argv', ['bench.trust_region', '--run=False', f'--out={tmp_path}'])
    from bench import trust_region as T
    monkeypatch.setattr(T, 'out', str(tmp_path))
    assert T.claim('run_a')  # this process holds it
    assert open(tmp_path / 'runs' / 'claims' / 'run_a').read() == str(os.getpid())
    assert not claim_in_another_process(tmp_path, 'run_a')  # a live claimant: the other worker moves on
    assert claim_in_another_process(tmp_path, 'run_b')  # another run: its own; that process has exited since
    assert T.claim('run_b')  # its claimant is gone: taken over (a killed bench's run is trained again)
    assert open(tmp_path / 'runs' / 'claims' / 'run_b').read() == str(os.getpid())
