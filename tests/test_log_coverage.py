"""A log replay proves it reached every step it needed: cuts, flipped bytes and missing segments
inside the needed steps end in one ``LogGapError`` naming the file and the step; damage past them is
harmless. Real files, the log's own writer."""

import numpy as np
import pytest

from recovery.durable.log import ShardLog
from recovery.durable.log_format import entries
from recovery.errors import LogGapError

ROW = np.ones((2, 3), np.float32)


def write(tmp_path, segments=((1, range(1, 11)), (11, range(11, 21))), tables=(0, 1, 2)) -> ShardLog:
    """Every step: one record per table (rows = step), then its end record."""
    log = ShardLog(tmp_path, 0)
    for first, steps in segments:
        log.open_segment(first)
        for step in steps:
            log.append_step(step, [(t, np.array([t, 10 + t]), ROW * step) for t in tables])
    log.close()
    return log


def test_a_whole_log_replays_every_step_and_an_empty_step_counts_as_complete(tmp_path):
    log = ShardLog(tmp_path, 0)
    log.open_segment(1)
    for step in range(1, 6):
        groups = [] if step == 3 else [(0, np.array([step]), ROW[:1] * step)]
        log.append_step(step, groups)
    log.close()
    records, last = log.replay(0, 5)
    assert last == 5 and [r.step for r in records] == [1, 2, 4, 5]
    records, last = log.replay(2, 4)
    assert last == 5 and [r.step for r in records] == [4, 5]


def test_a_cut_in_the_tail_of_an_unneeded_step_is_harmless(tmp_path):
    log = write(tmp_path)
    seg = log.segments()[-1]
    data = seg.read_bytes()
    seg.write_bytes(data[:-30])  # step 20's last record is torn
    records, last = log.replay(10, 19)
    assert last == 19 and {r.step for r in records} == set(range(11, 20))


def test_a_cut_inside_a_needed_step_names_the_file_and_the_step(tmp_path):
    log = write(tmp_path)
    seg = log.segments()[-1]
    out, _, _ = entries(seg)
    step18 = [e.offset for e in out if e.record is not None and e.record.step == 18]
    seg.write_bytes(seg.read_bytes()[: step18[1] + 20])  # one whole record of step 18, then a torn one
    with pytest.raises(LogGapError) as e:
        log.replay(10, 19)
    msg = str(e.value)
    assert "step 18 cannot be rebuilt" in msg and seg.name in msg and "torn record" in msg
    assert "steps 18..19" in msg
    assert log.replay(10, 17)[1] == 17  # what is needed up to 17 is there


def test_a_missing_middle_segment_is_named(tmp_path):
    log = write(tmp_path, segments=((1, range(1, 6)), (6, range(6, 11)), (11, range(11, 16))))
    s1, s6, s11 = log.segments()
    s6.unlink()
    with pytest.raises(LogGapError) as e:
        log.replay(0, 14)
    msg = str(e.value)
    assert "step 6 cannot be rebuilt" in msg and s1.name in msg and "seg_0000000011.log" in msg and "missing" in msg


def test_a_flipped_byte_mid_segment_is_found_even_when_later_records_verify(tmp_path):
    log = write(tmp_path)
    seg = log.segments()[0]
    out, _, _ = entries(seg)
    at = next(e.offset for e in out if e.record is not None and e.record.step == 4 and e.record.table == 1)
    data = bytearray(seg.read_bytes())
    data[at + 40] ^= 0x01  # inside the payload: the framing holds, the CRC does not
    seg.write_bytes(bytes(data))
    with pytest.raises(LogGapError) as e:
        log.replay(0, 12)
    msg = str(e.value)
    assert "step 4 cannot be rebuilt" in msg and f"the record at byte {at} fails its CRC" in msg
    assert log.replay(0, 3)[1] == 3


def test_no_chain_from_step_one_when_the_first_segments_are_gone(tmp_path):
    log = write(tmp_path)
    log.segments()[0].unlink()
    with pytest.raises(LogGapError, match="step 1 cannot be rebuilt.*no segment holds it"):
        log.replay(0, 15)
    assert log.replay(10, 15)[1] == 20  # from a checkpoint at 10 it is whole


def test_truncation_keeps_damaged_records_for_the_replay_to_name(tmp_path):
    log = write(tmp_path)
    seg = log.segments()[0]
    out, _, _ = entries(seg)
    at = next(e.offset for e in out if e.record is not None and e.record.step == 4)
    data = bytearray(seg.read_bytes())
    data[at + 40] ^= 0x01
    seg.write_bytes(bytes(data))
    log.truncate_after(8)
    assert [ShardLog.first_step(s) for s in log.segments()] == [1]
    steps = {e.record.step for e in entries(seg)[0] if e.record is not None}
    assert max(steps) == 8
    with pytest.raises(LogGapError, match="fails its CRC"):
        log.replay(0, 8)


