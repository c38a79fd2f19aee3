"""Records files: batched crash-safe writes, torn / corrupt / unreadable files reported with the line number."""

from __future__ import annotations

import asyncio
import warnings

import pytest

from kvscope.harness.results.records import (
    JSONL_NAME,
    RecordsError,
    RecordWriter,
    RequestRecord,
    TornRecordWarning,
    compact,
    read_records,
)


def _rec(i: int) -> RequestRecord:
    return RequestRecord(request_id=i, session_id="s", step=i, sent_s=float(i), itl_s=[0.1, 0.2])


def test_batched_writer_flushes_on_timer_count_and_close(tmp_path):
    async def go():
        w = RecordWriter(tmp_path, flush_interval_s=0.05, max_pending=10)
        for i in range(5):
            w.write(_rec(i))
        before = (tmp_path / JSONL_NAME).read_bytes().count(b"\n")
        await asyncio.sleep(0.2)
        after_timer = (tmp_path / JSONL_NAME).read_bytes().count(b"\n")
        for i in range(5, 15):
            w.write(_rec(i))
        at_cap = (tmp_path / JSONL_NAME).read_bytes().count(b"\n")
        w.close()
        return before, after_timer, at_cap

    before, after_timer, at_cap = asyncio.run(go())
    assert before == 0 and after_timer == 5 and at_cap == 15 - 0 - (15 - 15)  # 10 pending hit the cap
    df = read_records(tmp_path)
    assert df["request_id"].tolist() == list(range(15)) and df["itl_s"].iloc[0] == [0.1, 0.2]
    compact(tmp_path)
    assert len(read_records(tmp_path)) == 15 and "length_mismatch" in read_records(tmp_path)


def test_torn_final_line_is_dropped_with_a_warning_naming_the_line(tmp_path):
    with RecordWriter(tmp_path) as w:
        for i in range(3):
            w.write(_rec(i))
    with open(tmp_path / JSONL_NAME, "ab") as f:
        f.write(_rec(3).to_json_line()[:40])
    with pytest.warns(TornRecordWarning, match="line 4"):
        df = read_records(tmp_path)
    assert len(df) == 3


def test_corrupt_middle_line_is_an_error_with_its_number(tmp_path):
    lines = [_rec(i).to_json_line() for i in range(4)]
    lines[1] = b'{"request_id": 1, "session_id": \n'
    (tmp_path / JSONL_NAME).write_bytes(b"".join(lines))
    with pytest.raises(RecordsError, match=r"requests.jsonl: line 2: not a JSON record"):
        read_records(tmp_path)
    (tmp_path / JSONL_NAME).write_bytes(lines[0] + b"[1, 2]\n" + lines[2])
    with pytest.raises(RecordsError, match=r"line 2: not a kvscope request record"):
        read_records(tmp_path)


def test_unreadable_and_missing_files_are_reported(tmp_path):
    with pytest.raises(RecordsError, match="not a kvscope run directory"):
        read_records(tmp_path)
    (tmp_path / JSONL_NAME).mkdir()  # exists but cannot be read as a file
    with pytest.raises(RecordsError, match="unreadable records file"):
        read_records(tmp_path)
    (tmp_path / JSONL_NAME).rmdir()
    (tmp_path / "requests.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(RecordsError, match="unreadable Parquet"):
        read_records(tmp_path)


def test_records_written_before_the_length_mismatch_column_still_read(tmp_path):
    import orjson

    row = orjson.loads(_rec(0).to_json_line())
    row.pop("length_mismatch")
    (tmp_path / JSONL_NAME).write_bytes(orjson.dumps(row) + b"\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        df = read_records(tmp_path)
    assert df["length_mismatch"].tolist() == [False]


def test_version_2_records_read_without_model_routing(tmp_path):
    """Records written before the model-routing columns (version 2), as a JSONL log or a Parquet file, read with
    them empty: no model, no escalation, no wasted attempt."""
    import orjson
    import pandas as pd

    from kvscope.harness.results.records import ROUTING_FIELDS, write_records_parquet

    rows = [orjson.loads(_rec(i).to_json_line()) for i in range(3)]
    for r in rows:
        for col in ROUTING_FIELDS:
            r.pop(col)
    (tmp_path / JSONL_NAME).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    df = read_records(tmp_path)
    assert df["escalated"].tolist() == [False] * 3 and df["model"].isna().all()
    assert df["wasted_output_tokens"].tolist() == [0] * 3
    pd.DataFrame(rows).to_parquet(tmp_path / "requests.parquet")
    df = read_records(tmp_path)
    assert set(ROUTING_FIELDS) <= set(df.columns) and not df["escalated"].any()
    # a version-3 record with an escalation survives the Parquet round trip typed
    rec = RequestRecord(request_id=0, session_id="s", step=0, model="large", route_reason="escalated: x",
                        escalated=True, mean_logprob=-3.5, wasted_model="small", wasted_cached_tokens=16,
                        wasted_output_tokens=4, wasted_sent_s=0.1, wasted_done_s=0.2)
    from kvscope.harness.results.records import records_frame

    write_records_parquet(tmp_path, records_frame([orjson.loads(rec.to_json_line())]))
    back = read_records(tmp_path).iloc[0]
    assert (back["model"], back["escalated"], back["wasted_cached_tokens"], back["mean_logprob"]) == \
        ("large", True, 16, -3.5)
