"""kvfid.inputs.items: deterministic arithmetic set, JSON Lines loading, specs, the answer matcher."""

import ast
import json
import operator
import random
import re

import pytest

from kvfid.inputs.items import (
    ARITH_DEFAULT_N,
    Item,
    arith_items,
    jsonl_items,
    load_item_set,
    match_answer,
)


# --- arithmetic set -----------------------------------------------------------------------------

def test_arith_is_deterministic_and_seed_dependent():
    assert arith_items(40, seed=3) == arith_items(40, seed=3)
    assert arith_items(40, seed=3) != arith_items(40, seed=4)


def test_arith_prefix_property():
    full = arith_items(200, seed=7)
    for k in (0, 1, 17, 199):
        assert arith_items(k, seed=7) == full[:k]


def test_arith_does_not_touch_global_random_state():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    arith_items(50)
    assert random.random() == expected


def test_arith_ids_prompts_and_answers_are_well_formed():
    items = arith_items(300)
    assert [it.id for it in items[:3]] == ["arith-0000", "arith-0001", "arith-0002"]
    assert len({it.id for it in items}) == len({it.prompt for it in items}) == 300
    for it in items:
        assert re.fullmatch(r"-?\d+", it.answer), it
        assert it.prompt.endswith("?")


def test_arith_mixes_direct_and_word_problems():
    prompts = [it.prompt for it in arith_items(200)]
    direct = [p for p in prompts if p.startswith("What is ")]
    assert 40 < len(direct) < 160
    assert len({p.split()[1] for p in prompts if not p.startswith("What is ")}) > 3


def _evaluate(node):
    """Integer + - * expression tree from ast (Python's precedence is the problem's precedence)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
    assert isinstance(node, ast.BinOp) and type(node.op) in ops, ast.dump(node)
    return ops[type(node.op)](_evaluate(node.left), _evaluate(node.right))


def test_arith_direct_answers_are_right():
    for it in arith_items(300, seed=11):
        if it.prompt.startswith("What is "):
            expression = ast.parse(it.prompt[len("What is "):-1], mode="eval").body
            assert str(_evaluate(expression)) == it.answer, it
        assert match_answer(f"The answer is {it.answer}.", it.answer) is True


def test_arith_known_word_problem_answer():
    item = next(it for it in arith_items(100) if "pencils" in it.prompt)
    per_box, boxes, given = map(int, re.findall(r"\d+", item.prompt))
    assert item.answer == str(per_box * boxes - given)


def test_arith_rejects_negative_count():
    with pytest.raises(ValueError):
        arith_items(-1)


# --- JSON Lines ---------------------------------------------------------------------------------

def _write(tmp_path, lines):
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_reads_fields_defaults_and_skips_blank_lines(tmp_path):
    path = _write(tmp_path, [
        json.dumps({"prompt": "What is 2+2?", "answer": "4"}),
        "",
        json.dumps({"id": "q-ünï", "prompt": "Say hi."}),
        json.dumps({"prompt": "What is 6*7?", "answer": 42}),
    ])
    assert jsonl_items(path) == [
        Item("jsonl-1", "What is 2+2?", "4"),
        Item("q-ünï", "Say hi.", None),
        Item("jsonl-4", "What is 6*7?", "42"),
    ]


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"answer": "4"}', "`prompt` is required"),
    ('{"prompt": ""}', "`prompt` is required"),
    ('{"prompt": 5}', "`prompt` is required"),
    ('{"prompt": "x", "answr": "4"}', "unknown key"),
    ('{"prompt": "x", "answer": [4]}', "`answer` must be"),
    ('{"prompt": "x", "answer": true}', "`answer` must be"),
    ('{"prompt": "x", "answer": "Paris"}', "not a number"),
])
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad_line, message):
    path = _write(tmp_path, [json.dumps({"prompt": "fine"}), bad_line])
    with pytest.raises(ValueError, match=message) as info:
        jsonl_items(path)
    assert f"{path}:2" in str(info.value)


def test_jsonl_duplicate_ids_are_rejected(tmp_path):
    path = _write(tmp_path, [json.dumps({"id": "a", "prompt": "x"}),
                             json.dumps({"id": "a", "prompt": "y"})])
    with pytest.raises(ValueError, match=r"already used on line 1"):
        jsonl_items(path)


# --- specs --------------------------------------------------------------------------------------

def test_load_item_set_arith(tmp_path):
    assert load_item_set("arith", n=5, seed=2) == arith_items(5, seed=2)
    assert len(load_item_set("arith")) == ARITH_DEFAULT_N


def test_load_item_set_jsonl(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": f"p{i}"}) for i in range(4)])
    assert [it.prompt for it in load_item_set(f"jsonl:{path}")] == ["p0", "p1", "p2", "p3"]
    assert [it.prompt for it in load_item_set(f"jsonl:{path}", n=2)] == ["p0", "p1"]
    with pytest.raises(ValueError, match="fewer than the 5"):
        load_item_set(f"jsonl:{path}", n=5)


@pytest.mark.parametrize("spec", ["gsm8k", "jsonl:", "Arith", "json:x.jsonl", ""])
def test_load_item_set_unknown_spec_lists_valid_forms(spec):
    with pytest.raises(ValueError, match=r"valid forms: arith, arith-easy, jsonl:<path>"):
        load_item_set(spec)


def test_arith_easy_is_one_digit_addition_and_a_prefix_set():
    items = load_item_set("arith-easy", n=20, seed=3)
    assert items[:5] == load_item_set("arith-easy", n=5, seed=3)
    assert len({it.prompt for it in items}) == 20
    for it in items:
        a, b = (int(w) for w in it.prompt.split() if w.isdigit())
        assert 2 <= a <= 9 and 2 <= b <= 9 and it.answer == str(a + b)
        assert it.id.startswith("arith-easy-") and it.prompt.endswith("have now?")
    assert {it.prompt for it in items}.isdisjoint(it.prompt for it in arith_items(20, seed=3))


# --- matcher ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, answer, expected", [
    ("17*23 = 391", "391", True),
    ("First 12, then 7, so the answer is 391.", "391", True),  # last number wins
    ("The answer is 391, not 12.", "391", False),
    ("It is 391 apples.\n\nCheck: 17*23 = 390 + 1", "391", False),
    ("x = -5", "-5", True),
    ("x = \u22125", "-5", True),  # Unicode minus sign
    ("between 3-5", "5", True),  # a hyphen after a digit is not a minus
    ("10-2=8", "8", True),
    ("The total is 1,234 pencils", "1234", True),
    ("The total is 1,234,567.", "1,234,567", True),
    ("**$2,500**", "2500", True),
    ("\\boxed{42}", "42", True),
    ("It comes to 42.0", "42", True),
    ("about 3.5", "3", False),
    ("about 3.5", "5", False),
    ("no digits here", "4", False),
    ("", "0", False),
    ("0", "0", True),
])
def test_match_answer(text, answer, expected):
    assert match_answer(text, answer) is expected


def test_match_answer_without_reference_is_none():
    assert match_answer("42", None) is None


@pytest.mark.parametrize("answer", ["Paris", "", "NaN"])
def test_match_answer_needs_a_numeric_reference(answer):
    with pytest.raises(ValueError, match="not a number"):
        match_answer("42", answer)
