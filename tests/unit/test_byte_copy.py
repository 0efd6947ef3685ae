"""copy_bytes: the compiled loops' memcpy copies exactly the range asked and refuses one outside
either array."""

import numba
import numpy as np
import pytest

from siphon_core.wire.byte_copy import copy_bytes


@numba.njit
def _copy(destination, destination_at, source, source_at, count):
    copy_bytes(destination, destination_at, source, source_at, count)


def test_copies_the_range_and_nothing_else():
    source = np.frombuffer(b"0123456789", np.uint8)  # read-only, as a received buffer is
    destination = np.full(8, ord("."), np.uint8)
    _copy(destination, 2, source, 3, 4)
    assert destination.tobytes() == b"..3456.."
    _copy(destination, 0, source, 9, 0)
    assert destination.tobytes() == b"..3456.."


@pytest.mark.parametrize(("destination_at", "source_at", "count"), [
    (5, 0, 4),  # past the destination's end
    (0, 8, 3),  # past the source's end
    (-1, 0, 2),
    (0, -1, 2),
    (0, 0, -1),
])
def test_refuses_a_range_outside_either_array(destination_at, source_at, count):
    source = np.frombuffer(b"0123456789", np.uint8)
    destination = np.zeros(8, np.uint8)
    with pytest.raises(IndexError, match="outside an array"):
        _copy(destination, destination_at, source, source_at, count)
    assert not destination.any()


def test_takes_only_contiguous_byte_arrays():
    with pytest.raises(numba.core.errors.TypingError):
        _copy(np.zeros(8, np.int32), 0, np.zeros(8, np.uint8), 0, 1)
    with pytest.raises(numba.core.errors.TypingError):
        _copy(np.zeros(8, np.uint8), 0, np.zeros(16, np.uint8)[::2], 0, 1)
