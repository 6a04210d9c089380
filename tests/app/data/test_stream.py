"""RecordStream: seeded shuffle, epochs, rank shares, exact resume (with and without the prefetch thread), bad
records named by file, line and field, Parquet, empty and exhausted datasets."""

from __future__ import annotations

import json
from itertools import islice

import pytest

from app.data import DataError, RecordStream
from rollout.envs.records import RecordError, required


def write_jsonl(path, records, blank_every: int = 0) -> str:
    lines = []
    for i, r in enumerate(records):
        lines.append(r if isinstance(r, str) else json.dumps(r))
        if blank_every and i % blank_every == 0:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def ids(record: dict) -> int:
    return required(record, "id", int)


@pytest.fixture
def two_files(tmp_path):
    """23 records over two files (odd sizes, blank lines that are not records)."""
    a = write_jsonl(tmp_path / "a.jsonl", [{"id": i} for i in range(10)], blank_every=4)
    b = write_jsonl(tmp_path / "b.jsonl", [{"id": i} for i in range(10, 23)])
    return [a, b]


@pytest.mark.parametrize("prefetch", [0, 3], ids=["inline", "prefetch3"])
def test_every_epoch_is_a_seeded_permutation(two_files, prefetch):
    stream = RecordStream(two_files, ids, seed=5, epochs=3, prefetch=prefetch)
    seen = list(stream)
    epochs = [seen[k * 23:(k + 1) * 23] for k in range(3)]
    assert len(seen) == 69
    assert all(sorted(e) == list(range(23)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(23))
    assert list(RecordStream(two_files, ids, seed=5, epochs=3, prefetch=0)) == seen
    assert list(RecordStream(two_files, ids, seed=6, epochs=1))[:23] != epochs[0]


def test_without_shuffle_records_come_in_file_order(two_files):
    assert list(RecordStream(two_files, ids, shuffle=False, epochs=2)) == [*range(23), *range(23)]


def test_ranks_share_each_epoch_disjointly_and_equally(two_files):
    world = 3
    streams = [RecordStream(two_files, ids, seed=1, epochs=2, rank=r, world=world) for r in range(world)]
    shares = [list(s) for s in streams]
    assert all(len(share) == 2 * (23 // world) for share in shares)
    for epoch in range(2):
        parts = [share[epoch * 7:(epoch + 1) * 7] for share in shares]
        union = [x for p in parts for x in p]
        assert len(set(union)) == len(union) == 21
    # Rank r's share is every world-th record of the single-reader order, from r.
    whole = list(RecordStream(two_files, ids, seed=1, epochs=1))
    assert shares[1][:7] == whole[1::3][:7]


@pytest.mark.parametrize("prefetch", [0, 4], ids=["inline", "prefetch4"])
def test_state_round_trip_continues_at_the_next_unseen_record(two_files, prefetch):
    uninterrupted = list(islice(RecordStream(two_files, ids, seed=3, prefetch=prefetch), 60))
    first = RecordStream(two_files, ids, seed=3, prefetch=prefetch)
    head = list(islice(first, 31))  # stops mid-epoch 1; the prefetch thread has read further
    state = json.loads(json.dumps(first.state_dict()))
    assert state["epoch"] == 1 and state["position"] == 8
    resumed = RecordStream(two_files, ids, seed=3, prefetch=prefetch)
    resumed.load_state_dict(state)
    assert head + list(islice(resumed, 29)) == uninterrupted


def test_state_of_another_dataset_is_refused(two_files, tmp_path):
    state = RecordStream(two_files, ids).state_dict()
    with pytest.raises(DataError, match="resuming would not continue"):
        RecordStream(two_files[:1], ids).load_state_dict(state)
    with pytest.raises(DataError, match="resuming would not continue"):
        RecordStream(two_files, ids, seed=9).load_state_dict(state)


BAD = [
    ('{"id": 1', "a.jsonl:2: unreadable line: invalid JSON"),
    ('[1, 2]', "a.jsonl:2: expected a JSON object, got list"),
    ('{"name": "x"}', "a.jsonl:2: field 'id': missing"),
    ('{"id": "7"}', "a.jsonl:2: field 'id': must be an integer, got '7' (str)"),
    ('{"id": true}', "a.jsonl:2: field 'id': must be an integer, got True (bool)"),
]


@pytest.mark.parametrize("line, message", BAD, ids=["json", "not-object", "missing", "type", "bool"])
def test_bad_record_is_an_error_naming_file_line_and_field(tmp_path, line, message):
    path = write_jsonl(tmp_path / "a.jsonl", [{"id": 0}, line, {"id": 2}])
    stream = RecordStream([path], ids, shuffle=False, epochs=1)
    assert next(stream) == 0
    with pytest.raises(DataError) as info:
        next(stream)
    assert message in str(info.value) and 'on_bad_record = "skip"' in str(info.value)


def test_bad_records_are_skipped_counted_and_kept_in_the_state(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"id": 0}, "{oops", {"id": 2}, {"no": 1}, {"id": 4}])
    skipped = []
    stream = RecordStream([path], ids, shuffle=False, epochs=2, on_bad_record="skip", on_skip=skipped.append)
    assert list(islice(stream, 3)) == [0, 2, 4]
    assert stream.skipped == 2 and skipped[1].endswith("a.jsonl:4: field 'id': missing")
    resumed = RecordStream([path], ids, shuffle=False, epochs=2, on_bad_record="skip")
    resumed.load_state_dict(stream.state_dict())
    assert list(resumed) == [0, 2, 4] and resumed.skipped == 4


def test_unreadable_utf8_is_a_bad_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"id": 0}\n{"id": "\xff"}\n')
    stream = RecordStream([str(path)], ids, shuffle=False)
    next(stream)
    with pytest.raises(DataError, match=r"a.jsonl:2: unreadable line: not UTF-8"):
        next(stream)


