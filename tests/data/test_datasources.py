"""Prompts from dataset files and reasoning-gym (lightning_fasync.data.files, lightning_fasync.data.gym).

The fixtures in tests/fixtures are tiny made-up files in DAPO-Math-17k's and GSM8K's record shapes
(regenerate them with ``python tests/fixtures/make_fixtures.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from tests.helpers.required import TASKS, require

require(*TASKS, module_level=True)

from lightning_fasync.data.files import FileDataSource, stop_token_ids  # noqa: E402
from lightning_fasync.errors import ConfigError  # noqa: E402
from lightning_fasync.pipeline.state import PipelineError  # noqa: E402
from lightning_fasync.policy import build_char_tokenizer, build_policy  # noqa: E402
from lightning_fasync.types import PromptId, PromptSample, Trajectory  # noqa: E402
from tests.helpers.paths import FIXTURES  # noqa: E402

DAPO = os.path.join(FIXTURES, "dapo_math_sample.parquet")
GSM8K = os.path.join(FIXTURES, "gsm8k_sample.jsonl")
DAPO_ANSWERS = ["1", "24", "58", "29", "735", "84", "28", "10"]
GSM8K_ANSWERS = ["15", "12", "16", "65", "22", "66", "1020", "9"]


@pytest.fixture(scope="module")
def tiny_tok():
    return build_policy("tiny")[1]


@pytest.fixture(scope="module")
def char_tok():
    return build_char_tokenizer()


def _drain(ds, n: int) -> list[PromptSample]:
    return [ds.next_sample() for _ in range(n)]


def test_fixtures_are_small():
    for path in (DAPO, GSM8K):
        assert os.path.getsize(path) < 20_000


# ------------------------------------------------------------------------------------- files


def test_dapo_chat_prompts_with_template(tiny_tok):
    ds = FileDataSource(DAPO, tiny_tok, answer_key="reward_model.ground_truth", shuffle=False)
    samples = _drain(ds, 8)
    assert [s.metadata["answer"] for s in samples] == DAPO_ANSWERS
    s = samples[1]
    assert s.metadata["dataset_index"] == 1 and s.metadata["source"] == "dapo_math_sample.parquet"
    text = s.metadata["prompt_text"]
    assert text.startswith("<|im_start|>user\nSolve the following") and text.endswith("<|im_start|>assistant\n")
    assert "How many positive divisors does $360$ have?" in text
    assert s.input_ids == tiny_tok(text, add_special_tokens=False)["input_ids"]
    assert all(type(t) is int for t in s.input_ids)
    json.dumps(s.to_dict())  # metadata goes into checkpoints
    assert ds.max_prompt_length == max(len(x.input_ids) for x in samples)


def test_gsm8k_string_prompts(tiny_tok, char_tok):
    with_template = FileDataSource(GSM8K, tiny_tok, prompt_key="question", answer_key="answer", shuffle=False)
    plain = FileDataSource(GSM8K, char_tok, prompt_key="question", answer_key="answer", shuffle=False)
    a, b = _drain(with_template, 8), _drain(plain, 8)
    # The `#### N` ending of a GSM8K answer is the ground truth.
    assert [s.metadata["answer"] for s in a] == [s.metadata["answer"] for s in b] == GSM8K_ANSWERS
    assert a[0].metadata["prompt_text"].startswith("<|im_start|>user\nMaya buys 3 notebooks")
    # No chat template: the text itself.
    assert b[0].metadata["prompt_text"].startswith("Maya buys 3 notebooks")
    assert b[0].input_ids == char_tok(b[0].metadata["prompt_text"])["input_ids"]
    assert len(a[0].input_ids) > len(b[0].input_ids)


def test_dapo_without_template_and_no_answer_key(char_tok):
    ds = FileDataSource(DAPO, char_tok, shuffle=False)
    s = ds.next_sample()
    assert s.metadata["answer"] is None
    assert s.metadata["prompt_text"].startswith("Solve the following math problem")


def test_dotted_keys(tiny_tok):
    ds = FileDataSource(DAPO, tiny_tok, prompt_key="prompt", answer_key="extra_info.index", shuffle=False)
    assert ds.next_sample().metadata["answer"] == "dapo-0000"


def test_system_prompt(tiny_tok, char_tok, tmp_path):
    ds = FileDataSource(GSM8K, tiny_tok, prompt_key="question", system_prompt="Think step by step.", shuffle=False)
    text = ds.next_sample().metadata["prompt_text"]
    assert text.startswith("<|im_start|>system\nThink step by step.<|im_end|>\n<|im_start|>user\nMaya")
    plain = FileDataSource(GSM8K, char_tok, prompt_key="question", system_prompt="Be brief.", shuffle=False)
    assert plain.next_sample().metadata["prompt_text"].startswith("Be brief.\nMaya")
    # A record that already starts with a system message keeps its own.
    path = tmp_path / "own_system.jsonl"
    record = {"prompt": [{"role": "system", "content": "Mine."}, {"role": "user", "content": "1+1?"}]}
    path.write_text(json.dumps(record) + "\n")
    own = FileDataSource(str(path), tiny_tok, system_prompt="Not used.")
    text = own.next_sample().metadata["prompt_text"]
    assert text.startswith("<|im_start|>system\nMine.<|im_end|>") and "Not used." not in text


def test_max_prompt_length_drops_and_counts(tiny_tok, capsys):
    lengths = sorted(len(ids) for ids, _ in FileDataSource(DAPO, tiny_tok)._prompts)
    cap = lengths[2]  # keeps the 3 shortest (and any tie)
    ds = FileDataSource(DAPO, tiny_tok, max_prompt_length=cap)
    kept = sum(1 for n in lengths if n <= cap)
    assert ds.dropped_long == 8 - kept and len(ds._prompts) == kept and ds.max_prompt_length <= cap
    err = capsys.readouterr().err
    assert f"FileDataSource: dropped {8 - kept} of 8 prompts longer than {cap} tokens (data_source.max_prompt_length)" in err
    assert FileDataSource(DAPO, tiny_tok, max_prompt_length=10_000).dropped_long == 0
    with pytest.raises(ValueError, match="data_source.max_prompt_length"):
        FileDataSource(DAPO, tiny_tok, max_prompt_length=lengths[0] - 1)


def test_shuffle_is_seeded_and_differs_across_epochs(char_tok):
    def order(seed: int, n: int = 16) -> list[int]:
        ds = FileDataSource(GSM8K, char_tok, prompt_key="question", seed=seed)
        return [s.metadata["dataset_index"] for s in _drain(ds, n)]

    first = order(7)
    assert first == order(7)
    assert sorted(first[:8]) == sorted(first[8:]) == list(range(8))  # each epoch: every prompt once
    assert first[:8] != first[8:]
    assert first != order(8)
    unshuffled = FileDataSource(GSM8K, char_tok, prompt_key="question", shuffle=False)
    assert [s.metadata["dataset_index"] for s in _drain(unshuffled, 8)] == list(range(8))


def test_state_dict_round_trip_and_refuses_other_file(char_tok, tmp_path):
    kwargs = dict(prompt_key="question", answer_key="answer", seed=3)
    ds = FileDataSource(GSM8K, char_tok, **kwargs)
    taken = _drain(ds, 11)  # into the second epoch
    ds.recycle([taken[9]])
    state = json.loads(json.dumps(ds.state_dict()))  # checkpoints hold it as JSON
    assert state["source"] == "gsm8k_sample.jsonl" and state["num_prompts"] == 8
    expected = _drain(ds, 10)
    resumed = FileDataSource(GSM8K, char_tok, **kwargs)
    resumed.load_state_dict(state)
    got = _drain(resumed, 10)
    assert [(s.prompt_id, s.input_ids, s.metadata) for s in got] == [(s.prompt_id, s.input_ids, s.metadata) for s in expected]
    assert got[0].prompt_id == PromptId(1, 1)  # the recycled prompt first
    # A different file (or the same file with other rows) is refused.
    other = FileDataSource(DAPO, char_tok, seed=3)
    with pytest.raises(PipelineError, match="data_source.path"):
        other.load_state_dict(state)
    shorter = tmp_path / "gsm8k_sample.jsonl"
    shorter.write_text("".join(open(GSM8K).readlines()[:5]))
    with pytest.raises(PipelineError, match="data_source.path"):
        FileDataSource(str(shorter), char_tok, **kwargs).load_state_dict(state)
    # The parent's checks stand.
    with pytest.raises(PipelineError, match="data_source.seed"):
        FileDataSource(GSM8K, char_tok, prompt_key="question", seed=4).load_state_dict(state)


def test_directory_and_format(char_tok, tmp_path):
    shutil.copy(GSM8K, tmp_path / "b.jsonl")
    (tmp_path / "a.json").write_text(json.dumps([{"question": "First?", "answer": "x\n#### 1"}]))
    (tmp_path / "notes.txt").write_text("ignored")
    ds = FileDataSource(str(tmp_path), char_tok, prompt_key="question", answer_key="answer", shuffle=False)
    samples = _drain(ds, 9)
    assert [s.metadata["answer"] for s in samples] == ["1", *GSM8K_ANSWERS]
    assert samples[0].metadata["source"] == tmp_path.name and samples[8].metadata["dataset_index"] == 8
    # An unknown extension reads with an explicit format.
    odd = tmp_path / "data.txt"
    shutil.copy(GSM8K, odd)
    with pytest.raises(ValueError, match="data_source.format"):
        FileDataSource(str(odd), char_tok, prompt_key="question")
    assert len(FileDataSource(str(odd), char_tok, prompt_key="question", format="json")._prompts) == 8
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(DAPO, mixed / "a.parquet")
    shutil.copy(GSM8K, mixed / "b.jsonl")
    with pytest.raises(ValueError, match="data_source.format"):
        FileDataSource(str(mixed), char_tok)
    assert len(FileDataSource(str(mixed), char_tok, format="parquet")._prompts) == 8


def test_bad_format_path_and_keys(char_tok, tmp_path):
    with pytest.raises(ValueError, match=r"data_source.format.*parquet, json, jsonl"):
        FileDataSource(GSM8K, char_tok, format="csv")
    with pytest.raises(FileNotFoundError, match="data_source.path"):
        FileDataSource(str(tmp_path / "missing.parquet"), char_tok)
    with pytest.raises(FileNotFoundError, match="data_source.path"):
        FileDataSource(str(tmp_path), char_tok)  # a directory without data files
    with pytest.raises(KeyError, match=r"data_source.prompt_key.*record 0 has no 'prompt'.*answer, question"):
        FileDataSource(GSM8K, char_tok)
    with pytest.raises(KeyError, match=r"data_source.answer_key.*record 0 has no 'truth'.*ground_truth, style"):
        FileDataSource(DAPO, char_tok, answer_key="reward_model.truth")
    path = tmp_path / "holes.jsonl"
    path.write_text(json.dumps({"question": "a?"}) + "\n" + json.dumps({"q": "b?"}) + "\n")
    with pytest.raises(KeyError, match=r"data_source.prompt_key.*record 1 has no 'question'"):
        FileDataSource(str(path), char_tok, prompt_key="question")
    with pytest.raises(ValueError, match="data_source.prompt_key"):
        FileDataSource(DAPO, char_tok, prompt_key="reward_model")  # neither a string nor messages


GOOD_LINE = json.dumps({"question": "1+1?", "answer": "2"})


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": pa.array(rows, pa.string())}), str(path))


# (file name, content, what the message says after the file's name)
MALFORMED = [
    ("empty.jsonl", b"", "is empty (0 bytes), no records"),
    ("blank.jsonl", b"\n\n   \n", "has only blank lines, no records"),
    ("latin1.jsonl", (GOOD_LINE + "\n").encode() + '{"question": "caf\u00e9?"}\n'.encode("latin-1"),
     "is not UTF-8 text: line 2 has the byte 0xe9 at column 18"),
    ("broken.jsonl", (GOOD_LINE + "\n" + '{"question": "2+2?" "answer": "4"}\n' + GOOD_LINE + "\n").encode(),
     "has a line that is not JSON: line 2, column 21: Expecting ',' delimiter"),
    ("number.jsonl", (GOOD_LINE + "\n42\n").encode(),
     "has a line that is not a JSON object (a record): line 2 is int '42'"),
    ("broken.json", b'[\n {"question": "a"},\n {"question": "b" "answer": "2"}\n]\n',
     "is not JSON: line 3, column 19: Expecting ',' delimiter"),
    ("empty_list.json", b"[]", "holds an empty JSON list, no records"),
    ("garbage.parquet", b"not a parquet file " * 20, "is not a parquet file (ArrowInvalid: Parquet magic bytes not found in footer)"),
    ("zero_bytes.parquet", b"", "is empty (0 bytes), not a parquet file"),
    ("no_rows.parquet", None, "has no rows"),
]


@pytest.mark.parametrize("name, content, said", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_file_is_named_in_one_sentence(char_tok, tmp_path, name, content, said):
    path = tmp_path / name
    if content is None:
        _parquet(path, [])
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        FileDataSource(str(path), char_tok, prompt_key="question")
    assert str(info.value) == f"`data_source.path` file {str(path)!r} {said}."


def test_a_malformed_file_in_a_directory_is_named(char_tok, tmp_path):
    (tmp_path / "a.jsonl").write_text(GOOD_LINE + "\n")
    (tmp_path / "b.jsonl").write_text(GOOD_LINE + "\n{oops\n")
    with pytest.raises(ConfigError, match=r"file '.*b\.jsonl' has a line that is not JSON: line 2"):
        FileDataSource(str(tmp_path), char_tok, prompt_key="question")


def test_an_unreadable_file_without_a_known_fault_names_the_readers_error(char_tok, tmp_path, monkeypatch):
    import datasets

    def load_dataset(*args, **kwargs):
        try:
            raise ValueError("the reader's own reason. More text")
        except ValueError as exc:
            raise RuntimeError("An error occurred while generating the dataset") from exc

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    path = tmp_path / "fine.jsonl"
    path.write_text(GOOD_LINE + "\n")
    with pytest.raises(ConfigError) as info:
        FileDataSource(str(path), char_tok, prompt_key="question")
    assert str(info.value) == (f"`data_source.path` file {str(path)!r} cannot be read as json records "
                               "(ValueError: the reader's own reason).")


def test_a_bare_gsm8k_answer(char_tok, tmp_path):
    path = tmp_path / "bare.jsonl"
    answers = ["#### 42", "  ####  7 ", "Half of 10 is 5.\n#### 5", "no marker"]
    path.write_text("".join(json.dumps({"question": "q?", "answer": a}) + "\n" for a in answers))
    ds = FileDataSource(str(path), char_tok, prompt_key="question", answer_key="answer", shuffle=False)
    assert [s.metadata["answer"] for s in _drain(ds, 4)] == ["42", "7", "5", "no marker"]


def test_the_cli_refuses_a_malformed_file_with_exit_2(capsys, tmp_path):
    from lightning_fasync.lightning.cli import main
    from tests.helpers.paths import REPO

    path = tmp_path / "broken.jsonl"
    path.write_text(GOOD_LINE + "\n{oops\n")
    args = ["--config", os.path.join(REPO, "configs", "tiny_cpu_math.yaml"), f"--trainer.default_root_dir={tmp_path}",
            f"--data_source.path={path}", "--data_source.prompt_key=question", "--data_source.answer_key=answer"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"lightning-fasync fit: error: `data_source.path` file {str(path)!r} has a line that is not "
                       "JSON: line 2, column 2: Expecting property name enclosed in double quotes.")


def test_stop_token_ids(tiny_tok, char_tok):
    vocab = tiny_tok.get_vocab()
    expected = [tiny_tok.eos_token_id] + ([vocab["<|im_end|>"]] if "<|im_end|>" in vocab else [])
    assert stop_token_ids(tiny_tok) == expected
    assert stop_token_ids(char_tok) == [char_tok.eos_token_id]
    # A ChatML tokenizer with <|im_end|> in its vocabulary: both, once each.
    chatml = build_char_tokenizer()
    chatml.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chatml.chat_template = tiny_tok.chat_template
    im_end = chatml.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(chatml) == [chatml.eos_token_id, im_end]
    chatml.eos_token = "<|im_end|>"
    assert stop_token_ids(chatml) == [im_end]


# ------------------------------------------------------------------------------------- reasoning-gym


@pytest.fixture(scope="module")
def gym():
    require("reasoning_gym", *TASKS[1:])
    from lightning_fasync.data import gym

    return gym


def _reward(gym, sample: PromptSample, text: str) -> float:
    traj = Trajectory(sample.prompt_id, 0, list(sample.input_ids), metadata={"response_text": text})
    return gym.gym_reward(sample, traj)


@pytest.mark.parametrize("task", ["basic_arithmetic", "leg_counting", "chain_sum"])
def test_gym_prompts_and_reward(gym, tiny_tok, task):
    ds = gym.ReasoningGymDataSource(task, tiny_tok, size=6, seed=5)
    samples = _drain(ds, 6)
    assert sorted(s.metadata["dataset_index"] for s in samples) == list(range(6))
    for s in samples:
        meta = s.metadata
        entry = meta["gym_entry"]
        assert meta["gym_task"] == task and meta["answer"] == entry["answer"]
        assert entry["metadata"]["source_dataset"] == task
        assert meta["prompt_text"].startswith("<|im_start|>user\n" + entry["question"][:20])
        assert s.input_ids == tiny_tok(meta["prompt_text"], add_special_tokens=False)["input_ids"]
        json.dumps(s.to_dict())
        answer = meta["answer"]
        assert _reward(gym, s, f"Let me think. <answer>{answer}</answer>") == 1.0
        assert _reward(gym, s, f"  {answer}\n") == 1.0
        assert _reward(gym, s, "<answer>-987654321</answer>") == 0.0
    # Same seed, same entries.
    again = gym.ReasoningGymDataSource(task, tiny_tok, size=6, seed=5)
    assert [s.metadata for s in _drain(again, 6)] == [s.metadata for s in samples]


def test_gym_options_and_errors(gym, tiny_tok, char_tok, capsys):
    ds = gym.ReasoningGymDataSource(
        "chain_sum", char_tok, size=4, seed=0, task_args={"min_terms": 2, "max_terms": 2}, system_prompt="Sum.", shuffle=False
    )
    s = ds.next_sample()
    assert s.metadata["prompt_text"].startswith("Sum.\n") and s.metadata["gym_entry"]["metadata"]["num_terms"] == 2
    assert _reward(gym, s, f"<answer>{s.metadata['answer']}</answer>") == 1.0
    with pytest.raises(ValueError, match=r"'no_such_task'.*basic_arithmetic"):
        gym.ReasoningGymDataSource("no_such_task", char_tok)
    with pytest.raises(ValueError, match="response_text"):
        gym.gym_reward(s, Trajectory(s.prompt_id, 0, []))
    lengths = sorted(len(ids) for ids, _ in gym.ReasoningGymDataSource("leg_counting", tiny_tok, size=8)._prompts)
    capsys.readouterr()
    short = gym.ReasoningGymDataSource("leg_counting", tiny_tok, size=8, max_prompt_length=lengths[3])
    assert short.dropped_long == sum(1 for n in lengths if n > lengths[3]) > 0
    assert "ReasoningGymDataSource: dropped" in capsys.readouterr().err
    # The state names the task; another task (or size) is refused.
    state = ds.state_dict()
    with pytest.raises(PipelineError, match="datasource_args"):
        gym.ReasoningGymDataSource("basic_arithmetic", char_tok, size=4, seed=0, shuffle=False).load_state_dict(state)


SCREENED = sorted(("eval", t) for t in ("binary_matrix", "n_queens", "spiral_matrix", "string_insertion")) + sorted(
    ("sympy", t) for t in ("countdown", "intermediate_integration", "polynomial_multiplication", "puzzle24",
                           "simple_integration"))


@pytest.mark.parametrize("kind, task", SCREENED)
def test_a_gym_answer_that_would_run_as_code_scores_0_and_runs_nothing(gym, char_tok, tmp_path, kind, task):
    """reasoning-gym scores these tasks' answers with ``eval`` or sympy's ``parse_expr``: the
    policy's text would run in the scoring process. The reference answers still score 1."""
    s = gym.ReasoningGymDataSource(task, char_tok, size=3, seed=1).next_sample()
    assert task in (gym.EVAL_SCORED if kind == "eval" else gym.SYMPY_SCORED)
    assert _reward(gym, s, f"<answer>{s.metadata['answer']}</answer>") == 1.0
    canary = tmp_path / "ran"
    attacks = [f"__import__('os').system('touch {canary}')",
               f"(__import__('os').system('touch {canary}'))!",  # sympy's factorial notation makes it a call
               f"eval(chr(95)*2+'import'+chr(95)*2+'(\"os\").system(\"touch {canary}\")')"]
    for attack in attacks:
        assert _reward(gym, s, f"<answer>{attack}</answer>") == 0.0, attack
        assert not canary.exists(), attack
    # Without the screen the first one runs (reasoning-gym 0.1.25): the screen is what stops it.
    scorer = gym._scorer(task, "{}")
    try:
        scorer(attacks[0], s.metadata["gym_entry"])
    except Exception:  # noqa: BLE001 - a scorer may raise on what its eval returned
        pass
    assert canary.exists()


