"""Compressed wire formats: float32 tensors in fewer bytes, decoded back to float32.

A reducing collective may travel in a *wire format* (``pg.all_reduce(x, wire="int8")``): each
rank encodes its float32 chunks, the hub decodes every contribution to float32, accumulates in
float32 and encodes the result once. So a value is rounded twice in all (on the way in and on the
way out), whatever the number of ranks, where a ring that adds in the compressed format rounds at
every hop. This module is the codec alone: numpy whole-array passes, no torch, no I/O.

Formats (``FORMATS``; bytes per element on the wire, scales included):

========= ============ =================================================================
name      bytes/elem   what travels
========= ============ =================================================================
``bf16``  2            bfloat16, round to nearest even (float32's range, 8-bit significand)
``fp16``  2            IEEE half, round to nearest even; ``|x| >= 65520`` becomes ±Inf
``int8``  1.0625       blocks of 64: a float32 scale, then int8 codes in [-127, 127]
``int4``  0.5625       blocks of 64: a float32 scale, then 4-bit codes in [-7, 7], two a byte
========= ============ =================================================================

Layout of a block format's buffer for ``n`` elements: ``ceil(n / block)`` little-endian float32
scales, then the codes (int8: ``n`` bytes; int4: ``ceil(n / 2)`` bytes, element ``2k`` in the low
nibble of byte ``k``). A buffer is self-contained, so a chunk of a tensor encodes on its own as
long as chunks hold whole blocks (a chunk's element count a multiple of ``block``; only the last
chunk of a tensor may end in a short block).

Block size: 64 elements for both formats. A float32 scale costs ``32 / block`` bits an
element; from 64 to 128 the heavy-tailed error grows by more than the quarter bit saved is
worth, and from 64 to 32 it falls by less than the half bit spent (the figures, and how to
measure them again: docs/wire-formats.md, "Measured").

Error bound, per element ``x`` of a finite block whose largest finite magnitude is ``amax``:

- ``bf16``: ``|x^ - x| <= 2**-8 * |x| + 2**-134``; ``fp16``: ``<= 2**-11 * |x| + 2**-25`` while
  ``|x| < 65520`` (and ±Inf beyond). bf16 turns ``|x| >= (2 - 2**-8) * 2**127`` (the top 0.2% of
  float32's range) into ±Inf, as any rounding to bfloat16 does.
- ``int8`` / ``int4``: ``|x^ - x| <= amax / (2 * qmax) * (1 + 2**-14) + 2**-140`` with
  ``qmax = 127`` / ``7`` (``126`` / ``6`` in a block that holds a non-finite value).

:func:`error_bound` computes exactly this bound for an array, element by element.

NaN and ±Inf are carried element for element, never turned into a finite value and never
spreading to a finite one. The casts carry them natively. In a block format, a block that holds
any non-finite value is marked by the sign bit of its scale; in such a block the codes ``qmax``,
``-qmax`` and ``-qmax - 1`` mean +Inf, -Inf and NaN, and the finite values use one level less
(``qmax - 1``); its scale comes from its finite values alone. Unmarked blocks never hold those
meanings, so decoding only looks at the (rare) marked blocks twice.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from gradstar.errors import ConfigurationError, ProtocolError
from gradstar.proto.v1 import collective_pb2 as pb

from .dtypes import bfloat16

logger = logging.getLogger(__name__)

_F32 = np.dtype("<f4")
_F32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class WireFormat:
    """One compressed wire format.

    ``name`` is what a caller passes (``wire="int8"``) and ``wire`` its value in the collective
    header (``collective.proto``'s ``WireFormat``). ``bits`` is the bits of one element's code and
    ``block`` the elements that share one float32 scale (0: a plain cast without scales).
    """

    name: str
    wire: int
    bits: int
    block: int
    #: The numpy dtype of a plain cast, by name ("bfloat16": ml_dtypes', imported on first
    #: use); None for a block format.
    cast_name: str | None = None
    #: Finite magnitudes from here up round to ±Inf (a cast's range); inf: never.
    overflow: float = math.inf
    #: A cast's documented error bound, ``relative * |x| + absolute`` (half an ulp and the
    #: smallest subnormal); a block format's bound is computed per block (:func:`error_bound`).
    relative: float = 0.0
    absolute: float = 0.0

    @property
    def cast(self) -> np.dtype | None:
        """The numpy dtype of a plain cast; None for a block format."""
        if self.cast_name is None:
            return None
        return bfloat16() if self.cast_name == "bfloat16" else np.dtype(self.cast_name)

    @property
    def qmax(self) -> int:
        """Largest code magnitude of a block format (127 for int8, 7 for int4)."""
        return (1 << (self.bits - 1)) - 1

    def blocks(self, n: int) -> int:
        """Scale blocks of ``n`` elements (0 for a cast)."""
        return -(-n // self.block) if self.block else 0

    def encoded_nbytes(self, n: int) -> int:
        """Bytes that ``n`` float32 elements take in this format."""
        if self.cast is not None:
            return n * self.cast.itemsize
        return 4 * self.blocks(n) + -(-n * self.bits // 8)

    def ratio(self) -> float:
        """Wire bytes per float32 byte for a long tensor (scales included)."""
        return self.encoded_nbytes(1 << 20) / (4 << 20)


#: Every compressed format by name; ``wire`` values match collective.proto's ``WireFormat``.
FORMATS: dict[str, WireFormat] = {
    f.name: f for f in (
        WireFormat("bf16", pb.WIRE_FORMAT_BF16, 16, 0, "bfloat16",
                   (2 - 2**-8) * 2.0**127, 2.0**-8, 2.0**-134),
        WireFormat("fp16", pb.WIRE_FORMAT_FP16, 16, 0, "<f2", 65520.0, 2.0**-11,
                   2.0**-25),
        WireFormat("int8", pb.WIRE_FORMAT_INT8, 8, 64),
        WireFormat("int4", pb.WIRE_FORMAT_INT4, 4, 64),
    )
}
_BY_WIRE = {f.wire: f for f in FORMATS.values()}

#: The value of "no wire format" in a header: the tensor travels in its own dtype.
WIRE_NONE = pb.WIRE_FORMAT_UNSPECIFIED


def wire_format(name: str | WireFormat) -> WireFormat:
    """The :class:`WireFormat` called ``name``.

    Raises:
        ConfigurationError: no such format.
    """
    if isinstance(name, WireFormat):
        return name
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"wire format {name!r} is not supported; use one of {', '.join(FORMATS)}"
        ) from None


def format_from_wire(wire: int) -> WireFormat | None:
    """The format of a header's ``wire`` value; None for :data:`WIRE_NONE`.

    Raises:
        ProtocolError: an unknown value.
    """
    if wire == WIRE_NONE:
        return None
    try:
        return _BY_WIRE[wire]
    except KeyError:
        raise ProtocolError(f"unknown wire format {wire} in collective header") from None


def _flat_f32(x) -> np.ndarray:
    """``x`` as a flat float32 array (a view when it already is one)."""
    return np.asarray(x, dtype=_F32).reshape(-1)


def encode_into(fmt: str | WireFormat, x, out) -> None:
    """Encode the elements of ``x`` (any float array; converted to float32 first) into ``out``.

    ``out`` is a writable buffer of exactly ``fmt.encoded_nbytes(x.size)`` bytes (a chunk
    frame's payload view, so the encoded bytes are written once, where they are sent from).

    Raises:
        ConfigurationError: unknown format.
        ValueError: ``out`` is not of the encoded size.
    """
    fmt = wire_format(fmt)
    flat = _flat_f32(x)
    dst = np.frombuffer(out, dtype=np.uint8)
    if dst.size != fmt.encoded_nbytes(flat.size):
        raise ValueError(f"{fmt.name} of {flat.size} elements takes "
                         f"{fmt.encoded_nbytes(flat.size)} bytes; the buffer has {dst.size}")
    if fmt.cast is not None:
        with np.errstate(over="ignore"):  # overflow to ±Inf is the documented behaviour
            dst.view(fmt.cast)[:] = flat  # numpy's and ml_dtypes' casts round to nearest even
        return
    nb = fmt.blocks(flat.size)
    scales = dst[:4 * nb].view(_F32)
    codes = _quantize(flat, fmt, scales)
    _pack(codes, fmt, dst[4 * nb:])


def encode(fmt: str | WireFormat, x) -> bytes:
    """``x`` (any float array; converted to float32) encoded in ``fmt``.

    Raises:
        ConfigurationError: unknown format.
    """
    fmt = wire_format(fmt)
    flat = _flat_f32(x)
    buf = np.empty(fmt.encoded_nbytes(flat.size), np.uint8)
    encode_into(fmt, flat, buf)
    return buf.tobytes()


def decode_into(fmt: str | WireFormat, buf, out: np.ndarray, *, accumulate: bool = False,
                scratch: np.ndarray | None = None) -> None:
    """Decode ``buf`` into the float32 array ``out`` (its element count says how many), or add
    the decoded values to it when ``accumulate``.

    ``scratch`` (float32, at least ``out.size`` elements) is where an accumulating decode puts
    the values before adding them, so a hub that decodes many chunks reuses one buffer.

    Raises:
        ConfigurationError: unknown format.
        ProtocolError: ``buf`` is not the encoded size of ``out.size`` elements.
        ValueError: ``out`` is not a contiguous float32 array.
    """
    fmt = wire_format(fmt)
    if out.dtype != _F32 or not out.flags.c_contiguous:
        raise ValueError(f"decode_into writes a contiguous float32 array, not {out.dtype}")
    target = out.reshape(-1)
    n = target.size
    src = np.frombuffer(buf, dtype=np.uint8)
    if src.size != fmt.encoded_nbytes(n):
        raise ProtocolError(f"{fmt.name} payload of {src.size} bytes for {n} elements; "
                            f"expected {fmt.encoded_nbytes(n)}")
    if accumulate:
        dest = np.empty(n, _F32) if scratch is None else scratch.reshape(-1)[:n]
    else:
        dest = target
    if fmt.cast is not None:
        dest[:] = src.view(fmt.cast)
    else:
        nb = fmt.blocks(n)
        scales = src[:4 * nb].view(_F32)
        _dequantize(_unpack(src[4 * nb:], fmt, n), scales, fmt, dest)
    if accumulate:
        np.add(target, dest, out=target)


def decode(fmt: str | WireFormat, buf, n: int) -> np.ndarray:
    """A new float32 array of the ``n`` elements encoded in ``buf``.

    Raises:
        ConfigurationError: unknown format.
        ProtocolError: ``buf`` is not the encoded size of ``n`` elements.
    """
    out = np.empty(n, _F32)
    decode_into(fmt, buf, out)
    return out


def roundtrip(fmt: str | WireFormat, x) -> np.ndarray:
    """``x`` as it arrives after one encode and decode: float32, of ``x``'s shape."""
    flat = _flat_f32(x)
    return decode(fmt, encode(fmt, flat), flat.size).reshape(np.shape(x))


# -- block formats -------------------------------------------------------------------------------


def _blocked(flat: np.ndarray, block: int) -> list[np.ndarray]:
    """``flat`` as 2-D views of whole blocks: the full blocks, then the short tail block."""
    full = flat.size - flat.size % block
    parts = [flat[:full].reshape(-1, block)] if full else []
    if full < flat.size:
        parts.append(flat[full:].reshape(1, -1))
    return parts


def _quantize(flat: np.ndarray, fmt: WireFormat, scales: np.ndarray) -> np.ndarray:
    """Integer codes (int8, one an element) of ``flat``; the block scales go into ``scales``."""
    codes = np.empty(flat.size, np.int8)
    first = 0
    for rows, crow in zip(_blocked(flat, fmt.block), _blocked(codes, fmt.block), strict=True):
        m = rows.shape[0]
        _quantize_rows(rows, fmt.qmax, scales[first:first + m], crow)
        first += m
    return codes


def _quantize_rows(rows: np.ndarray, qmax: int, scales: np.ndarray, codes: np.ndarray) -> None:
    mag = np.abs(rows)
    amax = mag.max(axis=1)  # NaN or Inf here marks a block holding a non-finite value
    marked = ~np.isfinite(amax)
    levels = np.full(rows.shape[0], float(qmax))
    if marked.any():
        bad = rows[marked]
        amax[marked] = np.where(np.isfinite(bad), np.abs(bad), 0).max(axis=1)
        levels[marked] = qmax - 1
    scale = _scales(amax, levels)
    with np.errstate(invalid="ignore"):  # NaN/Inf rows are recoded below
        q = np.divide(rows, np.where(scale > 0, scale, 1)[:, None], out=mag)
        np.rint(q, out=q)
        codes[...] = q
    if marked.any():
        bad = rows[marked]
        fixed = codes[marked]
        fixed[np.isnan(bad)] = -qmax - 1
        fixed[np.isposinf(bad)] = qmax
        fixed[np.isneginf(bad)] = -qmax
        codes[marked] = fixed
        scale[marked] = -scale[marked]  # the mark: the sign bit (also on a scale of 0)
    scales[:] = scale


def _scales(amax: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """float32 scales with ``scale * levels >= amax`` (so no code overflows, and a tiny block's
    scale never underflows to 0) and ``scale * levels`` finite (so no code decodes to Inf)."""
    exact = amax.astype(np.float64) / levels
    scale = exact.astype(_F32)
    low = scale.astype(np.float64) < exact
    scale[low] = np.nextafter(scale[low], np.float32(np.inf))
    cap = (np.float64(_F32_MAX) / levels).astype(_F32)
    over = cap.astype(np.float64) * levels > _F32_MAX
    cap[over] = np.nextafter(cap[over], np.float32(0))
    return np.minimum(scale, cap)


def _pack(codes: np.ndarray, fmt: WireFormat, dst: np.ndarray) -> None:
    """Write int8 ``codes`` into ``dst`` in ``fmt.bits`` bits each."""
    if fmt.bits == 8:
        dst.view(np.int8)[:] = codes
        return
    n = codes.size
    even = n - n % 2
    lo = codes[0:even:2].view(np.uint8) & 0x0F
    hi = codes[1:even:2].view(np.uint8) << 4
    np.bitwise_or(lo, hi, out=dst[:even // 2])
    if n % 2:
        dst[-1] = codes[-1:].view(np.uint8)[0] & 0x0F


def _unpack(src: np.ndarray, fmt: WireFormat, n: int) -> np.ndarray:
    """int8 codes of ``n`` elements from ``src``."""
    if fmt.bits == 8:
        return src.view(np.int8)
    packed = src.view(np.int8)
    codes = np.empty(2 * packed.size, np.int8)
    # Arithmetic shifts of int8 sign-extend each nibble back to [-8, 7].
    np.right_shift(np.left_shift(packed, 4), 4, out=codes[0::2])
    np.right_shift(packed, 4, out=codes[1::2])
    return codes[:n]


def _dequantize(codes: np.ndarray, scales: np.ndarray, fmt: WireFormat, out: np.ndarray) -> None:
    first = 0
    for crow, orow in zip(_blocked(codes, fmt.block), _blocked(out, fmt.block), strict=True):
        m = crow.shape[0]
        scale = scales[first:first + m]
        np.multiply(crow, scale[:, None], out=orow)
        marked = np.signbit(scale)
        if marked.any():
            orow[marked] = _decode_marked(crow[marked], -scale[marked], fmt.qmax)
        first += m


def _decode_marked(codes: np.ndarray, scale: np.ndarray, qmax: int) -> np.ndarray:
    """Values of the blocks marked as holding non-finite values (see the module docstring)."""
    values = codes * scale[:, None]
    values[codes == qmax] = np.inf
    values[codes == -qmax] = -np.inf
    values[codes == -qmax - 1] = np.nan
    return values


# -- bounds --------------------------------------------------------------------------------------


def error_bound(fmt: str | WireFormat, x) -> np.ndarray:
    """The documented bound on ``|roundtrip(fmt, x) - x|`` for each element of ``x`` (float64;
    meaningful for finite elements below ``fmt.overflow``, which round to ±Inf).

    Raises:
        ConfigurationError: unknown format.
    """
    fmt = wire_format(fmt)
    flat = _flat_f32(x).astype(np.float64)
    if fmt.cast is not None:
        return fmt.relative * np.abs(flat) + fmt.absolute
    bound = np.empty_like(flat)
    for rows, brow in zip(_blocked(flat, fmt.block), _blocked(bound, fmt.block), strict=True):
        finite = np.isfinite(rows)
        amax = np.where(finite, np.abs(rows), 0).max(axis=1)
        levels = np.where(finite.all(axis=1), fmt.qmax, fmt.qmax - 1)
        brow[...] = (amax / (2 * levels) * (1 + 2.0**-14) + 2.0**-140)[:, None]
    return bound


def check_block_aligned(fmt: WireFormat, elements: int, who: str) -> None:
    """Refuse a chunk size that would split a scale block across chunks.

    Raises:
        ConfigurationError: ``elements`` is not a multiple of the block.
    """
    if fmt.block and elements % fmt.block:
        raise ConfigurationError(
            f"{who}: chunks of {elements} elements split {fmt.name}'s blocks of {fmt.block}; "
            f"use a multiple of {fmt.block} elements")


def bits_per_element(fmt: str | WireFormat) -> float:
    """Wire bits per element of a long tensor, scales included."""
    fmt = wire_format(fmt)
    return fmt.bits + (32 / fmt.block if fmt.block else 0)


__all__ = ["FORMATS", "WIRE_NONE", "WireFormat", "bits_per_element", "check_block_aligned",
           "decode", "decode_into", "encode", "encode_into", "error_bound", "format_from_wire",
           "roundtrip", "wire_format"]
