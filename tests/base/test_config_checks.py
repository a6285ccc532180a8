"""The shared config checks: what each accepts and the exact words of its errors."""

import enum
import math
import types

import pytest

from realhf.base.config_checks import Checks, is_int, is_num


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


def test_is_int_and_is_num_refuse_bools_and_non_finite_numbers():
    assert is_int(3) and not is_int(True) and not is_int(3.0)
    assert is_num(3) and is_num(0.5) and not is_num(False)
    assert not is_num(math.inf) and not is_num(math.nan)


def test_the_two_wordings():
    assert str(Checks("Cfg").bad("n", 0, "use 1")) == "Cfg.n=0: use 1"
    says = Checks("Cfg", says_invalid=True)
    assert str(says.bad("n", 0, "use 1")) == "Cfg.n=0 is invalid: use 1"


def test_integer():
    ck = Checks("Cfg")
    ck.integer(types.SimpleNamespace(n=2), "n", 2)
    ck.integer(types.SimpleNamespace(n=None), "n", 1, allow_none=True)
    for bad in (1, True, 2.0, None):
        with pytest.raises(ValueError, match=r"^Cfg.n=.*: use an integer >= 2$"):
            ck.integer(types.SimpleNamespace(n=bad), "n", 2)
    with pytest.raises(ValueError, match=r": use an integer >= 1 or None$"):
        ck.integer(types.SimpleNamespace(n=0), "n", 1, allow_none=True)


def test_seconds():
    ck = Checks("Cfg")
    ck.seconds(types.SimpleNamespace(a=0.5, b=3), "a", "b")
    ck.seconds(types.SimpleNamespace(t=math.inf), "t", finite=False)
    for bad in (0, -1, True, "5", math.nan, math.inf):
        with pytest.raises(ValueError, match=r"use a positive, finite number of seconds$"):
            ck.seconds(types.SimpleNamespace(a=1, t=bad), "a", "t")
    with pytest.raises(ValueError, match=r"^Cfg.t=0: use a number of seconds > 0$"):
        ck.seconds(types.SimpleNamespace(t=0), "t", finite=False)


def test_enum_and_bools():
    ck = Checks("Cfg", says_invalid=True)
    assert ck.enum("c", "red", Color) is Color.RED and ck.enum("c", Color.BLUE, Color) is Color.BLUE
    with pytest.raises(
        ValueError, match=r"^Cfg.c='green' is invalid: use one of \('red', 'blue'\)$"
    ):
        ck.enum("c", "green", Color)
    ck.bools(types.SimpleNamespace(x=True, y=False), "x", "y")
    with pytest.raises(ValueError, match=r"^Cfg.y=1 is invalid: use true or false$"):
        ck.bools(types.SimpleNamespace(x=True, y=1), "x", "y")
