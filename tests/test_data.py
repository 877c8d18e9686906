"""Tests for jaxgrpo.data: JSONL loading and errors, arithmetic task, padding, pipelines."""

import itertools
import json
import types

import numpy as np
import pytest

from jaxgrpo import data
from jaxgrpo.model.tokenizer import Tokenizer
from jaxgrpo.data import DataError


@pytest.fixture(name="tok")
def fixture_tok():
  return Tokenizer.char_level("0123456789+=")


def _write(tmp_path, name, lines):
  path = tmp_path / name
  path.write_text("".join(line + "\n" for line in lines))
  return str(path)


# JSONL loading.


def test_load_jsonl_good_file_keeps_extra_columns_and_skips_blank_lines(tmp_path):
  path = _write(tmp_path, "train.jsonl", [
      json.dumps({"question": "1+1=", "answer": "2", "id": 7}),
      "",
      "   ",
      json.dumps({"question": "2+2=", "answer": 4}),
  ])
  rows = data.load_jsonl(path)
  assert rows == [{"question": "1+1=", "answer": "2", "id": 7},
                  {"question": "2+2=", "answer": "4"}]


def test_a_column_named_like_a_reward_argument_is_refused_with_its_line(tmp_path):
  # Every column reaches the rewards as a keyword; `prompts` would collide with the
  # rendered prompts the scorer passes.
  path = _write(tmp_path, "t.jsonl", [json.dumps({"question": "q", "answer": "a"}),
                                      json.dumps({"question": "q", "answer": "a",
                                                  "prompts": "x"})])
  with pytest.raises(DataError, match=r"t\.jsonl:2: column 'prompts' is a name the rewards "
                     r"are given already; rename it \(reserved: completions, answers, prompts, "
                     r"completion_ids, transcripts, turns\)"):
    data.load_jsonl(path)


def test_load_jsonl_renames_custom_keys(tmp_path):
  path = _write(tmp_path, "t.jsonl", [json.dumps({"problem": "q", "solution": "s"})])
  assert data.load_jsonl(path, "problem", "solution") == [{"question": "q", "answer": "s"}]


def test_load_jsonl_bad_json_names_file_and_line(tmp_path):
  path = _write(tmp_path, "train.jsonl", [
      json.dumps({"question": "a", "answer": "b"}), "", '{"question": "c" "answer": 1}'])
  with pytest.raises(DataError) as err:
    data.load_jsonl(path)
  assert str(err.value) == f"{path}:3: not valid JSON (Expecting ',' delimiter)"


def test_load_jsonl_bad_json_gives_no_second_position(tmp_path):
  # An object cut short at the end of line 7: json reads the line with its newline and
  # reports "line 2 column 1", a position in the line, not the file. Only the file's line 7
  # may be named.
  path = _write(tmp_path, "bad.jsonl",
                [json.dumps({"question": str(i), "answer": "b"}) for i in range(6)]
                + ['{"question": "c", "answer": 1'])
  with pytest.raises(DataError) as err:
    data.load_jsonl(path)
  assert str(err.value) == f"{path}:7: not valid JSON (Expecting ',' delimiter)"


def test_load_jsonl_missing_field_lists_fields(tmp_path):
  path = _write(tmp_path, "t.jsonl", [json.dumps({"a": 1, "b": 2})])
  with pytest.raises(DataError, match=r"t\.jsonl:1: missing field 'question' \(fields: a, b\)"):
    data.load_jsonl(path)


def test_load_jsonl_non_object_line(tmp_path):
  path = _write(tmp_path, "t.jsonl", ["[1, 2]"])
  with pytest.raises(DataError, match=r"t\.jsonl:1: expected a JSON object, got list"):
    data.load_jsonl(path)


# Parquet and `datasets` folders (verl's data lives in Parquet, with nested columns).

VERL_ROWS = [
    {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
     "reward_model": {"style": "rule", "ground_truth": 2}, "extra_info": {"index": 0},
     "question": "1+1?"},
    {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "2+3?"}],
     "reward_model": {"style": "rule", "ground_truth": 5}, "extra_info": {"index": 1},
     "question": "2+3?"},
]


