"""Wire formats in the protocol, without sockets: the header checks of the hub, the wire
layouts both sides compute, the hub's encoded reducer, and the two-level all_reduce encoding
its leaders' stage alone."""

from __future__ import annotations

import numpy as np
import pytest

from gradstar import errors, ops
from gradstar.client.hierarchy import plan, programs
from gradstar.coordinator.collective.matching import Limits, check_agrees, describe, validate
from gradstar.coordinator.collective.reduce import BufferPool, EncodedChunkReducer, reducer_for
from gradstar.ops import check_encoding
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import ChunkLayout, as_byte_view
from gradstar.wire.encoded import Encoding, aligned_wire_chunk_bytes
from gradstar.wire.formats import FORMATS, encode, roundtrip

LIMITS = Limits(max_tensor_bytes=1 << 22, max_chunk_bytes=1 << 16)


def header(**fields) -> pb.CollectiveHeader:
    base = dict(job="j", generation=1, group="default", seq=3, rank=0,
                op=pb.COLLECTIVE_OP_ALL_REDUCE, reduce_op=pb.REDUCE_OP_SUM,
                dtype=pb.DTYPE_FLOAT32, shape=[40, 61], chunk_bytes=1024,
                wire=pb.WIRE_FORMAT_INT8)
    base.update(fields)
    return pb.CollectiveHeader(**base)


def test_the_format_reads_in_the_call_and_a_disagreement_names_it():
    assert describe(header()) == "all_reduce(op='sum', dtype=float32, shape=(40, 61), " \
                                 "wire='int8')"
    with pytest.raises(errors.CollectiveMismatchError) as raised:
        check_agrees(header(rank=1, wire=pb.WIRE_FORMAT_BF16), header(), "j")
    assert raised.value.field == "wire"
    assert "rank 1 called all_reduce(op='sum', dtype=float32, shape=(40, 61), wire='bf16') " \
           "but rank 0 called all_reduce(op='sum', dtype=float32, shape=(40, 61), " \
           "wire='int8') (wire differs)" in str(raised.value)
    with pytest.raises(errors.CollectiveMismatchError, match="wire differs"):
        check_agrees(header(rank=1, wire=0), header(), "j")


@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"wire": 9}, errors.ProtocolError, "unknown wire format 9"),
    ({"dtype": pb.DTYPE_INT32}, errors.InvalidCollectiveError,
     "wire='int8' carries float tensors; a int32 tensor travels exactly"),
    ({"op": pb.COLLECTIVE_OP_BROADCAST}, errors.InvalidCollectiveError,
     "applies to all_reduce and reduce_scatter only"),
    ({"reduce_op": pb.REDUCE_OP_PROD}, errors.InvalidCollectiveError,
     "op='prod' does not take wire='int8'"),
    ({"chunk_bytes": 1000}, errors.InvalidCollectiveError,
     "chunks of 250 elements split int8's blocks of 64"),
    ({"shm": pb.ShmSegment(pid=1)}, errors.InvalidCollectiveError, "with shared memory"),
    ({"averaging": pb.AveragingSpec(model="m", rule=pb.AVERAGING_RULE_OUTER_SGD)},
     errors.InvalidCollectiveError, "an averaging round must be an all_reduce with op='mean'"),
])
def test_the_hub_refuses_a_format_that_cannot_apply(fields, error, message):
    validate(header(), 4, LIMITS)
    with pytest.raises(error) as raised:
        validate(header(**fields), 4, LIMITS)
    assert message in str(raised.value)


