"""The one encoding of (table, ids, rows) groups (``embeddings.groups``): round trips of several
groups of different widths, empty and zero-width groups, float16 weights, and bytes that do not hold
whole groups raising ``GroupsError``; and the three formats built on it agree with it."""

import numpy as np
import pytest

from embeddings import groups as codec
from embeddings.groups import GroupsError


def some_groups(rng):
    return [
        (0, np.array([3, 1, 2**40], np.int64), rng.standard_normal((3, 5)).astype(np.float32)),
        (7, np.arange(10, dtype=np.int64), rng.standard_normal((10, 12)).astype(np.float32)),
        (2, np.zeros(0, np.int64), np.zeros((0, 4), np.float32)),  # no rows
        (4, np.array([9, 8], np.int64), np.zeros((2, 0), np.float32)),  # zero width
        (5, np.zeros(0, np.int64), np.zeros((0, 0), np.float32)),  # a step with no rows
    ]


def same(got, want, atol=0.0):
    assert len(got) == len(want)
    for (t, ids, rows), (t2, ids2, rows2) in zip(got, want):
        assert t == t2 and ids.dtype == np.int64 and np.array_equal(ids, ids2)
        assert rows.dtype == np.float32 and rows.shape == rows2.shape
        np.testing.assert_allclose(rows, rows2, rtol=0, atol=atol)


def test_several_groups_of_different_widths_round_trip_bit_for_bit():
    groups = some_groups(np.random.default_rng(0))
    blob = codec.encode(groups)
    assert len(blob) == codec.encoded_size(groups)
    same(codec.decode(blob), groups)
    copied = codec.decode(blob, copy=True)
    same(copied, groups)
    assert all(rows.flags.writeable for _, _, rows in copied)
    assert codec.decode(codec.encode([])) == []


def test_a_prefix_and_an_offset_and_a_view_of_the_buffer():
    groups = some_groups(np.random.default_rng(1))
    blob = codec.encode(groups, prefix=b"HEAD1234")
    assert blob[:8] == b"HEAD1234"
    same(codec.decode(memoryview(blob), 8), groups)
    (t, ids, rows), end = codec.decode_one(blob, 8 + codec.COUNT.size)
    assert t == 0 and end == 8 + codec.COUNT.size + codec.size(*groups[0][1:])
    assert not rows.flags.writeable  # a view of the buffer, not a copy
    assert b"".join(codec.parts(*groups[1])) == blob[end : end + codec.size(*groups[1][1:])]


def test_float16_weights_and_float32_state():
    rng = np.random.default_rng(2)
    groups = [(0, np.arange(6), rng.standard_normal((6, 8)).astype(np.float32)), (1, np.arange(3), rng.random((3, 2)))]
    half = [4, 5]  # table 0: 4 float16 columns, 4 float32; table 1: all of its 2 columns float16
    blob = codec.encode(groups, half)
    assert len(blob) == codec.encoded_size(groups, half) < codec.encoded_size(groups)
    got = codec.decode(blob)
    same(got, [(t, ids, rows.astype(np.float32)) for t, ids, rows in groups], atol=2e-3)
    rows = got[0][2]
    assert np.array_equal(rows[:, 4:], groups[0][2][:, 4:])  # the state comes back exactly
    assert np.array_equal(rows[:, :4], groups[0][2][:, :4].astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("cut", [1, 3, 4, 10, 20, 40, -1])
def test_a_truncated_buffer_raises(cut):
    blob = codec.encode(some_groups(np.random.default_rng(3)))
    with pytest.raises(GroupsError):
        codec.decode(blob[:cut] if cut > 0 else blob[:cut])


def test_trailing_bytes_and_inconsistent_headers_raise():
    groups = some_groups(np.random.default_rng(4))
    blob = codec.encode(groups)
    with pytest.raises(GroupsError, match="bytes after the 5 groups"):
        codec.decode(blob + b"\0")
    bad = bytearray(blob)
    bad[codec.COUNT.size + 4 : codec.COUNT.size + 8] = (1 << 30).to_bytes(4, "little")  # n of the first group
    with pytest.raises(GroupsError, match="runs past the end"):
        codec.decode(bytes(bad))
    bad = bytearray(blob)
    bad[codec.COUNT.size + 12 : codec.COUNT.size + 16] = (6).to_bytes(4, "little")  # 6 float16 columns of 5
    with pytest.raises(GroupsError, match="float16 columns"):
        codec.decode(bytes(bad))
    bad = bytearray(blob)
    bad[0] = 6  # one group more than there is
    with pytest.raises(GroupsError, match="header"):
        codec.decode(bytes(bad))


def test_the_three_formats_carry_the_same_groups():
    from embeddings.store.redis_store import decode_groups, encode_groups
    from recovery.durable import rowfiles
    from recovery.durable.log_format import END, encode_group, step_bytes
    from recovery.errors import CorruptCheckpointError

    groups = some_groups(np.random.default_rng(5))
    step, got = decode_groups(encode_groups(12, groups))
    assert step == 12
    same(got, groups)
    with pytest.raises(GroupsError):
        decode_groups(encode_groups(12, groups)[:-1])

    dims = [4, 0, 4, 0, 3, 0, 0, 8]
    f = rowfiles.decode(rowfiles.encode(3, 9, groups, dims), "f")
    assert (f.step, f.updates) == (3, 9)
    same(f.groups, groups)
    half = rowfiles.decode(rowfiles.encode(3, 9, groups, dims, half=True), "f")
    same(half.groups, groups, atol=2e-3)
    with pytest.raises(CorruptCheckpointError, match="CRC32C mismatch"):
        rowfiles.decode(rowfiles.encode(3, 9, groups, dims)[:-1], "f")

    blob = encode_group(7, groups)
    assert len(blob) == step_bytes(groups)
    assert len(encode_group(7, [])) == step_bytes([])
    # a record is the framing and the step around one group: its end record is a group of no rows
    assert blob.find(b"".join(codec.parts(*groups[1]))) > 0
    assert blob.endswith(b"".join(codec.parts(END, np.zeros(0, np.int64), np.zeros((0, len(groups)), np.float32))))
