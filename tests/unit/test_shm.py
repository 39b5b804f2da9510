"""The shared-memory fast path's segments: what the hub attaches, and everything it refuses.

No sockets: the rank's side (:class:`Segment`, :class:`SegmentPool`) and the hub's side
(:class:`SegmentMapper`) meet through this process's own ``/proc/self/fd``, as they would
through a rank's on the same host.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
import time

import numpy as np
import pytest

from gradstar.errors import ProtocolError
from gradstar.transport import shm
from gradstar.wire import KIND_SHM_CHUNK, decode_shm_chunk, encode_shm_chunk

MIB = 1 << 20


@pytest.fixture
def segment():
    seg = shm.Segment(MIB)
    yield seg
    seg.close()


def attach(mapper: shm.SegmentMapper, seg: shm.Segment, **changes) -> memoryview:
    spec = dict(pid=os.getpid(), fd=seg.fd, inode=seg.inode, size=seg.size, key=seg.key)
    spec.update(changes)
    return mapper.attach(**spec)


def test_the_hub_sees_what_the_rank_wrote_and_the_rank_what_the_hub_wrote(segment):
    mapper = shm.SegmentMapper()
    np.frombuffer(segment.data, np.float32)[:4] = [1, 2, 3, 4]

    data = attach(mapper, segment)

    assert np.frombuffer(data, np.float32)[:4].tolist() == [1, 2, 3, 4]
    np.frombuffer(data, np.float32)[4:6] = [7, 8]
    assert np.frombuffer(segment.data, np.float32)[4:6].tolist() == [7, 8]
    assert len(data) == segment.size


def test_a_second_attach_reuses_the_mapping(segment):
    mapper = shm.SegmentMapper()
    attach(mapper, segment)
    attach(mapper, segment)
    assert mapper.mapped_bytes == shm.DATA_OFFSET + segment.size


def test_a_wrong_key_is_refused(segment):
    with pytest.raises(shm.ShmRefused, match="does not carry the header's key"):
        attach(shm.SegmentMapper(), segment, key=bytes(shm.KEY_BYTES))


def test_a_size_beyond_the_segment_is_refused(segment):
    with pytest.raises(shm.ShmRefused, match="not the segment the header names"):
        attach(shm.SegmentMapper(), segment, size=segment.size + 1)


def test_another_inode_is_refused(segment):
    with pytest.raises(shm.ShmRefused, match="not the segment the header names"):
        attach(shm.SegmentMapper(), segment, inode=segment.inode + 1)


def test_a_descriptor_that_does_not_exist_is_refused():
    with pytest.raises(shm.ShmRefused, match="cannot open /proc/"):
        shm.SegmentMapper().attach(os.getpid(), 1 << 20, 1, MIB, bytes(shm.KEY_BYTES))


def test_an_unsealed_memfd_is_refused():
    # It could shrink under the hub's mapping, which would kill the hub with SIGBUS.
    fd = os.memfd_create(shm.NAME, os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, shm.DATA_OFFSET + MIB)
        with pytest.raises(shm.ShmRefused, match="not sealed against resizing"):
            shm.SegmentMapper().attach(os.getpid(), fd, os.fstat(fd).st_ino, MIB,
                                       bytes(shm.KEY_BYTES))
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["regular file", "other memfd"])
def test_a_file_that_is_not_a_gradstar_segment_is_refused(kind):
    # A rank must not make the hub write results into one of its other files.
    if kind == "regular file":
        handle = tempfile.TemporaryFile()
        fd = handle.fileno()
        os.ftruncate(fd, shm.DATA_OFFSET + MIB)
    else:
        fd = os.memfd_create("something-else", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, shm.DATA_OFFSET + MIB)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    try:
        with pytest.raises(shm.ShmRefused, match="is not a gradstar segment"):
            shm.SegmentMapper().attach(os.getpid(), fd, os.fstat(fd).st_ino, MIB,
                                       bytes(shm.KEY_BYTES))
    finally:
        if kind == "regular file":
            handle.close()
        else:
            os.close(fd)


def test_a_mapping_whose_owner_let_go_is_dropped_by_the_sweep():
    mapper = shm.SegmentMapper()
    seg = shm.Segment(MIB)
    view = attach(mapper, seg)
    view.release()
    assert mapper.mapped_bytes > 0
    seg.close()

    mapper.sweep()

    assert mapper.mapped_bytes == 0


def test_a_reused_descriptor_number_is_mapped_afresh():
    mapper = shm.SegmentMapper()
    first = shm.Segment(MIB)
    attach(mapper, first).release()
    fd = first.fd
    first.close()
    second = shm.Segment(2 * MIB)
    try:
        if second.fd != fd:
            os.dup2(second.fd, fd)  # the same number, naming another file
        data = mapper.attach(os.getpid(), fd, second.inode, second.size, second.key)
        assert len(data) == 2 * MIB
        assert mapper.mapped_bytes == shm.DATA_OFFSET + 2 * MIB
    finally:
        if second.fd != fd:
            os.close(fd)
        second.close()


def test_the_pool_reuses_segments_and_keeps_a_bounded_number():
    pool = shm.SegmentPool(keep=2, keep_bytes=8 * MIB)
    a = pool.acquire(3 * MIB)
    assert a.size == 3 * MIB
    pool.release(a)
    assert pool.acquire(2 * MIB) is a  # big enough: reused
    b, c = pool.acquire(MIB), pool.acquire(MIB)
    for seg in (a, b, c):
        pool.release(seg)
    assert pool.free_bytes == 2 * MIB  # the oldest went: at most two kept
    big = pool.acquire(9 * MIB)
    pool.release(big)
    assert pool.free_bytes <= 8 * MIB  # over the byte bound: not kept


def test_sizes_round_up_to_whole_mebibytes():
    pool = shm.SegmentPool()
    seg = pool.acquire(MIB + 1)
    assert seg.size == 2 * MIB
    pool.discard(seg)


def test_chunk_frames_round_trip_and_refuse_other_lengths():
    frame = encode_shm_chunk(12345)
    assert frame[0] == KIND_SHM_CHUNK
    assert decode_shm_chunk(frame) == 12345
    with pytest.raises(ProtocolError, match="shared-memory chunk frame of 9 bytes"):
        decode_shm_chunk(frame + b"x")


def test_a_process_that_exited_is_gone_even_before_it_is_reaped():
    child = subprocess.Popen(["sleep", "0.2"])
    try:
        assert not shm.process_gone(child.pid)
        deadline = time.monotonic() + 10
        while not shm.process_gone(child.pid):  # a zombie until wait() below reaps it
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.05)
    finally:
        child.wait(10)
    assert shm.process_gone(child.pid)
    assert not shm.process_gone(os.getpid())
