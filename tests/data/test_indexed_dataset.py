"""The `.bin`/`.idx` format: round trip, Megatron's exact bytes, merging shards, and bad files."""

import struct

import numpy as np
import pytest

from nemo_ckpt.data.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder


def write(prefix, documents, dtype=np.uint16):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for document in documents:
        builder.add_document(np.concatenate(document), [len(part) for part in document])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


DOCUMENTS = [[[5, 6, 7]], [[1], [2, 3]], [[9, 9, 9, 9]]]


def test_round_trip(tmp_path):
    dataset = IndexedDataset(write(tmp_path / "a", DOCUMENTS))
    assert len(dataset) == 4
    assert dataset.dtype == np.uint16
    assert [dataset[i].tolist() for i in range(4)] == [[5, 6, 7], [1], [2, 3], [9, 9, 9, 9]]
    assert dataset.sequence_lengths.tolist() == [3, 1, 2, 4]
    assert dataset.document_indices.tolist() == [0, 1, 3, 4]
    assert dataset.get(0, offset=1).tolist() == [6, 7]
    assert dataset.get(3, offset=1, length=2).tolist() == [9, 9]
    assert [s.tolist() for s in dataset[1:3]] == [[1], [2, 3]]


def test_index_bytes_follow_megatron_layout(tmp_path):
    write(tmp_path / "a", DOCUMENTS, dtype=np.int32)
    raw = (tmp_path / "a.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 4, 4, 4)  # version, int32 code, 4 sequences, 4 doc indices
    body = np.frombuffer(raw[34:], dtype=np.uint8)
    assert np.frombuffer(body[:16], np.int32).tolist() == [3, 1, 2, 4]
    assert np.frombuffer(body[16:48], np.int64).tolist() == [0, 12, 16, 24]  # byte pointers
    assert np.frombuffer(body[48:80], np.int64).tolist() == [0, 1, 3, 4]
    assert (tmp_path / "a.bin").read_bytes() == np.array([5, 6, 7, 1, 2, 3, 9, 9, 9, 9], np.int32).tobytes()


def test_dtype_from_vocab_size_and_codes():
    assert DType.optimal_dtype(50257) is np.uint16
    assert DType.optimal_dtype(65500) is np.int32
    assert DType.optimal_dtype(128256) is np.int32
    assert [DType.code_from_dtype(t) for t in (np.uint8, np.int16, np.int32, np.int64, np.uint16)] == [1, 3, 4, 5, 8]


def test_add_item_and_add_index_merge_shards(tmp_path):
    first = write(tmp_path / "s0", DOCUMENTS[:2])
    second = write(tmp_path / "s1", DOCUMENTS[2:])
    builder = IndexedDatasetBuilder(tmp_path / "m.bin", np.uint16)
    builder.add_item([42])
    builder.end_document()
    builder.add_index(first)
    builder.add_index(second)
    builder.finalize(tmp_path / "m.idx")
    merged = IndexedDataset(tmp_path / "m")
    assert [merged[i].tolist() for i in range(len(merged))] == [[42], [5, 6, 7], [1], [2, 3], [9, 9, 9, 9]]
    assert merged.document_indices.tolist() == [0, 1, 2, 4, 5]


def test_token_beyond_dtype_is_refused(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "a.bin", np.uint16)
    with pytest.raises(ValueError, match="70000 does not fit uint16.*optimal_dtype"):
        builder.add_document([1, 70000], [2])


def test_missing_files_name_the_file(tmp_path):
    prefix = write(tmp_path / "a", DOCUMENTS)
    (tmp_path / "a.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"a\.bin does not exist.*preprocess"):
        IndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match=r"b\.idx does not exist"):
        IndexedDataset(tmp_path / "b")


def test_bad_version_dtype_and_truncation_are_clear_errors(tmp_path):
    prefix = write(tmp_path / "a", DOCUMENTS)
    raw = bytearray((tmp_path / "a.idx").read_bytes())
    (tmp_path / "a.idx").write_bytes(raw[:9] + struct.pack("<Q", 2) + raw[17:])
    with pytest.raises(ValueError, match=r"a\.idx has index version 2"):
        IndexedDataset(prefix)
    (tmp_path / "a.idx").write_bytes(raw[:17] + bytes([7]) + raw[18:])
    with pytest.raises(ValueError, match="float32 values, not token ids"):
        IndexedDataset(prefix)
    (tmp_path / "a.idx").write_bytes(b"GARBAGE" + raw[7:])
    with pytest.raises(ValueError, match="no MMIDIDX header"):
        IndexedDataset(prefix)
    (tmp_path / "a.idx").write_bytes(raw)
    (tmp_path / "a.bin").write_bytes((tmp_path / "a.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"a\.bin is truncated: its index points to byte 20 but the file has 18"):
        IndexedDataset(prefix)


def test_pickles_by_path(tmp_path):
    import pickle

    dataset = IndexedDataset(write(tmp_path / "a", DOCUMENTS))
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone[3].tolist() == [9, 9, 9, 9]
