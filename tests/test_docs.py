"""
docs/method.md is cited by section number from the code, the tests, the configs and the other documents
("docs/method.md section 5.4", "docs/method.md 4.3", "sections 6-7"), and cites itself ("section 2.2",
"(6.2.4, ...)"). What it pins: every such citation names a section that exists, a heading (`## 6.`, `### 6.1`)
or an argued difference (`**6.2.4 ...**`), so moving or renumbering a section without its citations fails
here, naming the file and the number. python -m pytest -q tests/test_docs.py
"""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, 'docs', 'method.md')
NUM = r'[1-9]\d*(?:\.\d+)*'  # a section number (never 0.x: that is a value)


def sections():
    """The numbers docs/method.md defines: headings and the bold numbers of its argued paragraphs."""
    found = set()
    for line in open(DOC):
        m = re.match(rf'#+ ({NUM})\.? ', line) or re.match(rf'\*\*({NUM}) ', line)
        if m:
            found.add(m.group(1))
    return found


def flat(text):
    """Text with line breaks, comment markers and split string literals joined: a citation may wrap."""
    return re.sub(r"'?\s*\n\s*(?:#\s*)?'?", ' ', text)


def citations(text):
    """The section numbers cited after 'docs/method.md' in text, ranges and 'and' lists included."""
    out = []
    for m in re.finditer(rf"docs/method\.md\s+(?:sections?\s+)?({NUM})((?:\s*(?:-|and)\s*{NUM})*)", flat(text)):
        out += [m.group(1)] + re.findall(NUM, m.group(2))
    return out


def files():
    for d, dirs, names in os.walk(ROOT):
        dirs[:] = [x for x in dirs if not x.startswith('.') and x not in ('cells', 'runs', '__pycache__')]
        for n in names:
            if n.endswith(('.py', '.md', '.sbatch')) and os.path.join(d, n) != DOC:
                yield os.path.join(d, n)


def test_every_citation_of_method_md_names_a_section():
    have = sections()
    assert {'1', '2.2', '5.4', '6.2.4', '12.3'} <= have  # the parser finds headings and argued paragraphs
    bad = [(os.path.relpath(f, ROOT), n) for f in files() for n in citations(open(f).read()) if n not in have]
    assert not bad, bad
    cited = [n for f in files() for n in citations(open(f).read())]
    assert len(cited) > 40  # the pattern still matches the way the repository cites


def test_method_md_cites_only_its_own_sections():
    have = sections()
    text = flat(open(DOC).read())
    # "section 2.2", "sections 1-2", "(6.2.4, ...)", "(6.2.2, `kl_update`)"; not another file's ("toy.py section 3")
    refs = [m.group(1) for m in re.finditer(rf'(?<!\.py )(?<!\.md )\bsections? ({NUM})', text)]
    refs += [m.group(1) for m in re.finditer(r'\(([1-9]\d*\.\d+(?:\.\d+)?)[,)]', text)]
    bad = sorted({n for n in refs if n not in have})
    assert not bad, bad