def test_empty_or_too_small_dataset_is_an_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="no records in .*empty.jsonl"):
        RecordStream([str(empty)], ids)
    two = write_jsonl(tmp_path / "two.jsonl", [{"id": 0}, {"id": 1}])
    with pytest.raises(DataError, match="2 records .* fewer than the 3 ranks"):
        RecordStream([two], ids, rank=0, world=3)
    with pytest.raises(DataError, match="no such file"):
        RecordStream([str(tmp_path / "missing.jsonl")], ids)


def test_exhausted_stream_stops_and_a_saved_end_stays_exhausted(two_files):
    stream = RecordStream(two_files, ids, epochs=1, prefetch=2)
    assert len(list(stream)) == 23
    with pytest.raises(StopIteration):
        next(stream)
    resumed = RecordStream(two_files, ids, epochs=1)
    resumed.load_state_dict(stream.state_dict())
    assert list(resumed) == []
    more = RecordStream(two_files, ids, epochs=2)
    more.load_state_dict(stream.state_dict())
    assert len(list(more)) == 23


def test_parquet_rows_are_records(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [0, 1, 2], "answer": ["a", None, "c"]}), tmp_path / "t.parquet")
    jsonl = write_jsonl(tmp_path / "u.jsonl", [{"id": 3}])

    def answer(record):
        return record["id"], required(record, "answer", str)

    stream = RecordStream([str(tmp_path / "t.parquet"), jsonl], answer, shuffle=False, epochs=1,
                          on_bad_record="skip")
    assert list(stream) == [(0, "a"), (2, "c")] and stream.skipped == 2
    with pytest.raises(DataError, match=r"t.parquet, row 1: field 'answer': missing"):
        list(RecordStream([str(tmp_path / "t.parquet")], answer, shuffle=False))


def test_record_error_without_field_names_the_record(tmp_path):
    def reject(record):
        raise RecordError("not a task")

    path = write_jsonl(tmp_path / "a.jsonl", [{"id": 0}])
    with pytest.raises(DataError, match=r"a.jsonl:1: not a task;"):
        next(RecordStream([path], reject))
