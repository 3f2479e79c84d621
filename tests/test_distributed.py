"""Rank partitions, equal steps, elastic resume, and the torchrun / Lightning recipes."""

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from stores import BLOSC, Var, write_store

import insitubatch_nodes as ib
from insitubatch_nodes.demo import DemoSpec, make_demo_store

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def uneven_source(tmp_path_factory):
    """13 chunks of 8 and a short last chunk of 3: no world size divides it evenly."""
    path = tmp_path_factory.mktemp("dist") / "s.zarr"
    write_store(path, [Var("x", (99, 3), (8, 3), compressors=BLOSC)])
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (1.0,))


def rank_epochs(src, m, world, n_epochs=1, **kw):
    loaders = [ib.build_loader(src, m, "train", rank=r, world_size=world, **kw)
               for r in range(world)]
    out = []
    for _ in range(n_epochs):
        out.append([[b["sample_index"].numpy().copy() for b in ld] for ld in loaders])
    for ld in loaders:
        ld.close()
    return out


def test_uneven_none_ranks_restored_past_their_share_stay_in_the_epoch(uneven_source):
    """uneven='none': checkpoint when rank 1 has served its whole share and rank 0 not yet.
    Restored, rank 1 must serve the (empty) rest of that epoch, not start the next one while
    rank 0 finishes: every later epoch is the split once over the ranks."""
    src, m = uneven_source
    kw = dict(batch_size=4, uneven="none", seed=5, world_size=2)
    loaders = [ib.build_loader(src, m, "train", rank=r, **kw) for r in range(2)]
    iters = [iter(ld) for ld in loaders]
    counts = [sum(1 for _ in ib.build_loader(src, m, "train", rank=r, **kw)) for r in range(2)]
    short = int(np.argmin(counts))
    steps = min(counts)
    for _ in range(steps):  # the short rank has served everything; the other has not
        for it in iters:
            next(it)
    assert counts[1 - short] > steps
    states = [ld.state_dict() for ld in loaders]
    for ld in loaders:
        ld.close()
    resumed = [ib.build_loader(src, m, "train", rank=r, **kw) for r in range(2)]
    for r, ld in enumerate(resumed):
        ld.load_state_dict(states[r])
    rest = [[i for b in ld for i in b["sample_index"].tolist()] for ld in resumed]
    assert rest[short] == [] and len(rest[1 - short]) > 0
    for _ in range(2):
        both = sorted(i for ld in resumed for b in ld for i in b["sample_index"].tolist())
        assert both == list(range(99))
    for ld in resumed:
        ld.close()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [5, 8])
def test_ranks_partition_each_epoch(uneven_source, world, batch):
    src, m = uneven_source
    epochs = rank_epochs(src, m, world, n_epochs=2, batch_size=batch, block_chunks=2,
                         uneven="none")
    shares = []
    for ranks in epochs:
        seen = np.concatenate([np.concatenate(b) for b in ranks]).tolist()
        assert sorted(seen) == list(range(99))  # disjoint and covering
        shares.append([set(np.concatenate(b).tolist()) for b in ranks])
    if world > 1:
        assert shares[0] != shares[1]  # re-dealt every epoch


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_pad_gives_equal_steps_and_loses_nothing(uneven_source, world, drop_last):
    src, m = uneven_source
    (ranks,) = rank_epochs(src, m, world, batch_size=5, block_chunks=2, drop_last=drop_last)
    steps = {len(b) for b in ranks}
    assert len(steps) == 1, steps  # DDP never waits on a finished rank
    assert {tuple(len(x) for x in b) for b in ranks}.__len__() == 1  # same batch sizes too
    seen = Counter(np.concatenate([np.concatenate(b) for b in ranks]).tolist())
    if not drop_last:
        assert set(seen) == set(range(99))
    (plain,) = rank_epochs(src, m, world, batch_size=5, block_chunks=2, uneven="none")
    for b, p in zip(ranks, plain, strict=True):  # a rank repeats only its own samples
        assert set(np.concatenate(b).tolist()) <= set(np.concatenate(p).tolist())


