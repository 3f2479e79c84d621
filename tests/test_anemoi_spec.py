"""``open_anemoi``: anemoi-datasets' ``open_dataset`` specs (a path, a dict, YAML text of a
training config's ``dataset:`` entry) opened as one source with anemoi's semantics.

The expectations are written out by hand from anemoi-datasets' code (``usage/misc.py``
``_as_date`` / ``round_datetime``, ``usage/dataset.py`` ``__subset`` /
``_frequency_to_indices``, ``usage/gridded/join.py`` ``_overlay``, ``concat.py``), and every
value is checked against the members' own arrays read with zarr (``anemoi_stores``)."""

from __future__ import annotations

import datetime

import numpy as np
import pytest
from anemoi_stores import read_anemoi, write_anemoi

import insitubatch_nodes as ib
from insitubatch_nodes.errors import ConfigError, InsitubatchError
from insitubatch_nodes.store.anemoi_spec import (
    SUPPORTED,
    open_anemoi,
    parse_frequency,
    parse_spec,
    resolve_date,
)

H = np.timedelta64(1, "h")


def t(text: str) -> np.datetime64:
    return np.datetime64(text, "s")


# -- parsing -------------------------------------------------------------------------------


def test_a_dict_spec_is_parsed_into_its_options():
    spec = parse_spec({"dataset": "a.zarr", "start": 2020, "end": "2020-03", "frequency": "12h",
                       "select": ["msl", "2t"], "drop": "lsm", "rename": {"2t": "t2m"}})
    assert spec.kind == "dataset" and spec.where == "spec"
    (member,) = spec.members
    assert (member.kind, member.path, member.where) == ("path", "a.zarr", "spec.dataset")
    o = spec.options
    assert (o.start, o.end, o.frequency) == (2020, "2020-03", np.timedelta64(12 * 3600, "s"))
    assert o.select == ("msl", "2t") and not o.select_in_store_order
    assert o.drop == ("lsm",) and o.rename == (("2t", "t2m"),)
    # a set keeps the store's order (resolved when the store is open)
    assert parse_spec({"dataset": "a.zarr", "select": {"msl", "2t"}}).options.select_in_store_order
    # a path alone, as text or a PathLike; a URL is a path, not YAML
    assert parse_spec("a.zarr").path == "a.zarr"
    assert parse_spec("s3://bucket/era5.zarr").path == "s3://bucket/era5.zarr"


YAML_WHOLE = """
dataset:
  concat:
    - join:
        - surface.zarr
        - {dataset: levels.zarr, select: [t_500, z_500]}
    - dataset: late.zarr
      drop: [lsm]
start: 2020
end: 2020-06
frequency: 12h
"""

YAML_VALUE = """
concat:
  - join:
      - surface.zarr
      - {dataset: levels.zarr, select: [t_500, z_500]}
  - dataset: late.zarr
    drop: [lsm]
"""


def test_yaml_of_the_whole_dataset_entry_or_the_value_under_it():
    whole = parse_spec(YAML_WHOLE)
    assert whole.kind == "dataset" and whole.options.end == "2020-06"
    assert whole.options.frequency == np.timedelta64(12 * 3600, "s")
    (inner,) = whole.members
    value = parse_spec(YAML_VALUE)
    for concat, at in ((inner, "spec.dataset"), (value, "spec")):
        assert concat.kind == "concat" and concat.where == at
        join, late = concat.members
        assert join.kind == "join" and join.where == f"{at}.concat[0]"
        assert [m.path for m in join.members] == ["surface.zarr", None]
        assert join.members[1].options.select == ("t_500", "z_500")
        assert join.members[1].members[0].path == "levels.zarr"
        assert late.options.drop == ("lsm",) and late.where == f"{at}.concat[1]"


@pytest.mark.parametrize("key", ["cutout", "grids", "ensembles", "complement", "merge",
                                 "interpolate_frequency", "adjust", "fill_missing_dates",
                                 "statistics", "reorder", "thinning", "area"])
