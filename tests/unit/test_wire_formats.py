"""The compressed wire formats (``gradstar.wire.formats``).

The contract under test: every format round-trips each finite element within the bound that
:func:`error_bound` states (the module docstring's), NaN and ±Inf come back element for element
and never spread to a finite element, a buffer of the wrong size is a ProtocolError, and chunks
that hold whole blocks encode on their own exactly as the whole tensor does.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradstar.errors import ConfigurationError, ProtocolError
from gradstar.wire.formats import (
    FORMATS,
    WIRE_NONE,
    bits_per_element,
    check_block_aligned,
    decode,
    decode_into,
    encode,
    encode_into,
    error_bound,
    format_from_wire,
    roundtrip,
    wire_format,
)

PROPERTY = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
NAMES = sorted(FORMATS)
F32_MAX = float(np.finfo(np.float32).max)


def assert_within_bound(name: str, x: np.ndarray) -> None:
    """Finite elements within the bound, non-finite ones carried exactly, finite ones past the
    format's range (casts only) rounded to the infinity of their sign."""
    got = roundtrip(name, x).astype(np.float64)
    ref = x.astype(np.float64)
    over = np.abs(ref) >= FORMATS[name].overflow
    np.testing.assert_array_equal(got[over & np.isfinite(ref)],
                                  np.sign(ref[over & np.isfinite(ref)]) * np.inf)
    ref = np.where(over, np.copysign(np.inf, ref), ref)
    finite = np.isfinite(ref)
    err = np.abs(got[finite] - ref[finite])
    bound = error_bound(name, x)[finite]
    assert (err <= bound).all(), (name, np.max(err - bound))
    # Non-finite inputs stay non-finite and of the same kind.
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))


@st.composite
def arrays(draw, fp16_range: bool = False) -> np.ndarray:
    """float32 arrays with uneven lengths, blocks of zeros, magnitudes from subnormal to huge,
    and sometimes NaN/Inf, built from a seed plus a few drawn features (not element by element)."""
    n = draw(st.integers(0, 300))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    top = 4.0 if fp16_range else 38.0
    exponent = draw(st.floats(-45.0, top))
    spread = draw(st.floats(0.0, 8.0))
    x = rng.standard_normal(n) * 10.0 ** (exponent + spread * rng.uniform(-1, 0, n))
    if fp16_range:
        x = np.clip(x, -65000, 65000)
    x = np.clip(x, -F32_MAX, F32_MAX).astype(np.float32)
    if n and draw(st.booleans()):  # a run of zeros (often a whole block)
        start = draw(st.integers(0, n - 1))
        x[start:start + draw(st.integers(1, 130))] = 0
    if n and draw(st.booleans()):
        for special in draw(st.lists(st.sampled_from([np.nan, np.inf, -np.inf]), max_size=4)):
            x[draw(st.integers(0, n - 1))] = special
    return x


@pytest.mark.parametrize("name", NAMES)
@PROPERTY
@given(x=arrays())
def test_every_format_round_trips_within_its_bound(name, x):
    assert_within_bound(name, x)


@PROPERTY
@given(x=arrays(fp16_range=True))
def test_fp16_within_its_bound_in_its_range(x):
    assert_within_bound("fp16", x)
    assert np.isfinite(roundtrip("fp16", x)[np.isfinite(x)]).all()


