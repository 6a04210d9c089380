"""RecordStream: seeded shuffle, epochs, rank shares, exact resume (with and without the prefetch thread), bad
records named by file, line and field, Parquet, empty and exhausted datasets."""

from __future__ import annotations

import json
from itertools import islice

import pytest

from app.data import RecordStream
from app.errors import DataError
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
    pq.write_table(pa.table({"id": [0, 1, 2, 3], "tree": ["a", "a", None, "b"]}), tmp_path / "g.parquet")
    assert list(RecordStream([str(tmp_path / "g.parquet")], ids, shuffle=False, epochs=1, group="tree")) == \
        [[0, 1], [2], [3]]
    assert list(RecordStream([str(tmp_path / "t.parquet")], ids, shuffle=False, epochs=1, group="tree")) == \
        [[0], [1], [2]]


def test_record_error_without_field_names_the_record(tmp_path):
    def reject(record):
        raise RecordError("not a task")

    path = write_jsonl(tmp_path / "a.jsonl", [{"id": 0}])
    with pytest.raises(DataError, match=r"a.jsonl:1: not a task;"):
        next(RecordStream([path], reject))


def tree_file(path, trees: list[tuple], **extra) -> str:
    """A JSONL file of records {"id": i, "tree": tree} (no "tree" key where it is None), `trees` = (tree, paths)
    runs in file order, ids counted from extra.get("first", 0)."""
    records, i = [], extra.get("first", 0)
    for tree, paths in trees:
        for _ in range(paths):
            records.append({"id": i} if tree is None else {"id": i, "tree": tree})
            i += 1
    return write_jsonl(path, records, blank_every=extra.get("blank_every", 0))


@pytest.fixture
def tree_files(tmp_path):
    """9 trees over two files: sizes 3, 1, 1 (no id), 2, 4 (int id 7) | 2 ('a' again: another file, another tree), 1
    (int 3), 1 (str '3'), 3."""
    a = tree_file(tmp_path / "a.jsonl", [("a", 3), ("b", 1), (None, 1), ("c", 2), (7, 4)], blank_every=4)
    b = tree_file(tmp_path / "b.jsonl", [("a", 2), (3, 1), ("3", 1), ("d", 3)], first=11)
    return [a, b]


TREES = [[0, 1, 2], [3], [4], [5, 6], [7, 8, 9, 10], [11, 12], [13], [14], [15, 16, 17]]


def test_grouped_units_are_the_runs_of_one_tree_id(tree_files):
    assert list(RecordStream(tree_files, ids, shuffle=False, epochs=1, group="tree")) == TREES
    stream = RecordStream(tree_files, ids, seed=2, epochs=2, group="tree")
    assert stream.units_per_epoch == 9 and stream.state_dict()["dataset"]["units"] == 9
    seen = list(stream)
    epochs = [seen[:9], seen[9:]]
    assert all(sorted(e) == TREES for e in epochs) and epochs[0] != TREES and epochs[0] != epochs[1]


def test_a_tree_id_that_reappears_in_its_file_is_an_error(tmp_path):
    path = tree_file(tmp_path / "a.jsonl", [("a", 2), ("b", 1), (None, 1), ("a", 1)], blank_every=2)
    with pytest.raises(DataError, match=r"a.jsonl:7: tree 'a' reappears after other records \(it began at "
                                        r".*a.jsonl:1\): the records of one tree must be consecutive lines"):
        RecordStream([path], ids, group="tree")
    # Without grouping the ids mean nothing.
    assert len(list(RecordStream([path], ids, epochs=1))) == 5


def test_ungrouped_or_treeless_records_keep_their_order_and_state(two_files):
    """Records without tree ids make one-record units: the same order and state as without grouping."""
    plain, grouped = RecordStream(two_files, ids, seed=4, epochs=2), RecordStream(two_files, ids, seed=4, epochs=2,
                                                                                  group="tree")
    assert [[x] for x in plain] == list(grouped)
    assert plain.state_dict() == grouped.state_dict() and "units" not in grouped.state_dict()["dataset"]


@pytest.mark.parametrize("prefetch", [0, 3], ids=["inline", "prefetch3"])
def test_grouped_state_round_trip_continues_at_the_next_unseen_tree(tree_files, prefetch):
    uninterrupted = list(islice(RecordStream(tree_files, ids, seed=3, prefetch=prefetch, group="tree"), 25))
    first = RecordStream(tree_files, ids, seed=3, prefetch=prefetch, group="tree")
    head = list(islice(first, 13))
    state = json.loads(json.dumps(first.state_dict()))
    assert state["epoch"] == 1 and state["position"] == 4
    resumed = RecordStream(tree_files, ids, seed=3, prefetch=prefetch, group="tree")
    resumed.load_state_dict(state)
    assert head + list(islice(resumed, 12)) == uninterrupted
    with pytest.raises(DataError, match="resuming would not continue"):
        RecordStream(tree_files, ids, seed=3).load_state_dict(state)


def test_ranks_share_whole_trees(tree_files):
    shares = [list(RecordStream(tree_files, ids, seed=1, epochs=1, rank=r, world=2, group="tree")) for r in (0, 1)]
    whole = list(RecordStream(tree_files, ids, seed=1, epochs=1, group="tree"))
    assert shares == [whole[0:8:2], whole[1:8:2]]


def test_a_bad_record_leaves_out_its_whole_tree(tmp_path):
    """A record its parser rejects, or a line that is no JSON object (it belongs to the tree of the line before it),
    skips its tree: `skipped` counts the tree's records. With on_bad_record = "error" the line is named."""
    lines = [{"id": 0, "tree": "a"}, {"id": 1, "tree": "a"}, {"tree": "b"}, {"id": 3, "tree": "b"},
             {"id": 4, "tree": "c"}, "{oops", {"id": 6, "tree": "c"}, {"id": 7, "tree": "d"}]
    path = write_jsonl(tmp_path / "a.jsonl", lines)
    skipped = []
    stream = RecordStream([path], ids, shuffle=False, epochs=1, on_bad_record="skip", on_skip=skipped.append,
                          group="tree")
    assert list(stream) == [[0, 1], [7]] and stream.skipped == 5
    assert skipped[0].endswith("a.jsonl:3: field 'id': missing (with the other 1 records of its tree)")
    assert skipped[1].endswith("a.jsonl:6: unreadable line: invalid JSON (Expecting property name enclosed in "
                               "double quotes at column 2) (with the other 2 records of its tree)")
    stream = RecordStream([path], ids, shuffle=False, epochs=1, group="tree")
    assert next(stream) == [0, 1]
    with pytest.raises(DataError, match=r"a.jsonl:3: field 'id': missing; fix the record"):
        next(stream)
