"""How many messages a pull asks for in one request."""

from siphon_dagster.streaming.consumer import _FETCH_STEP, _FETCH_STEP_MAX, fetch_step


def test_small_messages_are_asked_for_as_many_as_the_byte_budget_holds():
    # 1,000 messages left, 8 MB left, 2 kB messages: the messages left, in one request.
    assert fetch_step(1000, 8_000_000, 2_000) == 1000
    assert fetch_step(300, 8_000_000, 2_000) == 300
    assert fetch_step(5000, 8_000_000, 2_000) == _FETCH_STEP_MAX


def test_large_messages_are_asked_for_a_step_at_a_time_as_before():
    # 100 kB messages, 1 MB left: the budget holds 10, the request still asks for the usual step.
    assert fetch_step(1000, 1_000_000, 100_000) == _FETCH_STEP
    assert fetch_step(1000, 50_000_000, 100_000) == 500  # a larger budget holds more of them


def test_a_step_is_never_empty_nor_more_than_what_is_left():
    assert fetch_step(1, 10, 1_000_000) == 1
    assert fetch_step(0, 10, 10) == 1  # the caller stops before; a request never asks for none
    assert fetch_step(10, 8_000_000, 0.0) == 10  # nothing taken yet


def test_a_first_batch_asks_for_no_more_than_its_byte_limit_holds():
    # A batch pulled alone passes least=1: 100 kB messages, 350 kB left, 3 of them, not the step.
    assert fetch_step(64, 350_000, 100_000, least=1) == 3
    assert fetch_step(64, 50_000, 100_000, least=1) == 1  # less than one left: still one more