def test_drop_gives_equal_steps_without_repeats(uneven_source):
    src, m = uneven_source
    (ranks,) = rank_epochs(src, m, 3, batch_size=5, block_chunks=2, uneven="drop")
    assert len({len(b) for b in ranks}) == 1
    seen = np.concatenate([np.concatenate(b) for b in ranks]).tolist()
    assert len(seen) == len(set(seen))


def test_world_larger_than_split_is_an_error(uneven_source):
    src, m = uneven_source
    with pytest.raises(ValueError, match="world_size=14 exceeds the 13 chunks"):
        ib.build_loader(src, m, "train", rank=0, world_size=14)


def _elastic(src, m, w_before, w_after, k, **kw):
    before = [ib.build_loader(src, m, "train", rank=r, world_size=w_before, **kw)
              for r in range(w_before)]
    seen, states = [], []
    for ld in before:
        it = iter(ld)
        for _ in range(k):
            seen += next(it)["sample_index"].tolist()
        states.append(ld.state_dict())
    merged = json.loads(json.dumps(ib.merge_rank_states(states)))
    assert len(json.dumps(merged)) < 2048
    after = []
    for r in range(w_after):
        ld = ib.build_loader(src, m, "train", rank=r, world_size=w_after, **kw)
        ld.load_state_dict(merged)
        after.append(ld)
    rest = [[b["sample_index"].tolist() for b in ld] for ld in after]
    nxt = [[b["sample_index"].tolist() for b in ld] for ld in after]
    for ld in before + after:
        ld.close()
    return seen, rest, nxt


@pytest.mark.parametrize("w_after", [1, 3])
@pytest.mark.parametrize("k", [1, 4])
def test_elastic_resume_is_exactly_once(uneven_source, w_after, k):
    src, m = uneven_source
    seen, rest, nxt = _elastic(src, m, 2, w_after, k, batch_size=4, block_chunks=2,
                               uneven="none")
    after = [s for r in rest for b in r for s in b]
    assert sorted(seen + after) == list(range(99))
    # The following epoch runs normally on the new world size.
    assert sorted(s for r in nxt for b in r for s in b) == list(range(99))


def test_elastic_resume_with_padding_keeps_equal_steps(uneven_source):
    src, m = uneven_source
    seen, rest, _ = _elastic(src, m, 2, 3, 3, batch_size=4, block_chunks=2)
    assert len({len(r) for r in rest}) == 1
    after = [s for r in rest for b in r for s in b]
    assert set(seen + after) == set(range(99)) and not set(seen) & set(after)


def test_merge_refuses_mixed_epochs(uneven_source):
    src, m = uneven_source
    a = ib.build_loader(src, m, "train", rank=0, world_size=2)
    b = ib.build_loader(src, m, "train", rank=1, world_size=2)
    list(a)
    next(iter(a))
    next(iter(b))
    with pytest.raises(ValueError, match="different epochs"):
        ib.merge_rank_states([a.state_dict(), b.state_dict()])
    with pytest.raises(ValueError, match="not an insitubatch loader state"):
        ib.merge_rank_states([{"root": {}}])
    a.close()
    b.close()


# -- recipes in real subprocesses ---------------------------------------------------------

@pytest.fixture(scope="module")
def demo_store(once):
    """One store for the whole run: the stopped jobs' checkpoints name it."""
    spec = DemoSpec(n_times=200, n_lat=16, n_lon=32, time_chunk=8)
    return once("dist-demo", lambda f: make_demo_store(f / "d.zarr", spec,
                                                        progress=False)) / "d.zarr"


def _records(folder, world):
    return [[json.loads(x) for x in (folder / f"rank{r}.jsonl").read_text().splitlines()]
            for r in range(world)]


