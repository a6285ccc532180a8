"""The bad-row budget: skip and count a few, fail naming them when too many."""

import pytest

from realhf.impl.dataset.bad_rows import BadRowBudget, BadRowsError


def test_a_few_bad_rows_are_tolerated_then_the_share_decides(caplog):
    b = BadRowBudget("t", max_fraction=0.1, min_tolerated=2)
    with caplog.at_level("WARNING"):
        b.bad_row("a", "why a")
        b.bad_row("a", "why a")  # counted again, warned once
    assert caplog.text.count("skipping dataset row 'a'") == 1
    b.good(27)  # 2 bad of 29: within min_tolerated
    b.bad_row("b", "why b")  # 3 of 30 = 10%: allowed
    with pytest.raises(BadRowsError) as e:
        b.bad_row("c", "why c")  # 4 of 31 > 10%
    assert "4 of 31 dataset rows failed" in str(e.value)
    assert "row 'a': why a\n  row 'b': why b\n  row 'c': why c" in str(e.value)


def test_zero_fails_at_the_first_bad_row_and_bad_settings_are_refused():
    with pytest.raises(BadRowsError, match="row 'x'"):
        BadRowBudget("t", max_fraction=0.0).bad_row("x", "broken")
    with pytest.raises(ValueError, match="max_bad_row_fraction=1.5"):
        BadRowBudget("t", max_fraction=1.5)