def test_other_keys_are_refused_naming_them_and_what_is_supported(key):
    with pytest.raises(ConfigError, match=rf"spec has key\(s\) \['{key}'\].*supported keys: "
                       rf"\['dataset', 'datasets', 'join', 'concat'") as e:
        parse_spec({"dataset": "a.zarr", key: True})
    assert all(k in str(e.value) for k in SUPPORTED)
    # nested: the place in the spec is named
    with pytest.raises(ConfigError, match=rf"spec.join\[1\] has key\(s\) \['{key}'\]"):
        parse_spec({"join": ["a.zarr", {"dataset": "b.zarr", key: 1}]})
    with pytest.raises(ConfigError, match=rf"spec.dataset has key\(s\) \['{key}'\]"):
        parse_spec(f"dataset:\n  {key}: [a.zarr, b.zarr]\n")


@pytest.mark.parametrize("spec, match", [
    ({"join": ["a.zarr"], "concat": ["b.zarr"]}, r"spec has \['join', 'concat'\] of"),
    ({"select": ["2t"]}, r"spec has none of \['dataset', 'datasets', 'join', 'concat'\]"),
    ({"join": "a.zarr"}, r"spec.join is 'a.zarr'; it takes a non-empty list"),
    ({"concat": []}, r"spec.concat is \[\]; it takes a non-empty list"),
    ({"join": ["a.zarr"], "fill_missing_gaps": True}, r"fill_missing_gaps is True; .*concat"),
    ({"dataset": "a.zarr", "select": []}, r"spec.select is \[\]; .*not empty"),
    ({"dataset": "a.zarr", "select": [1]}, r"spec.select is \[1\]; it takes a variable name"),
    ({"dataset": "a.zarr", "rename": ["2t"]}, r"spec.rename is \['2t'\]; it maps old names"),
    ({"dataset": "${paths.data}/era5.zarr"}, r"unresolved interpolation"),
    ({"dataset": 3}, r"spec.dataset is 3 \(int\); a dataset is a path"),
    ("dataset: [a.zarr\n", r"not valid YAML"),
])
def test_malformed_specs_are_refused_naming_the_place_and_what_is_valid(spec, match):
    with pytest.raises(InsitubatchError, match=match):
        parse_spec(spec)


# Frequencies as anemoi-utils' frequency_to_timedelta reads them: ints and digits are hours,
# "m" is minutes.
@pytest.mark.parametrize("value, seconds", [
    (6, 6 * 3600), ("6", 6 * 3600), ("6h", 6 * 3600), ("6H", 6 * 3600), ("1d", 86400),
    ("30m", 1800), ("10s", 10), ("1:30", 5400), ("1:30:15", 5415), (" +12h ", 12 * 3600),
    (datetime.timedelta(hours=3), 3 * 3600), (np.timedelta64(12, "h"), 12 * 3600),
])
def test_frequencies_are_read_as_anemoi_reads_them(value, seconds):
    assert parse_frequency(value) == np.timedelta64(seconds, "s")


@pytest.mark.parametrize("value", [0, -6, "6x", "1.5h", True, None, "-6h", 2.5])
def test_a_bad_frequency_is_refused_listing_the_forms(value):
    with pytest.raises(ConfigError, match=r"spec.frequency is .*; a frequency is a positive "
                       r"whole number of seconds: hours \(6, '6'\), '6h', '1d'"):
        parse_spec({"dataset": "a.zarr", "frequency": value})


# 6-hourly dates from 2019-12-30T00 to 2021-01-02T18 (1480 of them)
DATES = t("2019-12-30T00:00:00") + np.arange(4 * 370) * 6 * H


