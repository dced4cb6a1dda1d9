import gzip
import math
import threading
from pathlib import Path

import numpy as np
import pytest

from data.batches import BatchReader, BinarySource, make_batch, rank_slice
from data.criteo import NUM_SPARSE, BinaryCriteo, CriteoTsvReader, kaggle_split, last_day_split, preprocess
from data.errors import DataError, MalformedLineError
from data.synthetic import SyntheticConfig, SyntheticSource, auc, teacher_auc, write_tsv

# the Criteo sample ships with the tests (tests/data/README.md says where it comes from)
SAMPLE = Path(__file__).resolve().parent / "data" / "criteo_kaggle_sample.tsv"


def read_all(paths, **kw):
    r = CriteoTsvReader(paths, **kw)
    chunks = list(r)
    return (
        r,
        np.concatenate([c.dense for c in chunks]),
        np.concatenate([c.sparse for c in chunks]),
        np.concatenate([c.labels for c in chunks]),
    )


def test_sample_parses_to_hand_checked_values():
    _, dense, sparse, labels = read_all([SAMPLE])
    assert dense.shape == (200, 13) and sparse.shape == (200, 26) and labels.shape == (200,)
    assert labels.sum() == 49  # per tests/data/README.md
    # line 1: "0 \t\t 3 \t 260 \t\t 17668 \t\t\t 33 \t\t\t\t 0 \t\t 05db9164 \t 08d6d899 ..."
    assert labels[0] == 0
    want = [0, math.log(4), math.log(261), 0, math.log(17669), 0, 0, math.log(34), 0, 0, 0, 0, 0]
    np.testing.assert_allclose(dense[0], want, rtol=1e-6)
    # C1..C26: 05db9164 08d6d899 ... C18=87c6f83c, C19 C20 empty, C21=0429f84b, C22 empty,
    # C23=3a171ecb, C24=c0d61a5c, C25 C26 empty
    assert sparse[0, 0] == 0x05DB9164 and sparse[0, 1] == 0x08D6D899 and sparse[0, 17] == 0x87C6F83C
    assert sparse[0, 18] == 0 and sparse[0, 19] == 0 and sparse[0, 20] == 0x0429F84B and sparse[0, 21] == 0
    assert sparse[0, 22] == 0x3A171ECB and sparse[0, 23] == 0xC0D61A5C and sparse[0, 25] == 0
    # line 3: "0 0 0 2 12 2013 164 6 35 523 0 3 <empty> 18 | 05db9164 38a947a1 ..."
    want3 = [0, 0, 2, 12, 2013, 164, 6, 35, 523, 0, 3, 0, 18]
    np.testing.assert_allclose(dense[2], np.log1p(want3), rtol=1e-6)
    assert sparse[2, 1] == 0x38A947A1 and sparse[2, 23] == 0x6D5D1302 and sparse[2, 24] == 0
    # line 2 has I2 = -1 -> log(max(-1, 0) + 1) = 0
    assert dense[1, 1] == 0.0


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def good_lines():
    return SAMPLE.read_text().splitlines()[:5]


