"""AnswerEnv: records -> tasks (errors name the field), reward by exact or numeric match, retries with feedback."""

from __future__ import annotations

import pytest

from rollout.envs import AnswerEnv, AssistantTurn, RecordError


def turn(content: str, finished: bool = True) -> AssistantTurn:
    return AssistantTurn(text=content, content=content, finished=finished)


@pytest.mark.parametrize("reply, reward", [
    ("Paris", 1.0), ("  Paris \n", 1.0), ("<think>\nFrance's capital...\n</think>\n\nParis", 1.0),
    ("paris", 0.0), ("Paris.", 0.0), ("It is Paris", 0.0),
], ids=["same", "whitespace", "reasoning", "case", "punctuation", "sentence"])
def test_exact_match(reply, reward):
    env = AnswerEnv()
    task = env.task_from_record({"prompt": "What is the capital of France?", "answer": "Paris"})
    state = env.reset(task).state
    step = env.step(state, turn(reply))
    assert (step.reward, step.done, step.messages) == (reward, True, [])


@pytest.mark.parametrize("reply, reward", [
    ("42", 1.0), ("The answer is 42.", 1.0), ("41, no: 42.0", 1.0), ("\\boxed{42}", 1.0), ("4.2e1", 1.0),
    ("42.001", 0.0), ("42 or 43", 0.0), ("no idea", 0.0),
], ids=["bare", "sentence", "last", "boxed", "exponent", "close", "not-last", "none"])
def test_numeric_match_reads_the_last_number(reply, reward):
    env = AnswerEnv(match="numeric")
    task = env.task_from_record({"prompt": "6*7?", "answer": 42})
    assert env.step(env.reset(task).state, turn(reply)).reward == reward


def test_numeric_answers_with_commas_and_strings():
    env = AnswerEnv(match="numeric")
    task = env.task_from_record({"prompt": "?", "answer": "1,234.5"})
    assert task.value == 1234.5
    assert env.step(env.reset(task).state, turn("It is 1,234.5")).reward == 1.0


def test_a_cut_off_reply_earns_nothing():
    env = AnswerEnv()
    task = env.task_from_record({"prompt": "?", "answer": "Paris"})
    assert env.step(env.reset(task).state, turn("Paris", finished=False)).reward == 0.0


def test_attempts_give_feedback_until_right_or_out_of_turns():
    env = AnswerEnv(attempts=3, feedback="No.")
    task = env.task_from_record({"prompt": "?", "answer": "Paris"})
    state = env.reset(task).state
    wrong = env.step(state, turn("Lyon"))
    assert (wrong.reward, wrong.done, wrong.tool_failed) == (0.0, False, True)
    assert wrong.messages == [{"role": "user", "content": "No."}]
    assert env.step(state, turn("Lyon")) == wrong  # the state is not modified
    right = env.step(wrong.state, turn("Paris"))
    assert (right.reward, right.done) == (1.0, True)
    last = env.step(env.step(wrong.state, turn("Nice")).state, turn("Lille"))
    assert (last.reward, last.done) == (0.0, True)


def test_records_with_messages_and_system_prompts():
    env = AnswerEnv(system="Be brief.")
    task = env.task_from_record({"messages": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris"})
    assert [m["role"] for m in env.reset(task).messages] == ["system", "user"]
    own = env.task_from_record({"prompt": "?", "answer": "x", "system": "Think."})
    assert env.reset(own).messages[0] == {"role": "system", "content": "Think."}
    assert env.solutions(task) == [[{"role": "assistant", "content": "Paris"}]]
    assert env.task_from_record({"prompt": "?", "answer": 3.0}).answer == "3"


@pytest.mark.parametrize("record, field, message", [
    ({"answer": "x"}, "prompt", "missing"),
    ({"prompt": 3, "answer": "x"}, "prompt", "must be a string"),
    ({"prompt": "?"}, "answer", "missing"),
    ({"prompt": "?", "answer": True}, "answer", "must be a string or a number"),
    ({"messages": [{"role": "user"}], "answer": "x"}, "messages", "message 0 must be"),
    ({"messages": [{"role": "assistant", "content": "hi"}], "answer": "x"}, "messages", "must end with a user"),
], ids=["no-prompt", "prompt-type", "no-answer", "answer-type", "message-content", "last-role"])
def test_bad_records_name_the_field(record, field, message):
    with pytest.raises(RecordError, match=message) as info:
        AnswerEnv().task_from_record(record)
    assert info.value.field == field


def test_a_record_may_choose_its_match():
    env = AnswerEnv()
    task = env.task_from_record({"prompt": "6*7?", "answer": 42, "match": "numeric"})
    assert env.step(env.reset(task).state, turn("It is 42.")).reward == 1.0
    with pytest.raises(RecordError, match="must be 'exact' or 'numeric'"):
        env.task_from_record({"prompt": "?", "answer": 1, "match": "fuzzy"})


def test_numeric_match_needs_a_numeric_answer():
    with pytest.raises(RecordError, match="must be a finite number") as info:
        AnswerEnv(match="numeric").task_from_record({"prompt": "?", "answer": "Paris"})
    assert info.value.field == "answer"
