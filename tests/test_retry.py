"""One rule for every retry loop: what is worth another attempt, and how long to wait."""
from __future__ import annotations

import pytest

import gluon_stream as gs
from gluon_stream._stages.produce import ErrorPolicy
from gluon_stream._utils.retry import RetryPolicy, is_permanent


@pytest.mark.parametrize("exc, permanent", [
    (gs.SchemaMismatch("x"), True),
    (gs.UnsafeShard("x"), True),
    (gs.ShardError("x", disk_full=True), True),
    (ValueError("bad key"), True),
    (gs.CommandNotFound("x"), True),
    (gs.UnbatchableShard("x"), True),
    (gs.StaleShard("x"), True),
    (gs.CorruptShard("x"), False),
    (gs.ShardError("x"), False),
    (gs.ShardTimeout("x"), False),
    (OSError("transient"), False),
])
def test_what_another_attempt_cannot_fix(exc, permanent):
    assert is_permanent(exc) is permanent


def test_retry_policy_counts_attempts_and_doubles_the_backoff():
    policy = RetryPolicy(retries=3, backoff=0.5)
    assert policy.attempts == 4 and list(policy.delays()) == [0.5, 1.0, 2.0]
    assert policy.should_retry(gs.ShardError("x"), 0)
    assert not policy.should_retry(gs.ShardError("x"), 3)  # the last attempt
    assert not policy.should_retry(gs.UnsafeShard("x"), 0)


@pytest.mark.parametrize("on_error, mode, retries", [
    ("raise", "raise", 0), ("skip", "skip", 0), (("retry", 2), "retry", 2),
    (["retry", 1], "retry", 1)])
def test_on_error_policies(on_error, mode, retries):
    policy = ErrorPolicy.parse(on_error)
    assert (policy.mode, policy.retries) == (mode, retries)


@pytest.mark.parametrize("bad", ["ignore", ("retry", 0), ("retry", True), ("retry", 1.5), None])
def test_bad_on_error_names_the_choices(bad):
    with pytest.raises(ValueError, match=r"on_error must be 'raise', 'skip' or \('retry', n\)"):
        ErrorPolicy.parse(bad)