def _torchrun(nproc, *args, cwd):
    # --standalone: torchrun's rendezvous on a free port of its own choosing (a fixed port
    # can still be held by the previous job's store: EADDRINUSE on a busy machine).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(ROOT / "recipes" / "ddp_torchrun.py"), *args]
    # PYTHONFAULTHANDLER: should a rank abort, its threads' Python stacks are in the output.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=cwd, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def _uninterrupted(demo_store, world: int, *, epochs: int | None = None,
                   steps: int | None = None, batch_size: int = 16, **kw) -> list[list[dict]]:
    """Each rank's records of an uninterrupted run of the recipes (their loader, their loop:
    ``epochs`` as ddp_torchrun.py counts them, or the first ``steps`` as Lightning takes
    them), computed here instead of by a third run of the recipe."""
    source = ib.open_source(demo_store, variables=["t2m", "u10", "v10", "msl"])
    manifest = ib.split_by_chunk(source, fractions=(0.9, 0.1, 0.0), seed=0)
    ranks = []
    for rank in range(world):
        records: list[dict] = []
        with ib.build_loader(source, manifest, "train", batch_size=batch_size, block_chunks=8,
                             seed=0, rank=rank, world_size=world, **kw) as loader:
            while steps is None or len(records) < steps:
                batches = iter(loader)
                if epochs is not None and loader.epoch >= epochs:
                    break
                for batch in batches:
                    records.append({"step": len(records) + 1}
                                   | ({"epoch": loader.epoch} if epochs is not None else {})
                                   | {"samples": batch["sample_index"].tolist()})
                    if len(records) == steps:
                        break
        ranks.append(records)
    return ranks


def _late(demo_store, folder, uneven: str) -> list[str]:
    """ddp_torchrun.py's arguments for the runs that stop late in the epoch."""
    return ["--store", str(demo_store), "--every", "1", "--epochs", "2", "--batch-size", "8",
            "--checkpoint", str(folder / "c.pt"), "--uneven", uneven]


@pytest.fixture(scope="module")
def stopped_late(demo_store, once):
    """``stopped_late(uneven, tmp_path)``: 2 ranks stopped after step 11 of 12 (checkpoint
    ``c.pt``, records in ``before/``), copied into ``tmp_path`` to resume from. The stopped
    job runs once per ``uneven`` in the whole run (``once``: whichever test process asks
    first): an exact and an elastic resume share it."""

    def stopped(uneven: str, tmp_path: Path) -> Path:
        def stop(folder: Path) -> None:
            _torchrun(2, *_late(demo_store, folder, uneven), "--stop-after", "11",
                      "--record", str(folder / "before"), cwd=folder)

        done = once(f"stopped-{uneven}", stop)
        shutil.copy(done / "c.pt", tmp_path / "c.pt")
        shutil.copytree(done / "before", tmp_path / "before")
        return tmp_path

    return stopped


@pytest.mark.torchrun
def test_torchrun_recipe_resume_is_exact(demo_store, stopped_late, tmp_path):
    """Stopped after step 11 and resumed on as many ranks: every rank records the steps,
    epochs and samples of an uninterrupted run."""
    stopped_late("pad", tmp_path)
    out = _torchrun(2, *_late(demo_store, tmp_path, "pad"), "--resume", "--record",
                    str(tmp_path / "before"), cwd=tmp_path)
    assert "resumed at step 11 from 2 ranks onto 2" in out and "done: 24 steps" in out
    assert _records(tmp_path / "before", 2) == _uninterrupted(demo_store, 2, epochs=2,
                                                              batch_size=8)


