import json
import time

import pytest

from realhf.base.timeutil import FrequencyControl


def test_steps_and_epochs():
    ctl = FrequencyControl(freq_step=3)
    assert [ctl.check(steps=1) for _ in range(7)] == [False, False, True, False, False, True, False]
    ctl = FrequencyControl(freq_epoch=2)
    assert [ctl.check(epochs=1) for _ in range(4)] == [False, True, False, True]
    # any criterion fires, and firing resets all counters
    ctl = FrequencyControl(freq_epoch=1, freq_step=4)
    assert ctl.check(steps=3) is False
    assert ctl.check(epochs=1, steps=1) is True
    assert ctl.check(steps=3) is False  # step counter restarted at the epoch firing
    assert ctl.check(steps=1) is True
    assert ctl.n_fired == 2


def test_seconds():
    ctl = FrequencyControl(freq_sec=0.1)
    assert ctl.check(steps=1) is False
    time.sleep(0.12)
    assert ctl.check(steps=1) is True
    assert ctl.check(steps=1) is False


def test_never_fires_when_unset():
    ctl = FrequencyControl()
    assert not any(ctl.check(epochs=1, steps=100) for _ in range(10))


def test_state_dict_resumes_exactly():
    ref = FrequencyControl(freq_step=5, freq_epoch=3)
    pattern = [(i % 4 == 3, 1) for i in range(40)]
    expected = [ref.check(epochs=int(e), steps=s) for e, s in pattern]
    a = FrequencyControl(freq_step=5, freq_epoch=3)
    got = [a.check(epochs=int(e), steps=s) for e, s in pattern[:17]]
    state = json.loads(json.dumps(a.state_dict()))
    b = FrequencyControl(freq_step=5, freq_epoch=3)
    b.load_state_dict(state)
    got += [b.check(epochs=int(e), steps=s) for e, s in pattern[17:]]
    assert got == expected
    assert b.n_fired == ref.n_fired


def test_state_dict_keeps_elapsed_seconds():
    a = FrequencyControl(freq_sec=0.2)
    time.sleep(0.15)
    b = FrequencyControl(freq_sec=0.2)
    b.load_state_dict(a.state_dict())
    time.sleep(0.07)
    assert b.check() is True


def test_validation():
    with pytest.raises(ValueError, match="freq_step"):
        FrequencyControl(freq_step=0)
    with pytest.raises(ValueError, match="freq_epoch"):
        FrequencyControl(freq_epoch=1.5)
    with pytest.raises(ValueError, match="freq_sec"):
        FrequencyControl(freq_sec=-1)
    with pytest.raises(ValueError, match="freq_step"):
        FrequencyControl(freq_step=2).load_state_dict(FrequencyControl(freq_step=3).state_dict())
    with pytest.raises(ValueError, match=">= 0"):
        FrequencyControl().check(steps=-1)