def test_an_averaging_round_sends_encoded_and_answers_float32():
    h = header(reduce_op=pb.REDUCE_OP_MEAN, shape=[1000], chunk_bytes=512,
               averaging=pb.AveragingSpec(model="m", rule=pb.AVERAGING_RULE_OUTER_SGD))
    validate(h, 4, LIMITS)
    g = ops.geometry_of(h, 4)
    assert g.layout == Encoding(FORMATS["int8"], 4).layout(g.values)
    assert g.out_layout == g.values_out == g.values  # float32 parameters come back
    reducer = reducer_for(ops.CollectiveCall.of(h, 2), BufferPool())
    xs = [np.linspace(-1, 1, 128, dtype=np.float32) * (r + 1) for r in range(2)]
    out = np.empty(128, np.float32)
    slot = reducer.fold(None, memoryview(encode("int8", xs[0])), 0)
    reducer.finish_into(slot, memoryview(encode("int8", xs[1])), as_byte_view(out), 0)
    np.testing.assert_array_equal(
        out, np.divide(roundtrip("int8", xs[0]) + roundtrip("int8", xs[1]), 2,
                       dtype=np.float32))


def test_prod_with_a_cast_format_and_half_precision_inputs_are_valid():
    validate(header(reduce_op=pb.REDUCE_OP_PROD, wire=pb.WIRE_FORMAT_BF16), 4, LIMITS)
    validate(header(dtype=pb.DTYPE_FLOAT16, chunk_bytes=128), 4, LIMITS)
    validate(header(dtype=pb.DTYPE_BFLOAT16, chunk_bytes=1024), 4, LIMITS)