@pytest.mark.parametrize("value, first, last", [
    # a year: from its first date to its last (end=2020 with 6-hourly dates: 2020-12-31T18)
    (2020, "2020-01-01T00", "2020-12-31T18"), ("2020", "2020-01-01T00", "2020-12-31T18"),
    # a month, as an int, digits or YYYY-MM
    (202002, "2020-02-01T00", "2020-02-29T18"), ("202002", "2020-02-01T00", "2020-02-29T18"),
    ("2020-02", "2020-02-01T00", "2020-02-29T18"), ("2020-12", "2020-12-01T00", "2020-12-31T18"),
    # a day, as an int, digits, YYYY-MM-DD or a date
    (20200229, "2020-02-29T00", "2020-02-29T18"), ("2020-02-29", "2020-02-29T00", "2020-02-29T18"),
    (datetime.date(2020, 12, 31), "2020-12-31T00", "2020-12-31T18"),
    # an instant between dates: the next date for a start, the one before for an end
    ("2020-02-29T07:00:00", "2020-02-29T12", "2020-02-29T06"),
    ("2020-02-29 12:00:00", "2020-02-29T12", "2020-02-29T12"),
    (datetime.datetime(2020, 2, 29, 7), "2020-02-29T12", "2020-02-29T06"),
    (np.datetime64("2020-02-29T13:30"), "2020-02-29T18", "2020-02-29T12"),
    # before or past every date: round_datetime gives the nearest end
    (2018, "2019-12-30T00", "2019-12-30T00"), (2022, "2021-01-02T18", "2021-01-02T18"),
])
def test_start_and_end_are_resolved_as_anemoi_does(value, first, last):
    assert resolve_date(value, DATES, last=False) == t(first)
    assert resolve_date(value, DATES, last=True) == t(last)


def test_a_share_of_the_dates():
    dates = DATES[:7]  # 50 % of 7 dates is 3.5: a start at index 3, an end at index 2
    assert resolve_date("50%", dates, last=False) == dates[3]
    assert resolve_date("50%", dates, last=True) == dates[2]
    assert resolve_date("0%", dates, last=False) == dates[0]
    assert resolve_date("100%", dates, last=True) == dates[-1]


@pytest.mark.parametrize("value", ["2020-13", 12345, "yesterday", 2020.5, True,
                                   "2020-01-01T06:00", "2020-02-30", [2020]])
def test_a_bad_date_is_refused_listing_the_forms(value):
    with pytest.raises(ConfigError, match=r"spec.end is .*; a date is a year \(2020, '2020'\), "
                       r"a month \(202003, '2020-03'\)"):
        parse_spec({"dataset": "a.zarr", "end": value})


# -- opened on stores in anemoi's layout ---------------------------------------------------

