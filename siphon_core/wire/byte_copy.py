"""`copy_bytes`: one `memcpy` between two byte arrays, for the wire format's compiled loops.

In numba, a slice assignment (`out[a:b] = data[c:d]`) builds two array views, works out their
shapes and copies through a generic element loop: about 35 ns for each of the 10 - 50 byte values
a TupleData holds, which made copying a row's values out twice the cost of finding them. This is
LLVM's `memcpy` on the arrays' data, behind a bounds check that raises instead of writing outside
either array.

numba's cache of a compiled loop looks only at the loop's own file: after a change here, the
callers' cache entries (`tuple_columns`, `event_columns`) stay as they were until those files
change too, so touch them.
"""

from __future__ import annotations

import numba
from numba.core import cgutils, types
from numba.extending import intrinsic


def _contiguous_bytes(kind: types.Type) -> bool:
    return isinstance(kind, types.Array) and kind.ndim == 1 and kind.layout == "C" and kind.dtype == types.uint8


@intrinsic
def _memcpy(typingctx, destination, destination_at, source, source_at, count):  # pragma: no cover - compiled
    if not (_contiguous_bytes(destination) and _contiguous_bytes(source)):
        return None  # numba then reports that no signature matches
    signature = types.void(destination, types.int64, source, types.int64, types.int64)

    def generate(context, builder, sig, args):
        out, out_at, data, data_at, size = args
        out_array = context.make_array(sig.args[0])(context, builder, out)
        data_array = context.make_array(sig.args[2])(context, builder, data)
        cgutils.raw_memcpy(builder, builder.gep(out_array.data, [out_at]), builder.gep(data_array.data, [data_at]),
                           size, 1)
        return context.get_dummy_value()

    return signature, generate


@numba.njit(cache=True, nogil=True, inline="always")
def copy_bytes(destination, destination_at, source, source_at, count):  # pragma: no cover - compiled
    """destination[destination_at:destination_at + count] = source[source_at:source_at + count]"""
    if (count < 0 or destination_at < 0 or source_at < 0 or destination_at + count > destination.shape[0]
            or source_at + count > source.shape[0]):
        raise IndexError("copy_bytes: the range lies outside an array")
    _memcpy(destination, destination_at, source, source_at, count)