def test_parquet_rows_with_a_nested_answer_key(tmp_path):
  pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
  path = tmp_path / "train.parquet"
  pq.write_table(pa.Table.from_pylist(VERL_ROWS), path)
  rows = data.load_rows(str(path), answer_key="reward_model.ground_truth")
  # The question and the nested answer (a number turned into text, as in JSONL); every
  # column stays, nested ones as dicts, for the rewards.
  assert [(r["question"], r["answer"]) for r in rows] == [("1+1?", "2"), ("2+3?", "5")]
  assert rows[1]["extra_info"] == {"index": 1} and rows[1]["data_source"] == "gsm8k"
  assert rows[0]["reward_model"]["style"] == "rule"


def test_a_parquet_file_without_the_question_column_is_one_line(tmp_path):
  pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
  path = tmp_path / "t.parquet"
  pq.write_table(pa.Table.from_pylist([{"problem": "q", "answer": "a"}]), path)
  with pytest.raises(DataError) as err:
    data.load_rows(str(path))
  assert str(err.value) == f"{path}: no column 'question' (columns: problem, answer)"
  with pytest.raises(DataError, match=r"t\.parquet: row 0: missing field 'answer\.value' "
                     r"\(fields of answer: str\)"):
    data.load_rows(str(path), "problem", "answer.value")
  with pytest.raises(DataError, match=r"nope\.parquet: no such file"):
    data.load_rows(str(tmp_path / "nope.parquet"))


def test_a_datasets_folder_is_read_from_its_arrow_files(tmp_path):
  # What `datasets.Dataset.save_to_disk` writes: Arrow stream files named in state.json.
  pa = pytest.importorskip("pyarrow")
  folder = tmp_path / "ds"
  folder.mkdir()
  for i, part in enumerate((VERL_ROWS[:1], VERL_ROWS[1:])):
    table = pa.Table.from_pylist(part)
    with pa.ipc.new_stream(folder / f"data-0000{i}-of-00002.arrow", table.schema) as w:
      w.write_table(table)
  (folder / "state.json").write_text(json.dumps({"_data_files": [
      {"filename": "data-00000-of-00002.arrow"}, {"filename": "data-00001-of-00002.arrow"}]}))
  rows = data.load_rows(str(folder), answer_key="reward_model.ground_truth")
  assert [r["answer"] for r in rows] == ["2", "5"]


def test_load_jsonl_bad_utf8_names_line(tmp_path):
  path = tmp_path / "t.jsonl"
  path.write_bytes(b'{"question": "a", "answer": "b"}\n{"question": "\xff"}\n')
  with pytest.raises(DataError, match=r"t\.jsonl:2: not valid UTF-8"):
    data.load_jsonl(str(path))


def test_load_jsonl_missing_file(tmp_path):
  path = str(tmp_path / "x.jsonl")
  with pytest.raises(DataError, match=r"x\.jsonl: no such file$"):
    data.load_jsonl(path)


def test_load_jsonl_empty_file(tmp_path):
  path = _write(tmp_path, "x.jsonl", ["", ""])
  with pytest.raises(DataError, match=r"x\.jsonl: empty dataset \(0 usable rows\)"):
    data.load_jsonl(path)


def test_packaged_gsm8k_resolves():
  rows = data.load_jsonl("@gsm8k/test.jsonl")
  assert len(rows) == 1319
  assert rows[0]["answer"].splitlines()[-1].startswith("####")


# Arithmetic task.


def test_arithmetic_format():
  rows = data.arithmetic_examples(200, num_digits=3, seed=0)
  for row in rows:
    a, b = row["question"][:-1].split("+")
    assert len(a) == len(b) == 3 and row["question"].endswith("=")
    assert len(row["answer"]) == 4
    assert int(row["answer"]) == int(a) + int(b)
  assert data.arithmetic_examples(1, num_digits=2, seed=0)[0]["question"].count("+") == 1


