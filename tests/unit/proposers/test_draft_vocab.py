"""draft_vocab_ids, rank_vocab (verispec/proposers/draft_vocab.py): which ids a trimmed draft head keeps, and how a
file of them is made from a corpus."""

from __future__ import annotations

import numpy as np
import pytest

from verispec.proposers.draft_vocab import (
    ROW_GROUP,
    draft_vocab_ids,
    rank_vocab,
    read_vocab_file,
    write_vocab_file,
)


def test_the_first_ids_plus_the_special_ones_padded_to_whole_row_groups():
    keep = draft_vocab_ids(1000, size=40, always=[990, 995, 7])
    ids = keep.tolist()
    assert ids == sorted(set(ids)) and len(ids) % ROW_GROUP == 0
    # 0..39, the two specials (7 is already there), then the lowest missing ids: 40 .. 45
    assert ids == [*range(46), 990, 995]


def test_nothing_to_trim_returns_none():
    assert draft_vocab_ids(64, size=64) is None
    assert draft_vocab_ids(64, size=10_000) is None
    # 50 ids pad to 64: the whole vocabulary
    assert draft_vocab_ids(64, size=50) is None


def test_a_file_of_int32_ids(tmp_path):
    path = tmp_path / "vocab.bin"
    np.array([500, 3, 77, 3], dtype="<i4").tofile(path)
    ids = draft_vocab_ids(1000, path=str(path), always=[999]).tolist()
    assert {3, 77, 500, 999} <= set(ids) and len(ids) == ROW_GROUP
    assert ids == sorted(ids)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", "not a draft vocabulary: 0 bytes"),
        (b"\x01\x00\x00", "not a draft vocabulary: 3 bytes"),
        (
            np.array([5, 1000], dtype="<i4").tobytes(),
            r"holds token id 1000, outside the draft's vocabulary \[0, 1000\)",
        ),
        (np.array([-1], dtype="<i4").tobytes(), "holds token id -1"),
    ],
)
def test_a_bad_file_names_the_key(tmp_path, content, match):
    path = tmp_path / "vocab.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="speculative_config.draft_vocab_file") as e:
        draft_vocab_ids(1000, path=str(path))
    assert e.match(match)


def test_a_missing_file_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"speculative_config.draft_vocab_file '.*nope.bin' cannot be read"):
        draft_vocab_ids(1000, path=str(tmp_path / "nope.bin"))


def test_a_corpus_ranks_its_ids_by_frequency_then_the_lowest_others():
    corpus = np.array([9, 4, 9, 4, 9, 2, 50, 70, -1, 1000])
    # 9 (3x), 4 (2x), then 2 / 50 / 70 once each in id order; ids outside [0, 100) ignored; then 0, 1, 3, ...
    assert rank_vocab(corpus, 9, 100).tolist() == [9, 4, 2, 50, 70, 0, 1, 3, 5]
    assert rank_vocab(corpus, 3, 100).tolist() == [9, 4, 2]
    assert rank_vocab(np.array([], dtype=np.int64), 4, 100).tolist() == [0, 1, 2, 3]
    assert rank_vocab(corpus, 500, 100).size == 100


def test_a_written_file_reads_back(tmp_path):
    path = tmp_path / "v.bin"
    write_vocab_file(str(path), np.array([5, 0, 99]))
    assert path.read_bytes() == np.array([5, 0, 99], dtype="<i4").tobytes()
    assert read_vocab_file(str(path), 100).tolist() == [5, 0, 99]