@pytest.mark.torchrun
@pytest.mark.parametrize("uneven", ["pad", "none"])
def test_torchrun_recipe_elastic_resume_late_in_the_epoch(demo_store, stopped_late, tmp_path,
                                                          uneven):
    """2 ranks stop after step 11 of 12: what is left is one rank's last batch, fewer
    windows than the 3 new ranks (a rank used to get nothing and crash). 3 ranks finish
    the epoch and run the next: every sample once (``pad``: plus at most one padded sample
    per rank), the same steps on every rank; with ``none`` the 3 ranks' next epoch has
    shares of 8, 8 and 7 batches, so one rank takes a zero-weight step."""
    stopped_late(uneven, tmp_path)
    out = _torchrun(3, *_late(demo_store, tmp_path, uneven), "--resume", "--record",
                    str(tmp_path / "after"), cwd=tmp_path)
    assert "resumed at step 11 from 2 ranks onto 3" in out and "done: 20 steps" in out
    src = ib.open_source(demo_store, variables=["t2m", "u10", "v10", "msl"])
    m = ib.split_by_chunk(src, fractions=(0.9, 0.1, 0.0))
    want = sorted(m.grid.samples_of(m.chunk_ids("train")).tolist())
    before = [s for r in _records(tmp_path / "before", 2) for x in r for s in x["samples"]]
    after = [[x for x in r if x["epoch"] == 0] for r in _records(tmp_path / "after", 3)]
    nxt = [[x for x in r if x["epoch"] == 1] for r in _records(tmp_path / "after", 3)]
    rest = [s for r in after for x in r for s in x["samples"]]
    assert not set(before) & set(rest) and len(before) == len(set(before))
    if uneven == "none":
        assert sorted(before + rest) == want  # exactly once
        assert sorted(s for r in nxt for x in r for s in x["samples"]) == want
        assert [len(r) for r in nxt] == [8, 8, 7]
    else:
        assert sorted(set(before + rest)) == want and len(rest) - len(set(rest)) <= 2
        for epoch in (after, nxt):  # equal steps, equal batch sizes
            assert len({tuple(len(x["samples"]) for x in r) for r in epoch}) == 1


def _lightning(demo_store, tmp_path, *args: str, devices: int = 1) -> None:
    """Run the Lightning recipe once; ``--record`` folders and checkpoints in ``tmp_path``."""
    extra = ["--devices", str(devices), "--strategy", "ddp"] if devices > 1 else []
    res = subprocess.run([sys.executable, str(ROOT / "recipes" / "lightning_datamodule.py"),
                          "--store", str(demo_store), *extra, *args],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def _stop_resume_and_compare(demo_store, tmp_path, stops: list[int], end: int,
                             devices: int = 1) -> None:
    """Stopped at each of ``stops`` in turn, every run after the first resuming from the
    checkpoint the one before saved at its stop, and on to ``end``: every rank records the
    steps an uninterrupted run takes (``_uninterrupted``: the recipe's loader). One chain,
    not a run from step 0 to each stop: the steps before a stop are taken once."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for k, steps in enumerate([*stops, end]):
        _lightning(demo_store, tmp_path, "--checkpoint", str(tmp_path / "a.ckpt"),
                   "--max-steps", str(steps), "--record", str(tmp_path / "a"),
                   *(["--resume"] if k else []), devices=devices)
    want = _uninterrupted(demo_store, devices, steps=end, keep_states=4)
    assert [len(r) for r in want] == [end] * devices
    for rank, (got, ref) in enumerate(zip(_records(tmp_path / "a", devices), want,
                                          strict=True)):
        first = next((k for k, (g, r) in enumerate(zip(got, ref, strict=False)) if g != r),
                     min(len(got), len(ref)))
        assert got == ref, (f"rank {rank}, step {first + 1} (stopped at steps {stops}): "
                            f"{got[first:first + 1]} != {ref[first:first + 1]}")


@pytest.mark.skipif(shutil.which("true") is None, reason="posix only")
def test_lightning_recipe_resume_is_exact(demo_store, tmp_path):
    pytest.importorskip("lightning")
    # Stopped mid-epoch, and (resumed from there) exactly at an epoch's end: Lightning's own
    # counters go on counting the old epoch while the loader starts the next; the recipe
    # counts itself (it crashed there).
    source = ib.open_source(demo_store, variables=["t2m", "u10", "v10", "msl"])
    manifest = ib.split_by_chunk(source, fractions=(0.9, 0.1, 0.0), seed=0)
    with ib.build_loader(source, manifest, "train", batch_size=16, block_chunks=8) as ld:
        n = sum(1 for _ in ld)
    _stop_resume_and_compare(demo_store, tmp_path, [5, n], max(16, n + 5))


@pytest.mark.skipif(shutil.which("true") is None, reason="posix only")
def test_lightning_recipe_resumes_each_ddp_rank_exactly(demo_store, tmp_path):
    """Lightning saves rank 0's data module state only: the recipe gathers every rank's
    into the checkpoint, so each rank resumes its own share (rank 1 refused rank 0's)."""
    pytest.importorskip("lightning")
    _stop_resume_and_compare(demo_store, tmp_path, [5], 12, devices=2)