def test_arithmetic_deterministic_and_distinct():
  first = data.arithmetic_examples(500, seed=3)
  assert first == data.arithmetic_examples(500, seed=3)
  assert first != data.arithmetic_examples(500, seed=4)
  assert len({r["question"] for r in first}) == 500


def test_arithmetic_train_and_val_disjoint_across_seeds():
  train = {r["question"] for s in range(3) for r in data.arithmetic_examples(3000, seed=s)}
  val = {r["question"] for s in range(3)
         for r in data.arithmetic_examples(500, seed=s, split="val")}
  assert not train & val
  assert all(data.is_val_pair(int(q[:3]), int(q[4:7]), 3) for q in val)


def test_arithmetic_small_space_exhausts_cleanly():
  # 1-digit: 100 pairs, about a tenth of them val; asking for all of a split succeeds.
  num_val = sum(data.is_val_pair(a, b, 1) for a in range(10) for b in range(10))
  assert len(data.arithmetic_examples(num_val, num_digits=1, split="val")) == num_val
  with pytest.raises(DataError, match="only"):
    data.arithmetic_examples(num_val + 1, num_digits=1, split="val")


# Prompts and padding.


def test_render_prompt():
  row = {"question": "2+2?", "answer": "4", "topic": "sums"}
  assert data.render_prompt("Question: {question}\nAnswer:", row) == "Question: 2+2?\nAnswer:"
  assert data.render_prompt("[{topic}] {question}", row) == "[sums] 2+2?"
  with pytest.raises(DataError, match="'nope'"):
    data.render_prompt("{nope}", row)


def test_tokenize_prompts_left_pads_exactly(tok):
  tokens_BxL, mask_BxL = data.tokenize_prompts(tok, ["12+3=", "9", ""], max_prompt_length=7)
  # bos=1, '1'=5, '2'=6, '+'=14, '3'=7, '='=15, '9'=13, pad=0.
  np.testing.assert_array_equal(tokens_BxL, np.array([
      [0, 1, 5, 6, 14, 7, 15],
      [0, 0, 0, 0, 0, 1, 13],
      [0, 0, 0, 0, 0, 0, 1],
  ], dtype=np.int32))
  np.testing.assert_array_equal(mask_BxL, np.array([
      [0, 1, 1, 1, 1, 1, 1],
      [0, 0, 0, 0, 0, 1, 1],
      [0, 0, 0, 0, 0, 0, 1],
  ], dtype=bool))
  assert tokens_BxL.dtype == np.int32 and mask_BxL.dtype == bool


def test_tokenize_prompts_exact_fit_and_too_long(tok):
  tokens_BxL, _ = data.tokenize_prompts(tok, ["123"], max_prompt_length=4)
  np.testing.assert_array_equal(tokens_BxL, [[1, 5, 6, 7]])
  with pytest.raises(DataError, match=r"prompt 1 .* is 5 tokens, longer than "
                     r"max_prompt_length=4"):
    data.tokenize_prompts(tok, ["1", "1234"], max_prompt_length=4)


# Training pipeline.


def _rows(n):
  return [{"question": f"{i:03d}+000=", "answer": f"{i:04d}"} for i in range(n)]


def _take(batches, n):
  return list(itertools.islice(batches, n))


def test_prompt_batches_shapes_and_keys(tok):
  rows = [{**row, "level": i % 3} for i, row in enumerate(_rows(10))]
  batches = data.PromptBatches(rows, tok, batch_size=4, max_prompt_length=9,
                               process_index=0, process_count=1)
  batch = next(batches)
  assert set(batch) == {"prompt_tokens_BxL", "prompt_mask_BxL", "row_ids_B", "prompts",
                        "questions", "answers", "sources", "rows", "batch_offset"}
  assert batch["prompt_tokens_BxL"].shape == (4, 9)
  assert batch["prompt_tokens_BxL"].dtype == np.int32
  assert batch["prompt_mask_BxL"].dtype == bool
  for i, row_id in enumerate(batch["row_ids_B"]):
    assert batch["questions"][i] == batch["prompts"][i] == f"{row_id:03d}+000="
    assert batch["answers"][i] == f"{row_id:04d}"
    # The row itself, every column: what the rewards are given.
    assert batch["rows"][i] == rows[row_id] and "level" in batch["rows"][i]


