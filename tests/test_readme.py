"""The README's Python examples are run as written, in order, in a scratch directory."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_examples_run(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    # "```python skip" blocks need credentials or servers: shown, not run.
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), scope)  # noqa: S102
    assert scope["first"]["t2m"].shape == (32, 32, 64)
    # loaded and not iterated yet: the loader stands where the loaded state says
    assert scope["resumed"].state_dict() == scope["state"]
