"""PostgreSQL's exact float text, computed by ClickHouse from a stored Float32/Float64.

PostgreSQL (extra_float_digits > 0) prints the shortest decimal that lies strictly inside the
value's rounding interval (Ryu with exclusive bounds), closest to the value. ClickHouse prints the
shortest decimal that reads back to the same value, which may sit exactly on the interval's
boundary (a tie that round-half-even reading resolves to the value). The two digit strings differ
only for such ties, and a decimal of at most 17 significant digits can equal a boundary only when
the value is an integer of at least 2^53 (float4: 2^24). So:

- integer values with ulp >= 1 (below 2^202) are printed by exact Int256 arithmetic on the value's bits: for
  k = 1, 2, ... significant digits, the value rounded half-even to k digits (and the next decimal
  up, for the narrower lower interval of a power of two) is taken as soon as it lies strictly
  inside the interval;
- every other value takes ClickHouse's shortest digits.

The digits S and decimal exponent E are then laid out as PostgreSQL does: fixed notation when
-4 <= E < 15 (float4: 6), else d.ddde+XX with at least two exponent digits; NaN, Infinity,
-Infinity and -0 as PostgreSQL spells them. Intermediate values are bound once through
single-element arrayMap lambdas, so the expression is one self-contained SQL template.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class _Binary:
    fixed_below: int  # PostgreSQL prints fixed notation for decimal exponents in [-4, fixed_below)
    bits: str  # reinterprets the float as its IEEE bits
    mantissa_bits: int
    exponent_mask: int
    unit_exponent: int  # exponent field at which the ulp is exactly 1
    max_digits: int  # significant digits that always identify a value
    # Ties need a value below 2^157 (float4: 2^76); the exact path stops well inside Int256.
    max_shift: int


FLOAT4 = _Binary(6, "reinterpretAsUInt32", 23, 0xFF, 150, 9, 105)
FLOAT8 = _Binary(15, "reinterpretAsUInt64", 52, 0x7FF, 1075, 17, 150)

_LAYOUT = (
    "if(E >= -4 AND E < {fixed_below}, "
    "if(E >= 0, if(length(S) <= E + 1, concat(S, repeat('0', toUInt32(E + 1 - length(S)))), "
    "concat(substring(S, 1, E + 1), '.', substring(S, E + 2))), "
    "concat('0.', repeat('0', toUInt32(-E - 1)), S)), "
    "concat(substring(S, 1, 1), if(length(S) > 1, concat('.', substring(S, 2)), ''), 'e', "
    "if(E < 0, '-', '+'), if(abs(E) < 10, '0', ''), toString(abs(E))))"
)


def _shortest_from_text(value: str) -> str:
    """(S, E) from ClickHouse's shortest round-trip text of abs(value)."""
    mantissa = "splitByChar('e', s)[1]"
    digits = f"replaceRegexpAll({mantissa}, '[.]', '')"
    significant = f"replaceRegexpOne(replaceRegexpOne({digits}, '^0+', ''), '0+$', '')"
    leading_zeros = f"(length({digits}) - length(replaceRegexpOne({digits}, '^0+', '')))"
    exponent = (
        "toInt32(if(length(splitByChar('e', s)) > 1, toInt32(splitByChar('e', s)[2]), 0)"
        f" + length(splitByChar('.', {mantissa})[1]) - 1 - {leading_zeros})"
    )
    return f"arrayMap(s -> tuple({significant}, {exponent}), [toString(abs({value}))])[1]"


def _shortest_interior_integer(value: str, binary: _Binary) -> str:
    """(S, E) of an integer value (ulp >= 1) by exact arithmetic; see the module docstring."""
    fraction_mask = (1 << binary.mantissa_bits) - 1
    bits = f"{binary.bits}({value})"
    field = f"toInt32(bitAnd(bitShiftRight({bits}, {binary.mantissa_bits}), {binary.exponent_mask}))"
    # Only meaningful when the ulp is >= 1; the guard keeps shifts in range for every other row.
    shift = f"toUInt16(greatest({field} - {binary.unit_exponent}, 0))"
    integer = f"bitShiftLeft(toInt256(bitOr(bitAnd({bits}, {fraction_mask}), {fraction_mask + 1})), {shift})"
    ulp = f"bitShiftLeft(toInt256(1), {shift})"
    power_of_two = f"(bitAnd({bits}, {fraction_mask}) = 0)"
    # Strictly inside the rounding interval; below a power of two the interval is half as wide.
    inside = "if(c < X, (X - c) * if(P, 4, 2) < U, (c - X) * 2 < U)"
    unit = "toInt256(concat('1', repeat('0', toUInt32(greatest(toInt32(L) - toInt32(k), 0)))))"
    rounded = "(intDiv(X, u) + multiIf((X - intDiv(X, u) * u) * 2 > u, 1, (X - intDiv(X, u) * u) * 2 = u, intDiv(X, u) % 2, 0)) * u"
    candidates = f"arrayMap(k -> arrayMap(u -> arrayMap(c -> [c, c + u], [{rounded}])[1], [{unit}])[1], range(1, {binary.max_digits + 1}))"
    chosen = f"arrayFirst(c -> {inside}, arrayFlatten({candidates}))"
    digits = f"arrayMap(L -> toString({chosen}), [length(toString(X))])[1]"
    return (
        f"arrayMap((X, U, P) -> arrayMap(t -> tuple(replaceRegexpOne(t, '0+$', ''), toInt32(length(t) - 1)), [{digits}])[1], "
        f"[{integer}], [{ulp}], [{power_of_two}])[1]"
    )


def float_text(binary: _Binary) -> str:
    """The render template (`{0}` is the Float32/Float64 column, Nullable or not)."""
    value = "assumeNotNull({0})"
    field = f"toInt32(bitAnd(bitShiftRight({binary.bits}({value}), {binary.mantissa_bits}), {binary.exponent_mask}))"
    integral = f"({field} - {binary.unit_exponent} BETWEEN 0 AND {binary.max_shift})"
    digits_and_exponent = f"if({integral}, {_shortest_interior_integer(value, binary)}, {_shortest_from_text(value)})"
    layout = _LAYOUT.replace("{fixed_below}", str(binary.fixed_below))
    laid_out = f"arrayMap(t -> arrayMap((S, E) -> {layout}, [t.1], [t.2])[1], [{digits_and_exponent}])[1]"
    return (
        f"if(isNull({{0}}), NULL, multiIf(isNaN({value}), 'NaN', "
        f"isInfinite({value}), if({value} > 0, 'Infinity', '-Infinity'), "
        f"{value} = 0, toString({value}), concat(if({value} < 0, '-', ''), {laid_out})))"
    )