def test_prompt_batches_each_epoch_is_a_permutation_reshuffled(tok):
  batches = data.PromptBatches(_rows(12), tok, batch_size=4, max_prompt_length=9, seed=1,
                               process_index=0, process_count=1)
  epochs = [np.concatenate([b["row_ids_B"] for b in _take(batches, 3)]) for _ in range(3)]
  for epoch in epochs:
    assert sorted(epoch) == list(range(12))
  assert not np.array_equal(epochs[0], epochs[1])


def test_prompt_batches_processes_slice_the_same_global_batches(tok):
  # batch_size is global: with 2 processes each gets 2 consecutive rows of every 4-row
  # batch, and process 0's slice followed by process 1's is the one-process batch, so a run
  # sees the same prompts on any number of hosts.
  kwargs = dict(tokenizer=tok, batch_size=4, max_prompt_length=9, seed=3)
  alone = _take(data.PromptBatches(_rows(11), process_index=0, process_count=1, **kwargs), 6)
  parts = [_take(data.PromptBatches(_rows(11), process_index=i, process_count=2, **kwargs), 6)
           for i in range(2)]
  for step, whole in enumerate(alone):
    first, second = parts[0][step], parts[1][step]
    assert first["row_ids_B"].shape == (2,) and first["batch_offset"] == 0
    assert second["batch_offset"] == 2
    np.testing.assert_array_equal(np.concatenate([first["row_ids_B"], second["row_ids_B"]]),
                                  whole["row_ids_B"])
    np.testing.assert_array_equal(
        np.concatenate([first["prompt_tokens_BxL"], second["prompt_tokens_BxL"]]),
        whole["prompt_tokens_BxL"])
    assert first["answers"] + second["answers"] == whole["answers"]


def test_prompt_batches_state_resumes_on_another_process_count(tok):
  # The position is global, so a state saved by a 2-process run resumes in 1 process (and
  # the reverse) where it left off.
  kwargs = dict(tokenizer=tok, batch_size=4, max_prompt_length=9, seed=3)
  expected = _take(data.PromptBatches(_rows(11), process_index=0, process_count=1, **kwargs), 5)
  two = data.PromptBatches(_rows(11), process_index=1, process_count=2, **kwargs)
  _take(two, 3)
  one = data.PromptBatches(_rows(11), process_index=0, process_count=1, **kwargs)
  one.set_state(two.get_state())
  assert [b["row_ids_B"].tolist() for b in _take(one, 2)] == [
      b["row_ids_B"].tolist() for b in expected[3:]]


def test_prompt_batches_global_batch_must_split_over_processes(tok):
  with pytest.raises(data.DataError, match="batch_size=3 does not split over 2 processes"):
    data.PromptBatches(_rows(11), tok, batch_size=3, max_prompt_length=9, process_index=0,
                       process_count=2)


def test_prompt_batches_resume_from_state(tok):
  kwargs = dict(tokenizer=tok, batch_size=3, max_prompt_length=9, seed=5,
                process_index=0, process_count=1)
  uninterrupted = data.PromptBatches(_rows(10), **kwargs)
  expected = _take(uninterrupted, 12)
  first = data.PromptBatches(_rows(10), **kwargs)
  _take(first, 5)
  state = json.loads(json.dumps(first.get_state()))  # Survives a JSON checkpoint.
  resumed = data.PromptBatches(_rows(10), **kwargs)
  resumed.set_state(state)
  for want, got in zip(expected[5:], _take(resumed, 7)):
    np.testing.assert_array_equal(want["prompt_tokens_BxL"], got["prompt_tokens_BxL"])
    assert want["answers"] == got["answers"]


