"""pyklei.batch.lines: the Batch API's input lines (each malformed one named by its line and
field, duplicates refused), the output lines' reproducible ids, and where a partial output left
off (a torn last line cut off, another input's output refused)."""
import json

import pytest

from pyklei.batch import lines as L

GOOD = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}


def _line(**change) -> str:
    obj = {**GOOD, **change}
    return json.dumps({k: v for k, v in obj.items() if v is not ...})


@pytest.mark.parametrize("raw, param, words", [
    ("{not json", "line", "not JSON"),
    ("[1, 2]", "line", "JSON object"),
    (_line(custom_id=...), "custom_id", "'custom_id'"),
    (_line(custom_id=""), "custom_id", "non-empty string"),
    (_line(custom_id=7), "custom_id", "'custom_id'"),
    (_line(method="GET"), "method", "'GET'"),
    (_line(method=...), "method", "None"),
    (_line(url="/v1/responses"), "url", "/v1/responses"),
    (_line(url=...), "url", "'url' must be one of"),
    (_line(body="prompt"), "body", "'body' must be a JSON object"),
    (_line(body=...), "body", "'body'"),
])
def test_a_malformed_line_names_its_line_and_field(raw, param, words):
    line = L.parse_line(7, raw)
    assert line.problem is not None and line.kind is None
    out = L.malformed(line)
    assert out["response"] is None
    err = out["error"]
    assert err["code"] == L.MALFORMED and err["param"] == param and err["line"] == 7
    assert err["message"].startswith("line 7: ") and words in err["message"]
    # the custom_id is kept wherever the line had a usable one
    assert out["custom_id"] == (line.custom_id if param not in ("line", "custom_id") else None)


def test_good_lines_map_to_their_endpoints():
    for url, kind in L.ENDPOINTS.items():
        line = L.parse_line(1, _line(url=url))
        assert line.problem is None and line.kind == kind and line.body == GOOD["body"]


def test_read_input_skips_blank_lines_and_keeps_line_numbers(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_bytes(b"\n".join([_line(custom_id="a").encode(), b"", b"   ",
                              _line(custom_id="b").encode() + b"\r", b"\xff\xfe", b""]))
    lines = L.read_input(p)
    assert [(x.number, x.custom_id) for x in lines] == [(1, "a"), (4, "b"), (5, None)]
    assert lines[1].problem is None                      # a CRLF line is a line
    assert "not UTF-8" in lines[2].problem[0]


def test_duplicate_custom_ids_are_refused_before_anything_runs(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text("\n".join([_line(custom_id="a"), _line(custom_id="b"), _line(custom_id="a")]))
    with pytest.raises(L.BatchInputError, match=r"lines 1 and 3 .*'a'"):
        L.read_input(p)


def test_ids_are_derived_from_the_line_and_differ_between_lines():
    a, b = L.parse_line(1, _line()), L.parse_line(2, _line())
    ra, rb = L.result(a, 200, {}), L.result(b, 200, {})
    assert ra == L.result(L.parse_line(1, _line()), 200, {})          # reproducible
    assert ra["id"] != rb["id"] and ra["response"]["request_id"] != rb["response"]["request_id"]
    assert ra["id"].startswith("batch_req_") and ra["response"]["request_id"].startswith("req_")
    assert L.response_id(a, "chat").startswith("chatcmpl-")
    assert L.response_id(a, "text").startswith("cmpl-")


def test_reproducible_drops_only_what_the_run_decides():
    body = {"id": "x", "created": 5, "choices": [], "timings": {"prompt_tok_s": 1.0},
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                      "prompt_tokens_details": {"cached_tokens": 1},
                      "completion_tokens_details": {"accepted_prediction_tokens": 1}}}
    out = L.reproducible(body, 99)
    assert out == {"id": "x", "created": 99, "choices": [],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "completion_tokens_details": {"accepted_prediction_tokens": 1}}}


def _io(tmp_path, n=4):
    lines = [L.parse_line(i + 1, _line(custom_id=f"c{i}")) for i in range(n)]
    outs = [L.encode(L.result(x, 200, {"n": i})) for i, x in enumerate(lines)]
    return lines, outs, tmp_path / "out.jsonl"


def test_resume_point_cuts_a_torn_last_line(tmp_path):
    lines, outs, out = _io(tmp_path)
    assert L.resume_point(out, lines) == 0                       # no output yet
    out.write_bytes(outs[0] + outs[1] + outs[2][:17])            # killed while writing line 3
    assert L.resume_point(out, lines) == 2
    assert out.read_bytes() == outs[0] + outs[1]                 # the torn part is gone
    out.write_bytes(b"".join(outs))
    assert L.resume_point(out, lines) == 4                       # all done


@pytest.mark.parametrize("what", ["other_input", "too_many", "garbage"])
def test_resume_refuses_an_output_that_is_not_this_inputs(tmp_path, what):
    lines, outs, out = _io(tmp_path)
    if what == "other_input":        # the same custom_ids at other places
        out.write_bytes(outs[1] + outs[0])
    elif what == "too_many":
        out.write_bytes(b"".join(outs))
        lines = lines[:3]
    else:
        out.write_bytes(b"hello\n")
    before = out.read_bytes()
    with pytest.raises(L.BatchInputError, match="not this"):
        L.resume_point(out, lines)
    assert out.read_bytes() == before                            # left as it was