@pytest.mark.parametrize("name", NAMES)
def test_blocks_of_zeros_decode_to_exact_zeros(name):
    x = np.zeros(64 * 3 + 5, np.float32)
    x[64:128] = np.linspace(-3, 3, 64)
    got = roundtrip(name, x)
    assert (got[:64] == 0).all() and (got[128:] == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_tiny_and_huge_blocks_keep_their_magnitude(name):
    tiny = np.full(64, 1e-44, np.float32) * np.linspace(-1, 1, 64, dtype=np.float32)
    huge = np.linspace(-F32_MAX, F32_MAX, 64, dtype=np.float32)
    for x in (tiny, huge):
        assert_within_bound(name, x)
    if name != "fp16":
        assert np.isfinite(roundtrip(name, np.full(64, F32_MAX / 2, np.float32))).all()
    if FORMATS[name].block:  # scaled formats keep float32's whole range
        assert np.isfinite(roundtrip(name, huge)).all()


def test_fp16_overflows_to_signed_infinity():
    got = roundtrip("fp16", np.array([7e4, -7e4, 65504], np.float32))
    assert got.tolist() == [np.inf, -np.inf, 65504]


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_block_with_infinity_keeps_its_finite_values(name):
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    x[3], x[10], x[20] = np.inf, -np.inf, np.nan
    got = roundtrip(name, x)
    assert got[3] == np.inf and got[10] == -np.inf and np.isnan(got[20])
    finite = np.isfinite(x)
    assert np.isfinite(got[finite]).all()
    step = 1.0 / (FORMATS[name].qmax - 1)
    assert np.max(np.abs(got[finite] - x[finite])) <= step / 2 + 1e-6
    # The neighbouring block is untouched by the first one's marks.
    y = np.concatenate([x, np.linspace(-2, 2, 64, dtype=np.float32)])
    assert_within_bound(name, y)


@pytest.mark.parametrize("name", NAMES)
def test_sizes_and_buffers(name):
    fmt = FORMATS[name]
    for n in (0, 1, 63, 64, 65, 1000):
        x = np.arange(n, dtype=np.float32)
        assert len(encode(name, x)) == fmt.encoded_nbytes(n)
    with pytest.raises(ProtocolError, match="expected"):
        decode(name, encode(name, np.ones(10, np.float32)) + b"\0", 10)
    with pytest.raises(ValueError, match="takes"):
        encode_into(name, np.ones(10, np.float32), bytearray(3))
    assert 0 < fmt.ratio() <= 0.5
    assert bits_per_element(name) == fmt.ratio() * 32


@pytest.mark.parametrize("name", NAMES)
def test_aligned_chunks_encode_like_the_whole(name):
    fmt = FORMATS[name]
    x = np.random.default_rng(1).standard_normal(64 * 10 + 17).astype(np.float32)
    step = 64 * 3
    joined = np.concatenate([roundtrip(name, x[i:i + step]) for i in range(0, x.size, step)])
    np.testing.assert_array_equal(joined, roundtrip(name, x))
    check_block_aligned(fmt, step, "test")
    if fmt.block:
        with pytest.raises(ConfigurationError, match="multiple of 64"):
            check_block_aligned(fmt, 100, "test")


@pytest.mark.parametrize("name", NAMES)
def test_decode_accumulates_in_float32(name):
    x = np.random.default_rng(2).standard_normal(300).astype(np.float32)
    acc = np.full(300, 1.5, np.float32)
    scratch = np.empty(400, np.float32)
    decode_into(name, encode(name, x), acc, accumulate=True, scratch=scratch)
    np.testing.assert_array_equal(acc, np.float32(1.5) + roundtrip(name, x))
    with pytest.raises(ValueError, match="float32"):
        decode_into(name, encode(name, x), np.zeros(300, np.float64))


def test_inputs_of_other_float_dtypes_are_converted():
    x = np.linspace(-1, 1, 100)
    for dtype in (np.float64, np.float16, ml_dtypes.bfloat16):
        got = roundtrip("int8", x.astype(dtype))
        assert got.dtype == np.float32 and got.shape == (100,)


def test_names_and_wire_values():
    assert format_from_wire(WIRE_NONE) is None
    for fmt in FORMATS.values():
        assert format_from_wire(fmt.wire) is fmt and wire_format(fmt.name) is fmt
    with pytest.raises(ProtocolError, match="unknown wire format 99"):
        format_from_wire(99)
    with pytest.raises(ConfigurationError, match="'int3' is not supported; use one of"):
        wire_format("int3")


def test_int4_packs_two_codes_a_byte():
    x = np.array([1.0, -1.0, 0.5, 0.0, -0.5], np.float32)
    buf = encode("int4", x)
    assert len(buf) == 4 + 3
    np.testing.assert_allclose(decode("int4", buf, 5), x, atol=1 / 14 + 1e-7)
