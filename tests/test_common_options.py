"""The one parser of a spec's ``?key=value&...`` options (sources, models)."""

from __future__ import annotations

import pytest

from common.options import SpecOptions, split_spec


class _Refused(ValueError):
    pass


def test_a_spec_splits_into_its_name_and_options() -> None:
    assert split_spec("digits") == ("digits", {})
    assert split_spec("csv:a.csv?label=y&sep=") == ("csv:a.csv", {"label": "y", "sep": ""})
    with pytest.raises(ValueError, match="bad query field"):
        split_spec("synthetic?limit")


def test_each_option_is_read_once_typed_and_bounded() -> None:
    opts = SpecOptions({"limit": "5", "zipf": "1.5", "task": "x", "extra": "1"}, _Refused)
    assert (opts.integer("limit", None, lo=1), opts.integer("seed", 0), opts.number("zipf", 1.0)) == (5, 0, 1.5)
    assert opts.text("task", "classification") == "x" and opts.text("task", "classification") == "classification"
    assert opts.given("extra") and not opts.given("limit")
    with pytest.raises(_Refused, match=r"^source 's': unknown option\(s\) extra \(known: limit, seed, task, zipf\)$"):
        opts.refuse_unread("source 's'")
    assert opts.rest() == {"extra": "1"}
    opts.refuse_unread("nothing left")


@pytest.mark.parametrize("given,read,message", [
    ({"seed": "x"}, lambda o: o.integer("seed", 0), "^option seed='x' is not an integer$"),
    ({"limit": "0"}, lambda o: o.integer("limit", None, lo=1), "^option limit=0 must be >= 1$"),
    ({"zipf": "x"}, lambda o: o.number("zipf", 1.0), "^option zipf='x' is not a number$"),
    ({"lr": "-1"}, lambda o: o.number("lr", 0.1, lo=0), r"^option lr=-1.0 must be >= 0$"),
])
def test_a_bad_option_is_named_with_its_value(given, read, message) -> None:
    with pytest.raises(_Refused, match=message):
        read(SpecOptions(given, _Refused))


def test_a_kind_starts_the_messages() -> None:
    with pytest.raises(ValueError, match=r"^dlrm option dim=0 must be >= 1$"):
        SpecOptions({"dim": "0"}, what="dlrm").integer("dim", 16, lo=1)
    with pytest.raises(ValueError, match=r"^dlrm: unknown option\(s\) colour$"):
        SpecOptions({"colour": "red"}, what="dlrm").refuse_unread()