def test_prompt_batches_refuses_state_of_other_run(tok):
  kwargs = dict(tokenizer=tok, max_prompt_length=9, process_index=0, process_count=1)
  state = data.PromptBatches(_rows(10), batch_size=3, **kwargs).get_state()
  with pytest.raises(DataError, match="batch_size"):
    data.PromptBatches(_rows(10), batch_size=4, **kwargs).set_state(state)


def test_prompt_batches_too_long_prompt_fails_at_construction(tok):
  rows = _rows(4) + [{"question": "1" * 20, "answer": "0"}]
  with pytest.raises(DataError, match=r"prompt 4 .* is 21 tokens, .* \(1 of 5 prompts"):
    data.PromptBatches(rows, tok, batch_size=2, max_prompt_length=9,
                       process_index=0, process_count=1)


# Validation batches.


def test_validation_batches_pad_with_valid_mask(tok):
  batches = data.validation_batches(_rows(5), tok, batch_size=2, max_prompt_length=9,
                                    process_index=0, process_count=1)
  assert len(batches) == 3
  assert [b["row_ids_B"].tolist() for b in batches] == [[0, 1], [2, 3], [4, 4]]
  assert [b["valid_B"].tolist() for b in batches] == [[1, 1], [1, 1], [1, 0]]
  assert batches[2]["answers"] == ["0004", "0004"]


def test_validation_batches_equal_count_per_process(tok):
  # 5 rows on 2 processes: shares of 3 and 2; both get 2 batches of 2.
  per_process = [data.validation_batches(_rows(5), tok, batch_size=2, max_prompt_length=9,
                                         process_index=i, process_count=2)
                 for i in range(2)]
  assert [len(b) for b in per_process] == [2, 2]
  valid_ids = [int(r) for batches in per_process for b in batches
               for r, v in zip(b["row_ids_B"], b["valid_B"]) if v]
  assert sorted(valid_ids) == list(range(5))
  assert [b["valid_B"].tolist() for b in per_process[1]] == [[1, 1], [0, 0]]


# Sources from a config.


def test_make_sources_arithmetic():
  cfg = types.SimpleNamespace(source="arithmetic", num_digits=2, num_train_examples=50,
                              num_val_examples=8)
  train, val = data.make_sources(cfg)
  assert (len(train), len(val)) == (50, 8)
  assert not {r["question"] for r in train} & {r["question"] for r in val}


def test_make_sources_jsonl_holds_out_tail_of_train(tmp_path):
  path = _write(tmp_path, "t.jsonl",
                [json.dumps({"q": str(i), "a": str(i)}) for i in range(10)])
  cfg = types.SimpleNamespace(source="jsonl", train_path=path, val_path="", question_key="q",
                              answer_key="a", num_train_examples=0, num_val_examples=3)
  train, val = data.make_sources(cfg)
  assert [r["question"] for r in train] == [str(i) for i in range(7)]
  assert [r["question"] for r in val] == ["7", "8", "9"]


def test_make_sources_packaged_gsm8k():
  cfg = types.SimpleNamespace(source="jsonl", train_path="@gsm8k/train.jsonl",
                              val_path="@gsm8k/test.jsonl", num_train_examples=100,
                              num_val_examples=20)
  train, val = data.make_sources(cfg)
  assert (len(train), len(val)) == (100, 20)


def test_make_sources_unknown_source():
  with pytest.raises(DataError, match=r"data\.source='csv' is unknown \(allowed: "
                     r"arithmetic, jsonl\)"):
    data.make_sources(types.SimpleNamespace(source="csv"))


def test_several_validation_files_are_sources(tmp_path):
  for name, n in (("a", 3), ("b", 2)):
    with open(tmp_path / f"{name}.jsonl", "w") as f:
      for i in range(n):
        f.write(json.dumps({"q": f"{name}{i}", "a": str(i)}) + "\n")
  (tmp_path / "train.jsonl").write_text((tmp_path / "a.jsonl").read_text())
  cfg = types.SimpleNamespace(source="jsonl", train_path=str(tmp_path / "train.jsonl"),
                              val_path=f"gsm={tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}",
                              question_key="q", answer_key="a", num_val_examples=0)
  _, val = data.make_sources(cfg)
  # Named by `name=` or by the file's name; the order of the files is kept.
  assert [r["source"] for r in val] == ["gsm"] * 3 + ["b"] * 2
  assert data.source_names(val) == ["b", "gsm"]
  assert data.source_names([{"question": "q", "answer": "a"}]) == []
  with pytest.raises(DataError, match="same source name"):
    data.val_files("x=a.jsonl,x=b.jsonl")


