"""Recipe: a LightningDataModule over the loader, with the loader state in Lightning checkpoints.

    python recipes/lightning_datamodule.py --store demo-data/era5.zarr --max-steps 6
    python recipes/lightning_datamodule.py --store demo-data/era5.zarr --max-steps 20 --resume

Lightning fetches one batch ahead of the step it checkpoints, so the loader's *current*
state is one batch too far at save time (Lightning would save that and skip a batch on
resume). The data module therefore keeps the last few states (``keep_states``) and saves the
one that matches the batches the trainer actually completed; Lightning stores it in its
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
from pathlib import Path

import lightning as L
import torch
from torch import nn

import insitubatch_nodes as ib


class _Epochs:
    """An iterable of epochs without ``state_dict``, so only the data module checkpoints.

    ``__iter__`` is a generator: Lightning calls ``iter()`` once just to check that the
    object is iterable, and an eager ``iter(loader)`` there would spend an epoch (or a
    loaded state) on that check. It counts what it handed out this epoch, and whether the
    epoch ran out: Lightning takes one batch more than it has trained on unless it did.
    """

    def __init__(self, loader: ib.InSituLoader) -> None:
        self.loader = loader
        self.handed = 0
        self.exhausted = False

    def __iter__(self):
        self.handed, self.exhausted = 0, False
        for batch in self.loader:
            self.handed += 1
            yield batch
        self.exhausted = True


class ZarrDataModule(L.LightningDataModule):
    """Builds the loader once the trainer knows this process's rank."""

    def __init__(self, store: str, batch_size: int = 16, block_chunks: int = 8,
                 seed: int = 0) -> None:
        super().__init__()
        self.store, self.batch_size, self.block_chunks, self.seed = (store, batch_size,
                                                                      block_chunks, seed)
        self.loader: ib.InSituLoader | None = None
        self._pending: dict | None = None

    def setup(self, stage: str) -> None:
        source = ib.open_source(self.store, variables=["t2m", "u10", "v10", "msl"])
        manifest = ib.split_by_chunk(source, fractions=(0.9, 0.1, 0.0), seed=self.seed)
        self.loader = ib.build_loader(
            source, manifest, "train", batch_size=self.batch_size,
            block_chunks=self.block_chunks, seed=self.seed,
            rank=self.trainer.global_rank, world_size=self.trainer.world_size, keep_states=4)
        if self._pending is not None:
            self.loader.load_state_dict(self._own(self._pending))
            self._pending = None

    def train_dataloader(self) -> _Epochs:
        # Hidden from Lightning's own (one-batch-late) loader checkpointing; see state_dict.
        self._epochs = _Epochs(self.loader)
        return self._epochs

    def state_dict(self) -> dict:
        """The loader's state after the batches the trainer completed: one before the
        loader's own, unless the epoch ran out (Lightning fetches one ahead to see the
        end). Counted here, not from Lightning's progress counters: after a resume at an
        epoch's end those keep counting the old epoch while the loader starts a new one.
        Under DDP every rank's state goes into the checkpoint: Lightning saves rank 0's
        data module state only, and each rank must resume its own share."""
        if self.loader is None:
            return {}
        now = self.loader.state_dict()
        epochs = getattr(self, "_epochs", None)
        ahead = epochs is not None and epochs.handed > 0 and not epochs.exhausted
        mine = self.loader.state_dict_at(now["num_yielded"] - 1) if ahead else now
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
    def __init__(self, record: str | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.AvgPool2d(4), nn.Conv2d(3, 8, 3, padding=1), nn.GELU(),
                                 nn.Conv2d(8, 1, 3, padding=1))
        self.record = record
        self.register_buffer("offset", torch.tensor([0.0, 0.0, 101325.0]).view(1, 3, 1, 1))
        self.register_buffer("scale", torch.tensor([8.0, 5.0, 1500.0]).view(1, 3, 1, 1))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = (torch.stack([batch["u10"], batch["v10"], batch["msl"]], 1) - self.offset) / self.scale
        y = nn.functional.avg_pool2d(((batch["t2m"] - 288.0) / 20.0)[:, None], 4)
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.record:
            with open(Path(self.record) / f"rank{self.global_rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": self.global_step + 1,
                                    "samples": batch["sample_index"].tolist()}) + "\n")
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default="demo-data/era5.zarr")
    p.add_argument("--checkpoint", default="demo-data/lightning.ckpt")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--record", default=None)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="auto")
    args = p.parse_args()
    if args.resume and not Path(args.checkpoint).is_file():
        p.error(f"--resume: there is no checkpoint at {args.checkpoint!r}; run once without "
                "--resume to write one, or give its path with --checkpoint")
    if args.record:
        Path(args.record).mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=args.max_steps, accelerator="cpu", devices=args.devices,
                        strategy=args.strategy, logger=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(TinyModel(args.record), datamodule=ZarrDataModule(args.store),
                ckpt_path=args.checkpoint if args.resume else None)
    trainer.save_checkpoint(args.checkpoint)
    print(f"saved {args.checkpoint} at step {trainer.global_step}")


if __name__ == "__main__":
    main()