@pytest.mark.parametrize(
    "bad, reason",
    [
        (lambda f: f[:-1], "39 columns, expected 40"),
        (lambda f: ["2"] + f[1:], "label '2' is not 0 or 1"),
        (lambda f: f[:3] + ["1.5"] + f[4:], "integer feature I3 '1.5' is not an integer"),
        (lambda f: f[:16] + ["zz12"] + f[17:], "categorical feature C3 'zz12' is not a hex value"),
        (lambda f: f[:16] + ["1ffffffff"] + f[17:], "categorical feature C3 '1ffffffff' exceeds 32 bits"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad, reason):
    lines = good_lines()
    lines[3] = "\t".join(bad(lines[3].split("\t")))
    path = write_lines(tmp_path / "bad.tsv", lines)
    with pytest.raises(MalformedLineError, match=rf"bad.tsv:4: {reason}") as ei:
        read_all([path])
    assert ei.value.lineno == 4 and ei.value.path == str(path)


def test_skip_flag_counts_skipped_lines(tmp_path):
    lines = good_lines()
    lines[1] = "garbage"
    lines[3] = lines[3].replace("05db9164", "nothex!!")
    path = write_lines(tmp_path / "bad.tsv", lines)
    r, dense, _, _ = read_all([path], skip_malformed=True)
    assert r.num_skipped == 2 and len(dense) == 3
    assert "bad.tsv:2:" in r.skipped_examples[0] and "bad.tsv:4:" in r.skipped_examples[1]


def test_preprocess_round_trip_is_exact_and_gzip_reads_the_same(tmp_path):
    gz = tmp_path / "train.txt.gz"
    with gzip.open(gz, "wb") as f:
        f.write(SAMPLE.read_bytes())
    n, skipped = preprocess(gz, tmp_path / "bin", "kaggle", progress=False)
    assert (n, skipped) == (200, 0)
    b = BinaryCriteo.open(tmp_path / "bin", "kaggle")
    _, dense, sparse, labels = read_all([SAMPLE])
    assert b.dense.dtype == np.float32 and b.sparse.dtype == np.int64 and b.labels.shape == (200, 1)
    np.testing.assert_array_equal(b.dense, dense)
    np.testing.assert_array_equal(b.sparse, sparse)
    np.testing.assert_array_equal(b.labels[:, 0], labels)
    # with a skipped line the files hold exactly the good rows
    lines = SAMPLE.read_text().splitlines()
    lines[10] = "oops"
    bad = write_lines(tmp_path / "bad.tsv", lines)
    n, skipped = preprocess(bad, tmp_path / "bin", "bad", skip_malformed=True, progress=False)
    assert (n, skipped) == (199, 1)
    b2 = BinaryCriteo.open(tmp_path / "bin", "bad")
    np.testing.assert_array_equal(b2.sparse, np.delete(sparse, 10, axis=0))
    assert not list((tmp_path / "bin").glob("*.partial"))
    with pytest.raises(DataError, match="nope_dense.npy' does not exist"):
        BinaryCriteo.open(tmp_path / "bin", "nope")


def test_dlrm_splits():
    assert kaggle_split(700, "train") == (0, 600)
    assert kaggle_split(700, "val") == (600, 650)
    assert kaggle_split(700, "test") == (650, 700)
    assert last_day_split(11, "val") == (0, 5) and last_day_split(11, "test") == (5, 11)
    with pytest.raises(ValueError, match="split 'dev'"):
        kaggle_split(700, "dev")


def test_rank_slice_partitions_the_global_batch():
    parts = [rank_slice(12, 3, r) for r in range(3)]
    assert parts == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="global batch size 10 is not a positive multiple of world size 3"):
        rank_slice(10, 3, 0)
    with pytest.raises(ValueError, match="rank 3 outside world of size 3"):
        rank_slice(12, 3, 3)


def assert_same_batches(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert np.array_equal(x.dense_features.numpy(), y.dense_features.numpy())
        assert np.array_equal(x.sparse_features.values().numpy(), y.sparse_features.values().numpy())
        assert np.array_equal(x.labels.numpy(), y.labels.numpy())


@pytest.mark.parametrize("kind", ["synthetic", "binary"])
def test_reader_resume_equals_uninterrupted(tmp_path, kind):
    cfg = SyntheticConfig.uniform(1000, seed=3)
    if kind == "synthetic":
        make_source = lambda: SyntheticSource(cfg)  # noqa: E731
    else:
        preprocess(SAMPLE, tmp_path, "s", progress=False)
        make_source = lambda: BinarySource(BinaryCriteo.open(tmp_path, "s"), [1000] * NUM_SPARSE)  # noqa: E731
    for rank in (0, 1):
        a = BatchReader(make_source(), 16, world_size=2, rank=rank, epochs=3)
        first = [next(a) for _ in range(5)]
        state = a.state_dict()
        rest = [next(a) for _ in range(7)]
        b = BatchReader(make_source(), 16, world_size=2, rank=rank, epochs=3)
        b.load_state_dict(state)
        assert_same_batches([next(b) for _ in range(7)], rest)
        assert first[0].dense_features.shape == (8, 13)
    # the two ranks' slices make up the global batch
    r0 = next(BatchReader(make_source(), 16, world_size=2, rank=0))
    r1 = next(BatchReader(make_source(), 16, world_size=2, rank=1))
    whole = next(BatchReader(make_source(), 16))
    np.testing.assert_array_equal(np.concatenate([r0.labels, r1.labels]), whole.labels.numpy())


def test_read_ahead_yields_the_same_batches_and_follows_a_rewind(tmp_path):
    preprocess(SAMPLE, tmp_path, "s", progress=False)
    make = lambda: BinarySource(BinaryCriteo.open(tmp_path, "s"), [1000] * NUM_SPARSE)  # noqa: E731
    plain = list(BatchReader(make(), 32, epochs=2))
    ahead = BatchReader(make(), 32, epochs=2, read_ahead=True)
    got = [next(ahead) for _ in range(3)]
    assert ahead.state_dict()["position"] == 3 * 32  # counts batches handed out, not those read ahead
    assert [at for at, _ in ahead._ahead] == [3 * 32, 4 * 32]  # a lone reader: two batches ahead, in order
    ahead.load_state_dict({"position": 3 * 32, "global_batch_size": 32})  # where it stands: nothing dropped
    assert [at for at, _ in ahead._ahead] == [3 * 32, 4 * 32]
    sliced = BatchReader(make(), 32, world_size=2, rank=1, read_ahead=True)  # one trainer's slice of several
    first = next(sliced)
    assert [at for at, _ in sliced._ahead] == [32] and len(first.labels) == 16
    sliced.close()
    ahead.load_state_dict({"position": 32, "global_batch_size": 32})  # a rollback: the read-ahead batch is dropped
    got += list(ahead)
    ahead.close()
    assert_same_batches(got, plain[:3] + plain[1:])
    assert len(got) == 3 + len(plain) - 1


def test_read_ahead_prepares_each_batch_on_its_thread_and_a_failed_prepare_is_left_to_the_step(tmp_path):
    preprocess(SAMPLE, tmp_path, "s", progress=False)
    src = BinarySource(BinaryCriteo.open(tmp_path, "s"), [1000] * NUM_SPARSE)
    seen = {}

    def prepare(batch):
        seen[id(batch)] = threading.current_thread().name
        if len(seen) == 2:
            raise ValueError("a bad row id")  # the step that needs the work redoes it and raises

    reader = BatchReader(src, 32, read_ahead=True, prepare=prepare)
    got = [next(reader) for _ in range(4)]
    reader.close()
    assert_same_batches(
        got, list(BatchReader(BinarySource(BinaryCriteo.open(tmp_path, "s"), [1000] * NUM_SPARSE), 32))[:4]
    )
    # the first batch is read by the caller; each later one was prepared on the read-ahead thread
    assert id(got[0]) not in seen
    assert [seen.get(id(b), "").startswith("read-ahead") for b in got[1:]] == [True, True, True]
    # a resumed reader reads its first batch ahead too, once told (while the run resumes)
    resumed = BatchReader(BinarySource(BinaryCriteo.open(tmp_path, "s"), [1000] * NUM_SPARSE), 32, read_ahead=True)
    resumed.prepare = prepare
    resumed.load_state_dict({"position": 64, "global_batch_size": 32})
    resumed.read_ahead()
    first = next(resumed)
    resumed.close()
    assert_same_batches([first], got[2:3])
    assert seen[id(first)].startswith("read-ahead")


def test_binary_reader_ends_after_last_full_batch(tmp_path):
    preprocess(SAMPLE, tmp_path, "s", progress=False)
    src = BinarySource(BinaryCriteo.open(tmp_path, "s"), [50] * NUM_SPARSE)
    batches = list(BatchReader(src, 64))
    assert len(batches) == 3
    assert int(batches[0].sparse_features.values().max()) < 50  # mod the table size


def test_make_batch_builds_a_kjt_in_key_major_order():
    sparse = np.arange(6).reshape(2, 3)
    b = make_batch(np.zeros((2, 13), np.float32), sparse, np.array([0, 1]), keys=["a", "b", "c"])
    assert b.sparse_features.keys() == ["a", "b", "c"]
    assert b.sparse_features["b"].values().tolist() == [1, 4]
    assert b.sparse_features.offsets().tolist() == list(range(7))


def test_teacher_auc_is_reproducible_by_seed_and_is_a_real_ceiling():
    cfg = SyntheticConfig.uniform(5000, seed=1)
    a1 = teacher_auc(cfg, 20_000)
    teacher_auc.cache_clear()  # computed again, not the process's kept figure
    a2 = teacher_auc(SyntheticConfig.uniform(5000, seed=1), 20_000)
    assert a1 == a2 and 0.7 < a1 < 0.95 and teacher_auc.cache_info().misses == 1
    assert teacher_auc(SyntheticConfig.uniform(5000, seed=2), 20_000) != a1
    s = SyntheticSource(cfg, "eval").read(0, 20_000)
    noisy = s.probs + np.random.default_rng(0).normal(0, 0.2, len(s.probs))
    assert auc(noisy, s.labels) < a1  # a worse predictor scores below the teacher
    assert 0.15 < s.labels.mean() < 0.45


def test_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 200).astype(float)  # many ties
    labels = rng.random(200) < 0.3
    pos, neg = scores[labels], scores[~labels]
    brute = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg))
    assert auc(scores, labels) == pytest.approx(brute, abs=1e-12)


def test_synthetic_stream_is_streaming_deterministic_and_writes_criteo_tsv(tmp_path):
    cfg = SyntheticConfig.uniform(3000, seed=5)
    src = SyntheticSource(cfg)
    whole = src.read(0, 10_000)
    part = SyntheticSource(cfg).read(5000, 100)  # no need for the rows before
    np.testing.assert_array_equal(part.sparse, whole.sparse[5000:5100])
    assert whole.sparse.max() < 3000 and whole.sparse.min() >= 0
    # Zipf: the most frequent id of a table is far above uniform frequency
    counts = np.bincount(whole.sparse[:, 0], minlength=3000)
    assert counts.max() > 50 * 10_000 / 3000
    write_tsv(cfg, tmp_path / "syn.tsv", 5000)
    _, dense, sparse, labels = read_all([tmp_path / "syn.tsv"])
    np.testing.assert_array_equal(sparse, whole.sparse[:5000])
    np.testing.assert_array_equal(labels, whole.labels[:5000])
    np.testing.assert_array_equal(dense, whole.dense[:5000])
    with pytest.raises(ValueError, match="zipf exponents"):
        SyntheticConfig.uniform(10, zipf=0.9)
