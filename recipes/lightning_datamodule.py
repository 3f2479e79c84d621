"""Recipe: a LightningDataModule over the loader, with the loader state in Lightning checkpoints.

    python recipes/lightning_datamodule.py --store demo-data/era5.zarr --max-steps 6
    python recipes/lightning_datamodule.py --store demo-data/era5.zarr --max-steps 20 --resume
    python recipes/lightning_datamodule.py --store wb2.zarr --channels temperature@500 \
        2m_temperature --max-steps 6

Any store with a sample (time) axis: ``--channels`` picks what is read and stacked (a
variable alone: every level of it; ``temperature@500``: one level; an anemoi variable by
name; default: the demo's four when the store has them, else every variable it serves),
checked before the trainer starts.

The training dataloader has a length (``len(loader)``: this rank's batches in the epoch), so
Lightning's progress bar shows the epoch's batches and, knowing where the epoch ends,
Lightning fetches no batch ahead of the step it trains: the loader's state at save time is
that of the batches trained. The data module saves it; Lightning stores it in its
checkpoint and hands it back on ``fit(ckpt_path=...)``, and the resumed run continues
mid-epoch with exactly the batches the interrupted one would have seen. Under DDP
(``--devices N --strategy ddp``) the loader takes its rank from the trainer, and the
checkpoint holds every rank's state (Lightning saves rank 0's data module state only): each
rank resumes its own on as many devices, and on another number they are merged
(``merge_rank_states``: the rest of the epoch re-dealt evenly).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import lightning as L
import torch
from torch import nn

import insitubatch_nodes as ib
from insitubatch_nodes.demo import VARIABLES
from insitubatch_nodes.nodes.channels import resolve_channels


class _Epochs:
    """An iterable of epochs without ``state_dict``, so only the data module checkpoints.

    ``__iter__`` is a generator: Lightning calls ``iter()`` once just to check that the
    object is iterable, and an eager ``iter(loader)`` there would spend an epoch (or a
    loaded state) on that check. ``__len__`` is the loader's: this rank's batches in the
    epoch (a resumed one's whole epoch, as Lightning counts it), read by the progress bar
    and by Lightning to end the epoch without fetching a batch ahead.
    """

    def __init__(self, loader: ib.InSituLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        yield from self.loader


class ZarrDataModule(L.LightningDataModule):
    """Builds the loader once the trainer knows this process's rank."""

    def __init__(self, store: str, channels: list[str], batch_size: int = 16,
                 block_chunks: int = 8, seed: int = 0) -> None:
        super().__init__()
        self.store, self.channels = store, channels
        self.batch_size, self.block_chunks, self.seed = batch_size, block_chunks, seed
        self.loader: ib.InSituLoader | None = None
        self._pending: dict | None = None

    def setup(self, stage: str) -> None:
        source = ib.open_source(self.store)
        manifest = ib.split_by_chunk(source, fractions=(0.9, 0.1, 0.0), seed=self.seed)
        # channels=: only their variables are read; batch["channels"] is (batch, C, *space)
        self.loader = ib.build_loader(
            source, manifest, "train", batch_size=self.batch_size,
            block_chunks=self.block_chunks, seed=self.seed, channels=self.channels,
            rank=self.trainer.global_rank, world_size=self.trainer.world_size)
        if self.trainer.max_epochs == -1 and self.trainer.max_steps > 0:
            # max_steps alone leaves max_epochs at -1 (the progress bar's "Epoch 0/-2"):
            # the epochs max_steps spans, which stop no earlier than max_steps does
            self.trainer.fit_loop.max_epochs = math.ceil(self.trainer.max_steps
                                                         / max(len(self.loader), 1))
        if self._pending is not None:
            self.loader.load_state_dict(self._own(self._pending))
            self._pending = None

    def train_dataloader(self) -> _Epochs:
        # Hidden from Lightning's own loader checkpointing; see state_dict.
        assert self.loader is not None, "setup() builds the loader"
        return _Epochs(self.loader)

    def state_dict(self) -> dict:
        """The loader's state after the batches the trainer trained on (with the epoch's
        length known, Lightning fetches none ahead). Under DDP every rank's state goes into
        the checkpoint: Lightning saves rank 0's data module state only, and each rank must
        resume its own share."""
        if self.loader is None:
            return {}
        mine = self.loader.state_dict()
        if self.trainer.world_size == 1:
            return {"loader": mine}
        states: list = [None] * self.trainer.world_size
        torch.distributed.all_gather_object(states, mine)  # every rank saves (a collective)
        return {"loader_ranks": states}

    def _own(self, state: dict) -> dict:
        """This rank's state: its own on the same number of ranks (the exact resume), the
        ranks' states merged on another (an elastic resume: the rest re-dealt evenly)."""
        if "loader_ranks" not in state:
            return state["loader"]
        states = state["loader_ranks"]
        if len(states) == self.trainer.world_size:
            return states[self.trainer.global_rank]
        return ib.merge_rank_states(states)

    def load_state_dict(self, state: dict) -> None:
        if "loader" not in state and "loader_ranks" not in state:
            return
        if self.loader is not None:
            self.loader.load_state_dict(self._own(state))
        else:
            self._pending = state  # applied once setup() has built the loader

    def teardown(self, stage: str) -> None:
        if self.loader is not None:
            self.loader.close()


class TinyModel(L.LightningModule):
    """Per-point MLP from the other channels to the first (from the first itself when it
    is the only one): runs on lat-lon grids and flattened cells alike."""

    def __init__(self, channels: int, record: str | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(max(channels - 1, 1), 8, 1), nn.GELU(),
                                 nn.Conv1d(8, 1, 1))
        self.record = record

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # each channel standardized over the batch: a stand-in that needs no statistics
        # pass (for real training: stats=ib.compute_stats(...) in build_loader)
        x = batch["channels"].flatten(2).float()  # (batch, C, points)
        x = (x - x.mean(dim=(0, 2), keepdim=True)) / (x.std(dim=(0, 2), keepdim=True) + 1e-6)
        loss = nn.functional.mse_loss(self.net(x[:, 1:] if x.shape[1] > 1 else x), x[:, :1])
        if self.record:
            with open(Path(self.record) / f"rank{self.global_rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": self.global_step + 1,
                                    "samples": batch["sample_index"].tolist()}) + "\n")
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class SaveAtLastStep(L.Callback):
    """Saves the checkpoint after the last step's batch, as a checkpoint callback does
    mid-epoch: saved after ``fit`` returns, Lightning's counters would hold the interrupted
    epoch as finished, and the resumed run would count one epoch too many."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step >= trainer.max_steps:
            trainer.save_checkpoint(self.path)


def pick_channels(p: argparse.ArgumentParser, store: str, given: list[str] | None,
                  ) -> list[str]:
    """The channels asked for (default: the demo's four when the store has them all, else
    every variable it serves), checked against the store: a mistake is a usage error."""
    source = ib.open_source(store)
    if given:
        names = list(given)
    elif set(VARIABLES) <= set(source.names):
        names = list(VARIABLES)
    elif source.format == "anemoi":
        names = list(source.variables[0].labels or ())
    else:
        names = list(source.names)
    try:
        return [ch.label for ch in resolve_channels(source, names)]
    except (KeyError, ValueError, TypeError) as e:
        p.error(f"--channels: {e.args[0] if e.args else e}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default="demo-data/era5.zarr")
    p.add_argument("--channels", "--variables", nargs="+", default=None, dest="channels",
                   help="channels to stack: a variable (every level of it), a level "
                        "(temperature@500) or an anemoi variable (2t); default: the demo's "
                        "four when the store has them, else every variable of the store")
    p.add_argument("--checkpoint", default="demo-data/lightning.ckpt")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--record", default=None)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="auto")
    args = p.parse_args(argv)
    if args.resume and not Path(args.checkpoint).is_file():
        p.error(f"--resume: there is no checkpoint at {args.checkpoint!r}; run once without "
                "--resume to write one, or give its path with --checkpoint")
    if args.record:
        Path(args.record).mkdir(parents=True, exist_ok=True)
    channels = pick_channels(p, args.store, args.channels)  # before the trainer starts
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=args.max_steps, accelerator="cpu", devices=args.devices,
                        strategy=args.strategy, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[SaveAtLastStep(args.checkpoint)])
    trainer.fit(TinyModel(len(channels), args.record),
                datamodule=ZarrDataModule(args.store, channels),
                ckpt_path=args.checkpoint if args.resume else None)
    print(f"saved {args.checkpoint} at step {trainer.global_step}")


if __name__ == "__main__":
    main()