SURF = ("2t", "msl", "10u", "10v", "lsm")
LEV = ("t_500", "z_500", "t_850", "2t")  # "2t" again: a join takes this one's values


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Every store the tests open, written once (offsets tell the stores apart by value)."""
    root = tmp_path_factory.mktemp("anemoi")
    write_anemoi(root / "surface.zarr", SURF, "2020-01-01", 40)
    write_anemoi(root / "levels.zarr", LEV, "2020-01-01", 40, missing=(9,), offset=1e5)
    write_anemoi(root / "twice-daily.zarr", SURF, "2020-01-01", 20, frequency_hours=12)
    write_anemoi(root / "shifted.zarr", LEV, "2020-01-01T06", 40, offset=1e5)
    write_anemoi(root / "early.zarr", SURF, "2020-01-01", 20, dates_chunk=4)
    write_anemoi(root / "late.zarr", SURF, "2020-01-06", 20, missing=(3,), offset=0.25)
    write_anemoi(root / "after-gap.zarr", SURF, "2020-01-07", 12, offset=0.5)
    write_anemoi(root / "early-levels.zarr", LEV, "2020-01-01", 20, offset=1e5)
    write_anemoi(root / "late-levels.zarr", LEV, "2020-01-06", 20, offset=2e5)
    return root


def stored(root, name):
    return read_anemoi(root / f"{name}.zarr")


def columns(root, name, names):
    """(dates, names, ensemble, cells) of store ``name``, by hand."""
    s = stored(root, name)
    return np.stack([s.column(n) for n in names], axis=1)


def served(src, **kw):
    """{sample index: (batch['data'] row, date)} over one epoch of a loader on ``src``."""
    loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=3,
                             seed=0, **kw)
    out = {}
    for b in loader:
        for i, row, when in zip(b["sample_index"].numpy(), b["data"].numpy(),
                                b["time"].numpy(), strict=True):
            assert int(i) not in out
            out[int(i)] = (row, np.datetime64(int(when), "ns"))
    return out


def check(src, names, dates, values, missing=()):
    """``src`` serves ``names`` on ``dates`` with ``missing``, and a loader's batches carry
    exactly ``values`` at every sample of a chunk without a missing date."""
    assert src.served_names() == tuple(names)
    np.testing.assert_array_equal(np.asarray(src.sample_coord).astype("M8[s]"), dates)
    assert tuple(src.missing) == tuple(missing)
    got = served(src)
    size = src.grid.chunk_size  # splits leave out every chunk that holds a missing date
    spoilt = {i // size for i in missing}
    assert sorted(got) == [i for i in range(len(dates)) if i // size not in spoilt]
    for i, (row, when) in got.items():
        np.testing.assert_array_equal(row, values[i], err_msg=f"sample {i}")
        assert when == dates[i]


def test_a_join_of_a_surface_and_a_pressure_level_dataset(root):
    """anemoi's _overlay: 2t (in both) at the surface's place with the levels' values; the
    missing dates are both members' (the levels' date 9)."""
    s, lev = stored(root, "surface"), stored(root, "levels")
    assert ib.open_anemoi is open_anemoi
    src = open_anemoi({"join": [str(root / "surface.zarr"), str(root / "levels.zarr")]})
    names = ("2t", "msl", "10u", "10v", "lsm", "t_500", "z_500", "t_850")
    values = np.concatenate([lev.data[:, [3]], s.data[:, 1:], lev.data[:, :3]], axis=1)
    check(src, names, s.dates, values, missing=(9,))
    # a list under dataset: the same first and last dates join (anemoi's _concat_or_join)
    listed = open_anemoi({"dataset": [str(root / "surface.zarr"), str(root / "levels.zarr")]})
    assert listed.served_names() == names and listed.missing == (9,)
    # renamed in one member, both are kept
    src = open_anemoi({"join": [str(root / "surface.zarr"),
                                {"dataset": str(root / "levels.zarr"), "rename": {"2t": "2t_l"}}]})
    check(src, SURF + ("t_500", "z_500", "t_850", "2t_l"), s.dates,
          np.concatenate([s.data, lev.data], axis=1), missing=(9,))


def test_a_join_serving_none_of_its_first_members_variables(root):
    """A member whose only variable is overridden still brings its missing dates (anemoi's
    Join.missing is the union over every member); a select of the second member only."""
    s, lev = stored(root, "surface"), stored(root, "levels")
    src = open_anemoi({"join": [str(root / "surface.zarr"), str(root / "levels.zarr")],
                       "select": ["t_500"]})
    check(src, ("t_500",), s.dates, lev.data[:, [0]], missing=(9,))
    src = open_anemoi({"join": [{"dataset": str(root / "levels.zarr"), "select": ["2t"]},
                                str(root / "surface.zarr")]})
    check(src, SURF, s.dates, s.data, missing=(9,))


def test_a_concat_of_two_periods(root, monkeypatch):
    monkeypatch.chdir(root)  # paths relative to the working directory
    e, late = stored(root, "early"), stored(root, "late")
    src = open_anemoi({"concat": ["early.zarr", "late.zarr"]})
    check(src, SURF, np.concatenate([e.dates, late.dates]),
          np.concatenate([e.data, late.data]), missing=(23,))
    listed = open_anemoi(["early.zarr", "late.zarr"])  # different dates: concatenated
    assert listed.n_samples == 40 and listed.missing == (23,)
    # out of order, or a gap without fill_missing_gaps: refused as anemoi refuses them
    with pytest.raises(ConfigError, match=r"spec.concat\[0\] ends at 2020-01-10T18:00:00 and "
                       r"spec.concat\[1\] starts at 2020-01-01T00:00:00; concat takes members "
                       r"in date order"):
        open_anemoi({"concat": ["late.zarr", "early.zarr"]})
    with pytest.raises(ConfigError, match=r"starts at 2020-01-07T00:00:00; .*one step \(21600 "
                       r"seconds\).*fill_missing_gaps: true makes a gap missing dates"):
        open_anemoi({"concat": ["early.zarr", "after-gap.zarr"]})
    # with it, the gap's four dates are missing
    gap = stored(root, "after-gap")
    src = open_anemoi({"concat": ["early.zarr", "after-gap.zarr"], "fill_missing_gaps": True})
    dates = e.dates[0] + np.arange(36) * 6 * H
    values = np.concatenate([e.data, np.full((4,) + e.data.shape[1:], np.nan), gap.data])
    check(src, SURF, dates, values, missing=(20, 21, 22, 23))


YAML_SUBSET = """
dataset: surface.zarr
start: 2020-01-02
end: "2020-01-08"
frequency: 12h
select: [msl, 2t]
"""


def test_select_start_end_and_frequency(root, monkeypatch):
    """start/end by day (a YAML date and a string), then every 12 h from the first date
    kept, then select in the order given: anemoi's order of application."""
    monkeypatch.chdir(root)
    s = stored(root, "surface")
    rows = np.flatnonzero((s.dates >= t("2020-01-02T00:00:00"))
                          & (s.dates <= t("2020-01-08T18:00:00")))[::2]
    want = s.data[rows][:, [1, 0]]
    check(open_anemoi(YAML_SUBSET), ("msl", "2t"), s.dates[rows], want)
    # the value under dataset:, keys in another order: the same
    again = open_anemoi({"select": ["msl", "2t"], "frequency": 12, "end": 20200108,
                         "start": datetime.date(2020, 1, 2), "dataset": "surface.zarr"})
    check(again, ("msl", "2t"), s.dates[rows], want)
    # a set keeps the store's order
    src = open_anemoi({"dataset": "surface.zarr", "select": {"msl", "2t"}, "end": 2020})
    check(src, ("2t", "msl"), s.dates, s.data[:, :2])
    # start/end after frequency at an outer level: every 12 h of the dates kept, and a
    # frequency that is not a multiple of the stored 6 h refused
    src = open_anemoi({"dataset": {"dataset": "surface.zarr", "start": "2020-01-01 06:00:00"},
                       "frequency": "1d"})
    check(src, SURF, s.dates[1::4], s.data[1::4])
    with pytest.raises(ConfigError, match=r"spec.frequency is .*32400.*not a multiple of the "
                       r"dataset's frequency \(21600 seconds\)"):
        open_anemoi({"dataset": "surface.zarr", "frequency": "9h"})
    with pytest.raises(ConfigError, match=r"spec start '2020-01-05', end '2020-01-03' .*leave "
                       r"none of its dates"):
        open_anemoi({"dataset": "surface.zarr", "start": "2020-01-05", "end": "2020-01-03"})