def test_verls_data_source_column_names_a_rows_source(tmp_path):
  """Issue 60: verl's files name each row's source in `data_source`; only `source` was read,
  so a verl user's multi-source validation collapsed to one row of metrics in silence."""
  rows = [{"q": "1+1", "a": "2", "data_source": "openai/gsm8k"},
          {"q": "2+2", "a": "4", "data_source": "math"},
          {"q": "3+3", "a": "6", "data_source": "math", "source": "mine"},  # ours wins
          {"q": "4+4", "a": "8"}]
  with open(tmp_path / "val.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  _, val = data.make_sources(types.SimpleNamespace(
      source="jsonl", train_path=str(tmp_path / "val.jsonl"), val_path=str(tmp_path / "val.jsonl"),
      question_key="q", answer_key="a", num_val_examples=0))
  assert [data.source_of(r) for r in val] == ["openai/gsm8k", "math", "mine", None]
  assert data.source_names(val) == ["math", "mine", "openai/gsm8k", "other"]
  tok = Tokenizer.char_level("0123456789+=")
  batches = data.validation_batches(val, tok, 4, 8)
  assert batches[0]["sources"] == ["openai/gsm8k", "math", "mine", None]


# verl's GSM8K layout (examples/data_preprocess/gsm8k.py): the prompt is chat messages.
VERL_CHAT_ROWS = [
    {"data_source": "openai/gsm8k", "ability": "math",
     "prompt": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "1+1? Let's think step by step."}],
     "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 0}},
    {"data_source": "openai/gsm8k", "ability": "math",
     "prompt": [{"role": "user", "content": "2+3? Let's think step by step."}],
     "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"index": 1}},
]


class _Chat:
  """A chat template stand-in that shows what it was given."""

  def render(self, messages, tools=None):
    return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"


def test_chat_message_prompts_are_read_and_rendered_as_they_are(tmp_path):
  """Issue 48: `question_key=prompt` answered "field 'prompt' is list, expected text"."""
  pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
  path = tmp_path / "train.parquet"
  pq.write_table(pa.Table.from_pylist(VERL_CHAT_ROWS), path)
  rows = data.load_rows(str(path), "prompt", "reward_model.ground_truth")
  assert rows[0]["question"] == VERL_CHAT_ROWS[0]["prompt"] and rows[1]["answer"] == "5"
  prompt = data.ChatPrompt("Q: {question}", _Chat())
  # Every message in order, the system one kept; the text template is not applied.
  assert data.render_prompt(prompt, rows[0]) == (
      "system:Be brief.|user:1+1? Let's think step by step.|assistant:")
  assert data.render_prompt(prompt, {"question": "7+1?"}) == "user:Q: 7+1?|assistant:"
  with pytest.raises(DataError, match="only a chat template renders"):
    data.render_prompt("{question}", rows[0])


def test_a_list_that_is_not_chat_messages_is_one_line(tmp_path):
  path = tmp_path / "t.jsonl"
  path.write_text(json.dumps({"q": [{"role": "user"}], "answer": "1"}) + "\n"
                  + json.dumps({"q": [], "answer": "1"}) + "\n")
  with pytest.raises(DataError, match=r"t\.jsonl:1: field 'q' is a list but its item 0 is "
                     "not a chat message"):
    data.load_rows(str(path), "q")
  path.write_text(json.dumps({"q": [], "answer": "1"}) + "\n")
  with pytest.raises(DataError, match=r"t\.jsonl:1: field 'q' is an empty list"):
    data.load_rows(str(path), "q")