def test_the_client_check_raises_configuration_errors():
    with pytest.raises(errors.ConfigurationError, match="int64 tensor"):
        check_encoding("int4", np.int64, ops.ALL_REDUCE, pb.REDUCE_OP_SUM)
    assert check_encoding(None, np.int64, ops.BROADCAST, 0) is None
    assert check_encoding("fp16", np.float64, ops.REDUCE_SCATTER, pb.REDUCE_OP_MAX).name == \
        "fp16"
    assert aligned_wire_chunk_bytes(1000, 4, FORMATS["int8"]) == 768
    assert aligned_wire_chunk_bytes(100, 4, FORMATS["int8"]) == 256  # at least one block
    assert aligned_wire_chunk_bytes(1000, 4, FORMATS["bf16"]) == 1000


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("op", [ops.ALL_REDUCE, ops.REDUCE_SCATTER])
def test_wire_layouts_keep_the_chunks_and_size_each_encoded_chunk(name, op):
    h = header(op=op, wire=FORMATS[name].wire, shape=[40, 61], chunk_bytes=512)
    for rank in range(4):
        h.rank = rank
        plain = ops.geometry(op, 4, rank, 40 * 61 * 4, 512)
        g = ops.geometry_of(h, 4)
        assert (g.values, g.values_out) == (plain.layout, plain.out_layout)
        assert g.layout.count == plain.layout.count and g.sends == plain.sends
        assert g.receives == plain.receives and g.out_base == plain.out_base
        for index in range(plain.layout.count):
            _, length = plain.layout.span(index)
            assert g.layout.span(index)[1] == FORMATS[name].encoded_nbytes(length // 4)


def test_encoding_chunk_by_chunk_round_trips_every_chunk():
    enc = Encoding(FORMATS["int4"], 4)
    values = ChunkLayout(3, 1000 * 4, 256 * 4)
    x = np.random.default_rng(0).standard_normal(3000).astype(np.float32)
    buf = enc.encode(x, values, range(values.count))
    assert buf.size == enc.layout(values).total_bytes
    out = np.zeros(3000, np.float32)
    enc.decode(buf, values, range(values.count), out)
    want = np.concatenate([roundtrip("int4", x[s * 1000 + c:s * 1000 + min(c + 256, 1000)])
                           for s in range(3) for c in range(0, 1000, 256)])
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize(("op", "ufunc"), [(pb.REDUCE_OP_SUM, np.add),
                                           (pb.REDUCE_OP_MAX, np.maximum),
                                           (pb.REDUCE_OP_MEAN, np.add)])
def test_the_encoded_reducer_decodes_reduces_in_float32_and_encodes_once(op, ufunc):
    pool = BufferPool()
    values = ChunkLayout(1, 300 * 4, 128 * 4)
    h = header(reduce_op=op, shape=[300], chunk_bytes=512)
    reducer = reducer_for(ops.CollectiveCall.of(h, 3), pool)
    assert isinstance(reducer, EncodedChunkReducer)
    xs = [np.random.default_rng(r).standard_normal(300).astype(np.float32) for r in range(3)]
    for index in range(values.count):
        first, n = reducer.encoding.elements(values, index)
        parts = [encode("int8", x[first:first + n]) for x in xs]
        slot = reducer.fold(reducer.fold(None, memoryview(parts[0]), index),
                            memoryview(parts[1]), index)
        out = np.empty(len(parts[2]), np.uint8)
        reducer.finish_into(slot, memoryview(parts[2]), as_byte_view(out), index)
        decoded = [roundtrip("int8", x[first:first + n]) for x in xs]
        acc = ufunc(ufunc(decoded[0], decoded[1]), decoded[2])  # the hub's order, in float32
        if op == pb.REDUCE_OP_MEAN:
            acc = np.divide(acc, 3, dtype=np.float32)
        assert out.tobytes() == encode("int8", acc)  # encoded once, from float32
    assert pool.idle_bytes > 0  # accumulators went back to the pool


def test_one_rank_gets_its_own_encoded_chunk_back():
    reducer = reducer_for(ops.CollectiveCall.of(header(shape=[100], chunk_bytes=512), 1),
                          BufferPool())
    payload = encode("int8", np.arange(100, dtype=np.float32))
    out = bytearray(len(payload))
    reducer.finish_into(None, memoryview(payload), memoryview(out), 0)
    assert bytes(out) == payload


@pytest.mark.parametrize("rank", [0, 1])
def test_two_levels_encode_the_leaders_stages_alone(rank):
    hosts = plan(rank, {0: "a", 1: "a", 2: "b", 3: "b"})
    x = np.ones((4, 64), np.float32)
    for program in (programs.all_reduce(hosts, x, pb.REDUCE_OP_MEAN, np.empty_like(x), "int4"),
                    programs.reduce_scatter(hosts, x, pb.REDUCE_OP_SUM, "int4")):
        wires = [(stage.level, stage.wire) for stage in program.stages]
        leaders = [(programs.LEADERS, "int4")] if hosts.leader else []
        assert wires == [(programs.LOCAL, None), *leaders, (programs.LOCAL, None)]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_garbage_payloads_of_the_right_size_reduce_without_error_or_warning(name, recwarn):
    # A rank may send any bytes of the right length (scales of NaN, Inf or 1e38 included): the
    # hub reduces what it was sent, never crashes, and logs no numpy warnings for it.
    fmt = FORMATS[name]
    h = header(shape=[300], chunk_bytes=512, wire=fmt.wire)
    reducer = reducer_for(ops.CollectiveCall.of(h, 3), BufferPool())
    rng = np.random.default_rng(7)
    for index, n in ((0, 128), (1, 128), (2, 44)):
        parts = [rng.integers(0, 256, fmt.encoded_nbytes(n), dtype=np.uint8).tobytes()
                 for _ in range(3)]
        slot = reducer.fold(reducer.fold(None, memoryview(parts[0]), index),
                            memoryview(parts[1]), index)
        out = bytearray(fmt.encoded_nbytes(n))
        reducer.finish_into(slot, memoryview(parts[2]), memoryview(out), index)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 65, 200])
def test_split_parts_and_take_part_round_trip_a_header_first_stream(nbytes):
    from gradstar.wire.chunks import split_parts, take_part

    data = bytes(range(256)) * 2
    data = data[:nbytes]
    pieces = list(split_parts(memoryview(data), 64))
    assert all(0 < len(p) <= 64 for p in pieces) and len(pieces) == -(-nbytes // 64)
    out = bytearray(nbytes)
    filled = 0
    for piece in pieces:
        filled = take_part(piece, memoryview(out), filled, 64, "a test")
    assert filled == nbytes and bytes(out) == data
    with pytest.raises(errors.ProtocolError, match="over the 32-byte chunk limit"):
        for piece in split_parts(data + b"x" * 64, 64):
            take_part(piece, memoryview(bytearray(nbytes + 64)), 0, 32, "a test")