def test_drop_and_rename(root, monkeypatch):
    monkeypatch.chdir(root)
    s = stored(root, "surface")
    check(open_anemoi({"dataset": "surface.zarr", "drop": ["10u", "lsm"]}),
          ("2t", "msl", "10v"), s.dates, s.data[:, [0, 1, 3]])
    # rename comes after select whatever the order of the keys: select names the stored 2t
    src = open_anemoi({"rename": {"2t": "t2m"}, "dataset": "surface.zarr", "select": ["lsm", "2t"]})
    check(src, ("lsm", "t2m"), s.dates, s.data[:, [4, 0]])
    with pytest.raises(ConfigError, match=r"spec.drop is \['sst'\]; the dataset has no \['sst'\]; "
                       r"its variables: \['2t', 'msl', '10u', '10v', 'lsm'\]"):
        open_anemoi({"dataset": "surface.zarr", "drop": ["sst"]})
    with pytest.raises(ConfigError, match=r"spec.join\[1\].select is \['t2m'\]; the dataset has "
                       r"no \['t2m'\]"):
        open_anemoi({"join": ["surface.zarr", {"dataset": "levels.zarr", "select": ["t2m"]}]})


def test_a_member_with_missing_dates(root, monkeypatch):
    """The levels' missing date 9 moves with the period cut from them, and is never
    served, alone or joined."""
    monkeypatch.chdir(root)
    lev = stored(root, "levels")
    assert lev.missing_dates == (lev.dates[9],)
    src = open_anemoi({"dataset": "levels.zarr", "start": "2020-01-02", "select": ["z_500"]})
    check(src, ("z_500",), lev.dates[4:], lev.data[4:, [1]], missing=(5,))
    s = stored(root, "surface")
    src = open_anemoi({"join": ["surface.zarr", "levels.zarr"], "start": "2020-01-02",
                       "end": "2020-01-04", "select": ["t_850", "msl"]})
    check(src, ("t_850", "msl"), s.dates[4:16],
          np.stack([lev.column("t_850")[4:16], s.column("msl")[4:16]], axis=1), missing=(5,))


