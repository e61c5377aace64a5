"""bench.planner's trace reader: the public traces' formats found by their column names, and a
file it cannot use refused with the line and the problem named."""

from __future__ import annotations

import gzip
import json

import pytest

from bench import planner as planner_bench
from bench import planner_traces
from bench.planner_traces import Arrival
from bench.report import BenchError


def _write(path, text: str, encoding: str = "utf-8"):
    path.write_bytes(text.encode(encoding))
    return path


def test_public_trace_formats_are_read_by_their_column_names(tmp_path):
    # Azure LLM 2023: a byte-order mark, ISO dates with seven fractional digits.
    azure = _write(tmp_path / "azure.csv", "\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.1805900,396,109\n\n")
    assert planner_traces.read_arrivals(azure) == [Arrival(0.0, 374, 44), Arrival(pytest.approx(3.5), 396, 109)]
    # BurstGPT: seconds, the token columns among others, a failed request's 0 response tokens.
    burst = _write(tmp_path / "burstgpt.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n45,GPT-4,1087,0,1087,API log\n5,ChatGPT,472,18,490,Conversation log\n")
    assert planner_traces.read_arrivals(burst) == [Arrival(0.0, 472, 18), Arrival(40.0, 1087, 1)]
    # Mooncake: JSON lines, timestamps in milliseconds, hash ids ignored.
    mooncake = _write(tmp_path / "mooncake.jsonl", '{"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [0, 1]}\n{"timestamp": 2500, "input_length": 6472, "output_length": 26, "hash_ids": [0]}\n')
    assert planner_traces.read_arrivals(mooncake) == [Arrival(0.0, 6955, 52), Arrival(2.5, 6472, 26)]
    # A serving benchmark's log: arrival times in seconds, OpenAI's token names; gzip.
    log = tmp_path / "requests.jsonl.gz"
    with gzip.open(log, "wt") as f:
        f.write(json.dumps({"arrival_time": 10.5, "prompt_tokens": 10, "completion_tokens": 3, "model": "x"}) + "\n")
        f.write(json.dumps({"arrival_time": 11.25, "prompt_tokens": 12.0, "completion_tokens": 4}) + "\n")
    assert planner_traces.read_arrivals(log) == [Arrival(0.0, 10, 3), Arrival(0.75, 12, 4)]
    # Milliseconds named so in a CSV; names compared without case, spaces or underscores.
    millis = _write(tmp_path / "ms.csv", "timestamp_ms,Input Len,OUTPUT_LEN\n1000,5,6\n3500,7,8\n")
    assert planner_traces.read_arrivals(millis) == [Arrival(0.0, 5, 6), Arrival(2.5, 7, 8)]


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("cols.csv", "time,foo\n1,2\n3,4\n", "line 1 names no column for prompt tokens (ContextTokens, input_length, prompt_tokens, Request tokens, ...) or output tokens"),
        ("cols2.csv", "when,prompt_tokens,output_tokens\n1,2,3\n", "line 1 names no column for an arrival time (TIMESTAMP, arrival_time, timestamp_ms, ...): it has 'when', 'prompt_tokens', 'output_tokens'"),
        ("row.csv", "timestamp,input_length,output_length\n1,5,5\n2,5,x\n", "line 3 is not a request (timestamp, input_length, output_length): '2,5,x'"),
        ("short.csv", "timestamp,input_length,output_length\n1,5,5\n2,5\n", "line 3 is not a request"),
        ("half.csv", "timestamp,input_length,output_length\n1,5,5\n2,5.5,5\n", "line 3 is not a request"),
        ("none.csv", "timestamp,input_length,output_length\n1,5,5\n2,0,5\n", "line 3 is not a request"),
        ("date.csv", "timestamp,input_length,output_length\n1,5,5\nyesterday,5,5\n", "line 3 is not a request"),
        ("inf.csv", "timestamp,input_length,output_length\n1,5,5\ninf,5,5\n", "line 3 is not a request"),
        ("one.csv", "timestamp,input_length,output_length\n1,5,5\n", "fewer than two requests"),
        ("instant.csv", "timestamp,input_length,output_length\n7,5,5\n7,6,6\n7,8,8\n", "all 3 requests arrive at the same time"),
        ("empty.csv", "", "empty"),
        ("list.jsonl", '[1, 2, 3]\n', "line 1 is not a JSON object"),
        ("broken.jsonl", '{"timestamp": 1, "input_length": 5, "output_length": 5}\n{"timestamp": 2,\n', "line 2 is not JSON"),
        ("keys.jsonl", '{"timestamp": 1, "input_length": 5, "output_length": 5}\n{"timestamp": 2, "input_length": 5}\n', "line 2 is not a request (timestamp, input_length, output_length)"),
        ("bool.jsonl", '{"timestamp": 1, "input_length": 5, "output_length": 5}\n{"timestamp": 2, "input_length": true, "output_length": 5}\n', "line 2 is not a request"),
    ],
)
def test_a_trace_the_reader_cannot_use_is_refused_naming_the_problem(tmp_path, name, text, problem):
    path = _write(tmp_path / name, text)
    with pytest.raises(BenchError) as raised:
        planner_traces.read_arrivals(path)
    assert str(raised.value).startswith(f"--trace {path}: ") and problem in str(raised.value)


def test_a_file_that_is_not_text_or_not_there_is_refused(tmp_path):
    binary = tmp_path / "trace.csv"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x00")
    with pytest.raises(BenchError, match="cannot be read"):
        planner_traces.read_arrivals(binary)
    with pytest.raises(BenchError, match="no such file"):
        planner_traces.read_arrivals(tmp_path / "missing.csv")


def test_bench_planner_replays_a_burstgpt_trace_end_to_end(tmp_path):
    rows = [f"{i * 0.5:.1f},ChatGPT,{400 + 37 * (i % 11)},{20 + 13 * (i % 7)},0,Conversation log" for i in range(400)]
    trace = _write(tmp_path / "BurstGPT_1.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "\n".join(rows) + "\n")
    out = tmp_path / "planner.json"
    assert planner_bench.main(["--trace", str(trace), "--policies", "static", "splitserve", "--max-prefill", "4", "--max-decode", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["trace_stats"]["num_requests"] == 400 and report["trace_stats"]["span_s"] == pytest.approx(199.5)
    assert set(report["policies"]) == {"static", "splitserve"}
