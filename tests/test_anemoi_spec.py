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