YAML_NESTED = """
dataset:
  concat:
    - join: [early.zarr, early-levels.zarr]
    - join: [late.zarr, late-levels.zarr]
  start: 2020-01-03
  end: 2020-01-08
  frequency: 12h
  drop: [lsm, t_850]
"""


def test_a_concat_of_joins_with_options_after_both(root, monkeypatch):
    monkeypatch.chdir(root)
    names = ("2t", "msl", "10u", "10v", "t_500", "z_500")
    parts = []
    for surface, levels in (("early", "early-levels"), ("late", "late-levels")):
        lev = stored(root, levels)
        s = stored(root, surface)
        parts.append((s.dates, np.concatenate(
            [lev.data[:, [3]], s.data[:, 1:4], lev.data[:, :2]], axis=1)))
    dates = np.concatenate([p[0] for p in parts])
    values = np.concatenate([p[1] for p in parts])
    rows = np.flatnonzero((dates >= t("2020-01-03T00:00:00"))
                          & (dates <= t("2020-01-08T18:00:00")))[::2]
    missing = tuple(int(j) for j in np.flatnonzero(rows == 23))  # late's date 3
    check(open_anemoi(YAML_NESTED), names, dates[rows], values[rows], missing=missing)


def test_joins_anemoi_refuses_are_refused(root, monkeypatch):
    monkeypatch.chdir(root)
    with pytest.raises(ConfigError, match=r"the members of spec.join differ in frequency: "
                       r"spec.join\[0\] has 21600 seconds, spec.join\[1\] has 43200 seconds"):
        open_anemoi({"join": ["surface.zarr", "twice-daily.zarr"]})
    with pytest.raises(InsitubatchError, match=r"differs from member 0 .* at sample 0"):
        open_anemoi({"join": ["surface.zarr", "shifted.zarr"]})
    with pytest.raises(ConfigError, match=r"the members of spec.concat differ in variables"):
        open_anemoi({"concat": ["early.zarr", {"dataset": "late.zarr", "drop": "lsm"}]})
    import zarr

    zarr.create_array(root / "plain.zarr", shape=(4,), dtype="f4", overwrite=True)
    with pytest.raises(InsitubatchError):
        open_anemoi({"join": ["surface.zarr", "plain.zarr"]})


def test_statistics_follow_anemoi(root, monkeypatch):
    """join: each variable's own member's statistics (a variable in several: the last one's,
    as its values); concat: the first member's; rename keeps them."""
    monkeypatch.chdir(root)
    s, lev = stored(root, "surface"), stored(root, "levels")
    stats = ib.dataset_stats(open_anemoi({"join": ["surface.zarr", "levels.zarr"],
                                          "rename": {"msl": "pmsl"}}))
    for name, (store, k) in {"2t": (lev, 3), "pmsl": (s, 1), "t_850": (lev, 2)}.items():
        for key, attr in (("mean", "mean"), ("stdev", "std"), ("minimum", "min"),
                          ("maximum", "max")):
            assert getattr(stats[name], attr) == store.statistics[key][k], (name, key)
    e = stored(root, "early")
    stats = ib.dataset_stats(open_anemoi({"concat": ["early.zarr", "late.zarr"]}))
    assert stats["msl"].mean == e.statistics["mean"][1]