def test_the_screen_lets_math_through_and_stops_code_and_blow_ups(gym):
    ok = {"countdown": ["(25 - 5) * 4 + 3", "100/4 + 7*2"], "simple_integration": ["x**3/3 + 2*sin(x) + C", "-exp(-X)/2 + C"],
          "polynomial_multiplication": ["-6*x**4 + 3*x**2 - 7", "x^2 + 1"],
          "spiral_matrix": ["1 2 3 6 9 8 7 4 5", "[1, 2, 3, -4]"], "n_queens": ["_ Q\nQ _", "[['_', 'Q'], ['Q', '_']]"],
          "basic_arithmetic": ["open('/etc/passwd')"]}  # a task that compares strings only: anything goes
    bad = {"countdown": ["9**9**9**9", "2**100000", "2**(3**40)", "((10**64)**64)**64", "open('x')", "x.__class__", "getattr(x, y)",
                         "chr(95)", "lambda: 1", "1; 2", "a[0]"],
           "simple_integration": ["exec(x)", "exp(x)__import__", "'x'", "N(pi, 10**8)", "S(x)", "x(1)", "99999!",
                                  " + ".join(f"x**{i % 9}" for i in range(65))],
           "spiral_matrix": ["[1] * 10**9", "__import__('os')", "[x for x in range(9)]", "print(1)", "{1: 2}"],
           "string_insertion": ["'a' * 10**9", "list('ab') + f()"]}
    for task, answers in ok.items():
        assert all(gym.screen_answer(task, a) for a in answers), task
    for task, answers in bad.items():
        assert not any(gym.screen_answer(task, a) for a in answers), [a for a in answers if gym.screen_answer(task, a)]
    assert not gym.screen_answer("basic_arithmetic", "1" * (gym.MAX_ANSWER_CHARS + 1))


def test_every_reasoning_gym_scorer_that_runs_the_answer_is_screened(gym):
    """A reasoning-gym release that scores another task with eval, exec or sympy's parsers fails
    here until the task is screened (or read and found to run only its own data)."""
    import inspect

    from reasoning_gym.factory import DATASETS

    runs_only_its_own_answer = {"number_sorting"}  # eval(entry["answer"]): reasoning-gym's data, not the policy's
    found = set()
    for name, (cls, _) in DATASETS.items():
        source = inspect.getsource(cls.score_answer)
        if re.search(r"(?<![\w.])eval\(|\bexec\(|parse_expr\(|sympify\(|parse_latex\(|\bS\(", source):
            found.add(name)
    assert found, "no reasoning-gym scorer found running its answer: the scan is broken"
    unscreened = found - gym.EVAL_SCORED - gym.SYMPY_SCORED - runs_only_its_own_answer
    assert not unscreened, f"reasoning-gym scorers that run the answer and are not screened: {sorted(unscreened)}"
