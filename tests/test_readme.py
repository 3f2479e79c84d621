"""README.md is a reference a user reads in ten minutes, and its examples run as written.

Every ```python block runs alone in a fresh interpreter, in an empty directory, twice in a
row (a rerun must work too), with warnings as errors. Blocks fenced ```python skip need
credentials, servers or a GPU: they are shown, not run.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_LINES = 450


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def parse(text: str) -> tuple[list[tuple[int, str]], list[tuple[str, str, str]], str]:
    """(level, title) of every heading, (info string, nearest heading, code) of every fenced
    block, and the prose (the text outside fences)."""
    headings, blocks, prose = [], [], []
    fence = None
    for line in text.splitlines():
        if fence is None and line.startswith("```"):
            fence = (line[3:].strip(), headings[-1][1] if headings else "", [])
        elif fence is not None and line.startswith("```"):
            blocks.append((fence[0], fence[1], "\n".join(fence[2]) + "\n"))
            fence = None
        elif fence is not None:
            fence[2].append(line)
        else:
            prose.append(line)
            if m := re.match(r"(#+) (.+)", line):
                headings.append((len(m[1]), m[2]))
    assert fence is None, "README.md has an unclosed ``` fence"
    return headings, blocks, "\n".join(prose)


HEADINGS, BLOCKS, PROSE = parse(README)


def python_blocks() -> list:
    params, seen = [], {}
    for info, heading, code in BLOCKS:
        if info != "python":
            continue
        name = slug(heading)
        seen[name] = seen.get(name, 0) + 1
        name = name if seen[name] == 1 else f"{name}-{seen[name]}"
        params.append(pytest.param(name, code, id=name))
    return params


@pytest.mark.parametrize(("name", "code"), python_blocks())
def test_python_block_runs_alone_twice(name, code, tmp_path):
    listings = []
    for run in ("first", "second"):
        done = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            pytest.fail(f"README block under {name!r}, {run} run, exit {done.returncode}:\n"
                        f"{done.stderr}")
        listings.append(sorted(os.listdir(tmp_path)))
    assert listings[0] == listings[1], "the rerun left other files than the first run"


def test_python_blocks_exist_and_skipped_ones_compile():
    assert len(python_blocks()) >= 5
    skipped = [(heading, code) for info, heading, code in BLOCKS if info == "python skip"]
    assert skipped
    for heading, code in skipped:
        compile(code, f"README.md, block under {heading!r}", "exec")


def test_length():
    n = len(README.splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; at most {MAX_LINES}"


def test_table_of_contents_matches_headings():
    links = re.findall(r"^- \[[^\]]+\]\(#([^)]+)\)", README, flags=re.M)
    sections = [slug(title) for level, title in HEADINGS if level == 2]
    assert links, "no table of contents"
    assert sections.index("contents") < 3, "the table of contents is not near the top"
    assert links == [s for s in sections if s != "contents"]
    anchors = {slug(title) for _, title in HEADINGS}
    for target in re.findall(r"\]\(#([^)]+)\)", README):
        assert target in anchors, f"link to #{target}: no such heading"


def test_no_revision_hashes_or_dated_runs():
    # a commit id: 7 to 40 lower-case hex digits with at least one digit and one letter
    hashes = re.findall(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", README)
    assert not hashes, f"revision hashes in README.md: {hashes}"
    dates = re.findall(r"\b(?:19|20)\d\d-\d\d-\d\d\b", PROSE)
    assert not dates, f"dated runs in README.md (history goes to docs/benchmarks.md): {dates}"


def test_links_to_design_and_benchmarks():
    for target in ("DESIGN.md", "docs/benchmarks.md"):
        assert f"]({target})" in README, f"README.md does not link to {target}"
        assert (ROOT / target).is_file(), f"{target} is missing"
    for path in re.findall(r"\]\(([\w./-]+\.(?:md|py|png))\)", README):
        assert (ROOT / path).is_file(), f"README.md links to {path}, which does not exist"
    # the scripts, recipes and benchmarks it names exist
    for path in re.findall(r"\b((?:scripts|recipes)/[\w.-]+)", README):
        assert (ROOT / path).is_file(), f"README.md names {path}, which does not exist"
    for module in re.findall(r"python -m (benchmarks\.\w+)", README):
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), f"no module {module}"


def test_examples_use_public_names_only():
    for info, heading, code in BLOCKS:
        if info.startswith("python"):
            assert not re.search(r"insitubatch_nodes\.\w", code), (
                f"block under {heading!r} reaches into a submodule: use `ib.<name>`")


def test_readme_resume_loop_from_any_batch(tmp_path):
    """The README's loop, ``for epoch in range(loader.epoch, n_epochs): for batch in loader``,
    resumed from a state saved after any batch (an epoch's last one included) serves exactly
    the batches an uninterrupted run serves."""
    import numpy as np
    import xarray as xr

    import insitubatch_nodes as ib

    t2m = np.zeros((64, 4, 8), "float32")
    xr.Dataset({"t2m": (("time", "lat", "lon"), t2m)}).to_zarr(
        tmp_path / "t2m.zarr", consolidated=False, encoding={"t2m": {"chunks": (8, 4, 8)}})
    source = ib.open_source(tmp_path / "t2m.zarr")
    manifest = ib.split_by_chunk(source, fractions=(1.0,), seed=0)

    def run(state=None, n_epochs=2):
        seen, states = [], []
        with ib.build_loader(source, manifest, "train", batch_size=16) as loader:
            if state is not None:
                loader.load_state_dict(state)
            for _ in range(loader.epoch, n_epochs):
                for batch in loader:
                    seen.append(batch["sample_index"].tolist())
                    states.append(loader.state_dict())
        return seen, states

    full, states = run()
    assert len(full) == 2 * 4
    for k in (2, 4, 5):  # within epoch 0, after its last batch, within epoch 1
        assert full[:k] + run(states[k - 1])[0] == full, f"resumed after batch {k}"
