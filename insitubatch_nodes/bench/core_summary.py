"""The summary ``run_core`` prints under its table: the ratios against their targets,
first batches, memory and the loader's own metrics.

Read from the run's result and its ``CoreRuns``, so what is printed is what the JSON says.
"""

from __future__ import annotations

from typing import Any

from .common import fmt
from .core_config import RSS_SLACK, SPLIT, CoreConfig
from .core_report import CoreRuns, format_stacking, format_table, steady_state
from .peers import format_peers


def print_summary(result: dict[str, Any], runs: CoreRuns, cfg: CoreConfig) -> None:
    """The table, the floors, and the steady state's ratios against their targets."""
    split, floor, gfloor = result["split"], runs.floor, runs.gather
    r_floor, paired = result["steady_ratio_to_floor"], result["steady_paired_ratio_to_floor"]
    r_naive = result["steady_ratio_to_naive_2w"]
    naive_target = result["targets"]["ratio_to_naive_2w"]
    r_gfloor = result["steady_ratio_to_gather_floor"]
    print()
    print(f"split {SPLIT!r}: {split['chunks']} chunks of {split['samples_per_chunk']} samples, "
          f"{split['samples']} samples of {split['sample_nbytes'] / 1e3:,.0f} kB "
          f"({', '.join(split['variables'])}); batch "
          f"{cfg.batch_size}, block_chunks {runs.loader[0].extra['block_chunks']}"
          f"{'' if cfg.block_chunks else ' (auto)'}, max_inflight {cfg.max_inflight}; "
          f"naive paths over {runs.naive_subset} random samples; floors are the best of their "
          "passes")
    print(format_table(result["rows"]))
    print(f"\nread floor = {floor.name} ({floor.gb_per_s:.2f} GB/s)"
          + (f"; floor + one gather copy {gfloor.gb_per_s:.2f} GB/s = "
             f"{gfloor.samples_per_s / floor.samples_per_s:.2f}x floor" if gfloor else ""))
    print("loader epoch rates: " + ", ".join(f"{r.samples_per_s:,.0f}" for r in runs.loader)
          + " samples/s; steady state = best epoch after the first")
    ok = "OK" if r_floor >= 0.9 else "BELOW"
    line = (f"steady state: {r_floor:.2f}x floor (median paired {fmt(paired, '.2f')}x) "
            f"[{ok} target 0.9]")
    if r_naive is not None:
        tgt = (f" [{'OK' if r_naive >= naive_target else 'BELOW'} target {naive_target:g} at "
               f"{split['samples_per_chunk']} samples/chunk]" if naive_target else "")
        line += f"; {r_naive:.1f}x naive 2 workers{tgt}"
    print(line)
    if r_gfloor is not None:
        print(f"steady state vs floor + one gather copy: {r_gfloor:.2f}x (median paired "
              f"{fmt(result['steady_paired_ratio_to_gather_floor'], '.2f')}x)")
    if result["channels"] is not None:
        print(format_stacking(result["channels"]))
    print(format_peers(runs.peer_rows, len(runs.loader)))


def print_loader_details(result: dict[str, Any], runs: CoreRuns) -> None:
    """First batches (fresh, resumed), the loader's memory alone, and its metrics in the
    steady epoch: where its time went, with no model to hide the waits."""
    ttfb, probe = runs.first_batch, runs.probe
    rss_peak, bound = probe["peak_rss_bytes"], result["memory"]["resident_bound_bytes"]
    print(f"time to first batch: fresh loader {ttfb['first_batch_s']:.3f} s, after resume "
          f"(state after {ttfb['resume_after_batches']} batches, "
          f"{ttfb['state_json_bytes']} B of JSON) {ttfb['first_batch_after_resume_s']:.3f} s")
    ledger = max(r.extra["ledger_peak_bytes"] for r in runs.loader)
    print(f"loader memory, alone in a fresh process (2 epochs): peak RSS {rss_peak / 1e6:,.0f} "
          f"MB, of which {probe['import_rss_bytes'] / 1e6:,.0f} MB is python + imports (target "
          f"<= resident bound {bound / 1e6:,.0f} MB + 400 MB = {(bound + RSS_SLACK) / 1e6:,.0f} "
          f"MB: {'OK' if rss_peak <= bound + RSS_SLACK else 'ABOVE'}); decoded resident peak "
          f"{ledger / 1e6:,.0f} MB (ledger)")
    st = steady_state(runs.loader)[0].extra
    print(f"loader metrics, steady epoch: starvation {100 * st['starvation']:.0f}% (no model: "
          f"the loop only waits) | consumer s: fetch {st['consumer_wait_fetch_s']:.3f} "
          f"schedule {st['consumer_schedule_s']:.3f} shuffle {st['consumer_shuffle_s']:.3f} "
          f"gather {st['consumer_gather_s']:.3f} deliver {st['consumer_deliver_s']:.3f} | "
          f"fetcher stripe-s: store {st['fetch_store_s']:.2f} decode {st['fetch_decode_s']:.2f}")
