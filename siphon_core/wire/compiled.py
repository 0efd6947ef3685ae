"""Compiles the wire format's numba loops (or loads them from their cache) by running each once.

The set-up runs `python -m siphon_core.wire.compiled`, so no process (a Spark Python worker, a
streaming run) pays the compilation, seconds on 2 cores, later.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.event_columns import gather_spans_into, read_package, spans_array, summarize_package
from siphon_core.wire.tuple_columns import split_tuples
from siphon_core.wire.tuple_data import UNCHANGED_TOAST, encode_tuple


def compile_all() -> None:
    # An unchanged TOASTed value in the row: without one, `unchanged` runs no compiled loop.
    located = split_tuples(pa.array([encode_tuple([b"1", None, UNCHANGED_TOAST]), None], pa.binary()), 3)
    located.columns([0, 2], np.array([0, 1]))
    located.key([0])
    located.unchanged()
    package = pb.Package(events=[pb.Event(operation=pb.INSERT, commit_lsn=1, position=1)])
    package.events[0].new_row.tuple = encode_tuple([b"1"])
    envelope, events = read_package(package.SerializeToString())
    _, summary = summarize_package(package.SerializeToString())
    if events is None or summary.event_count != 1:
        raise RuntimeError("the compiled event reader could not read a package it should read")
    spans_array(events.data, events.new_starts, events.new_lengths)
    gather_spans_into(events.data, events.new_starts, events.new_lengths,
                      np.empty(int(events.new_lengths.sum()), np.uint8), np.zeros(2, np.int64), 0)
    events.event(0)


if __name__ == "__main__":
    compile_all()