@pytest.mark.parametrize("flip", [0x10, 0x08], ids=["step-field-says-later", "step-field-says-earlier"])
def test_truncation_reads_only_the_framing_before_the_later_steps_and_cuts_the_same_bytes(tmp_path, flip):
    """``truncate_after`` checks CRCs only from the first record whose step field says a later step:
    a damaged record of step 9 whose step field now says another step stays as it is whatever it
    says, the valid records of steps 9 and 10 go, and a torn tail goes too."""
    log = write(tmp_path, segments=((1, range(1, 11)),))
    seg = log.segments()[0]
    out, end, _ = entries(seg)
    at = next(e.offset for e in out if e.record is not None and e.record.step == 9)
    data = bytearray(seg.read_bytes())
    data[at + 12] ^= flip  # the step field (after the 12-byte header): its CRC fails now
    seg.write_bytes(bytes(data) + b"\x00" * 7)  # and a torn record header after the last record
    log.truncate_after(8)
    after, end_after, why = entries(seg)
    assert why == "" and end_after == seg.stat().st_size  # the torn tail went
    assert max(e.record.step for e in after if e.record is not None) == 8
    assert [e.offset for e in after if e.record is None] == [at]  # the damaged record stayed, where it was
    assert seg.read_bytes()[: at + 1] == bytes(data[: at + 1])
    assert log.replay(0, 8)[1] == 8  # damage past the needed steps is harmless


def test_truncation_with_nothing_past_the_step_leaves_the_segment_unread_and_untouched(tmp_path):
    """A regroup's usual case: every record is of the resumed step or before, and whole: the file
    is neither rewritten nor cut. A later step's records are cut in place."""
    log = write(tmp_path, segments=((1, range(1, 11)),))
    seg = log.segments()[0]
    before, st = seg.read_bytes(), seg.stat()
    for step in (10, 25):
        log.truncate_after(step)
        now = seg.stat()
        assert (now.st_ino, now.st_mtime_ns, now.st_size) == (st.st_ino, st.st_mtime_ns, st.st_size)
    assert seg.read_bytes() == before
    log.truncate_after(9)  # step 10's records go, cut in place
    assert seg.stat().st_ino == st.st_ino and seg.stat().st_size < st.st_size
    assert max(e.record.step for e in entries(seg)[0] if e.record is not None) == 9


def test_a_cut_in_the_process_that_wrote_the_log_frames_nothing_and_cuts_the_same_bytes(tmp_path, monkeypatch):
    """A regroup's cut of its own shards' logs: the writer's step offsets (kept in the process that
    wrote them) say where the later steps begin, as long as the file is still as written; a segment
    followed by one that starts at or before the step after the cut is not framed either."""
    import recovery.durable.log as log_module

    framed: list[str] = []
    real = log_module.file_frames
    monkeypatch.setattr(log_module, "file_frames", lambda p: framed.append(p.name) or real(p))
    write(tmp_path)  # steps 1-10 in seg 1, 11-20 in seg 11; its writer closed, as a regroup closes it
    ShardLog(tmp_path, 0).truncate_after(15)  # a new log object, as the resume's
    assert framed == []
    steps = [r.step for r in ShardLog(tmp_path, 0).records(0)]
    assert steps == sorted(steps) and max(steps) == 15 and set(steps) == set(range(1, 16))
    assert ShardLog(tmp_path, 0).replay(0, 15)[1] == 15
    # the file changed since (here: cut above): framed, and cut the same way
    ShardLog(tmp_path, 0).truncate_after(12)
    assert framed == ["seg_0000000011.log"]
    assert max(r.step for r in ShardLog(tmp_path, 0).records(0)) == 12
    # a writer that opened a segment holding records already knows only its own steps: a cut
    # before them frames the segment
    for steps, cut, frames in (((13, 14), 13, []), ((14, 15), 11, ["seg_0000000011.log"])):
        log = ShardLog(tmp_path, 0)
        log.open_segment(11)
        for step in steps:
            log.append_step(step, [(0, np.array([0, 10]), ROW * step)])
        log.close()
        framed.clear()
        ShardLog(tmp_path, 0).truncate_after(cut)  # after its first step: from its offsets; before: framed
        assert framed == frames
        assert {r.step for r in ShardLog(tmp_path, 0).records(0)} == set(range(1, cut + 1))
