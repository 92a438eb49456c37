"""One rule for argument types: booleans are not integers, durations are real seconds, and the
message names the argument and what to pass."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gluon_stream._utils import validate as _validate


@pytest.mark.parametrize("value", [True, False, 2.0, "2", None])
def test_integers_refuse_bools_floats_and_strings(value):
    with pytest.raises(ValueError, match=r"prefetch must be an integer >= 0, got"):
        _validate.integer("prefetch", value, minimum=0)


def test_integers_accept_numpy_integers_and_check_the_minimum():
    assert _validate.integer("batch_size", np.int64(8), minimum=1) == 8
    with pytest.raises(ValueError, match=r"batch_size must be a positive integer, got 0"):
        _validate.integer("batch_size", 0, minimum=1)
    with pytest.raises(ValueError, match=r"\(a bool\)"):
        _validate.integer("num_workers", True, minimum=0)


@pytest.mark.parametrize("value", [True, 0, -1, math.nan, "1"])
def test_durations_are_positive_real_seconds(value):
    with pytest.raises(ValueError, match="timeout must be positive seconds"):
        _validate.seconds("timeout", value)


def test_durations_allow_none_and_inf_where_asked():
    assert _validate.seconds("timeout", None, allow_none=True) is None
    assert _validate.seconds("timeout", math.inf) == math.inf
    assert _validate.seconds("delay", 0, positive=False) == 0.0


def test_choices_and_callables():
    assert _validate.choice("last_batch", "keep", ("keep", "discard")) == "keep"
    with pytest.raises(ValueError, match=r"last_batch must be one of 'keep', 'discard', got 'x'"):
        _validate.choice("last_batch", "x", ("keep", "discard"))
    with pytest.raises(TypeError, match="transform must be a callable or None, got int"):
        _validate.callable_or_none("transform", 3)

