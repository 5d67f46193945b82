"""``tr-serve bench --workload``: conversations whose later requests quote the earlier answers."""

from __future__ import annotations

import json

import pytest

from tr_serve.bench.config import BenchConfig
from tr_serve.bench.records import BenchError
from tr_serve.bench.runner import run_bench
from tr_serve.bench.workloads import REVISIONS, FollowUp, build_workload, extract_code
from tr_serve.data import SPEC_BENCH_DEV


class WordTokenizer:
    """Enough of a tokenizer for prompts: words to ids and back, a chat template that joins turns."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def encode_text(self, text: str) -> list[int]:
        return [self.ids.setdefault(w, len(self.ids)) for w in text.split(" ")]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        words = {i: w for w, i in self.ids.items()}
        return " ".join(words[i] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True, **_):
        text = " ".join(f"{m['role']}: {m['content']}" for m in messages)
        return self.encode_text(text) if tokenize else text


def test_multi_turn_conversations_quote_the_first_answer_in_the_second_turn():
    tok = WordTokenizer()
    work = build_workload("multi-turn", str(SPEC_BENCH_DEV), per_category=1, warmup=2)
    rows = [json.loads(line) for line in SPEC_BENCH_DEV.read_text().splitlines() if line.strip()]
    two_turn_categories = list(dict.fromkeys(r["category"] for r in rows if len(r["turns"]) > 1))
    assert len(work.chosen) == 2 * len(two_turn_categories)
    assert [q.category for q in work.chosen[:2]] == ["turn-1", "turn-2"] and work.categories == ["turn-1", "turn-2"]
    first, second = work.chosen[:2]
    assert isinstance(second, FollowUp) and second.source is first and second.question_id == f"{first.question_id}/2"
    used = {q.question_id for q in work.chosen}
    assert len(work.warm) == 2 and not {q.question_id for q in work.warm} & used  # never a measured question
    work.prepare(first, tok)
    work.answered(first, tok.encode_text("the first answer"), tok)
    work.prepare(second, tok)
    text = tok.decode(second.prompt_ids)
    assert text.startswith(f"user: {first.text}") and "assistant: the first answer user:" in text
    assert text.endswith(second.text)


def test_code_revisions_hand_the_answers_code_back_with_one_change():
    tok = WordTokenizer()
    work = build_workload("code-revision", str(SPEC_BENCH_DEV), per_category=2, warmup=1)
    assert [q.category for q in work.chosen] == (["code-write"] + ["code-revise"] * len(REVISIONS)) * 2
    write, revise = work.chosen[0], work.chosen[1]
    work.prepare(write, tok)
    work.answered(write, tok.encode_text("Here: ```python\ndef f(x):\n    return x\n``` done"), tok)
    work.prepare(revise, tok)
    text = tok.decode(revise.prompt_ids)
    assert "```\ndef f(x):\n    return x\n```" in text and "Here:" not in text and "done" not in text
    assert REVISIONS[0] in text


def test_extract_code_takes_the_first_fenced_block_or_the_whole_answer():
    assert extract_code("a\n```py\nx = 1\n```\nb\n```\ny\n```") == "x = 1"
    assert extract_code("text then ```python\nx = 1\nno closing fence") == "x = 1\nno closing fence"
    assert extract_code("  no code at all ") == "no code at all"


def test_unknown_workloads_and_files_without_usable_questions_are_refused(tmp_path):
    with pytest.raises(BenchError):
        build_workload("agentic", str(SPEC_BENCH_DEV), 1, 0)
    one_turn = tmp_path / "q.jsonl"
    one_turn.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Hi?"]}) + "\n")
    with pytest.raises(BenchError):
        build_workload("multi-turn", str(one_turn), 1, 0)
    with pytest.raises(BenchError):
        build_workload("code-revision", str(one_turn), 1, 0)
    with pytest.raises(BenchError):
        BenchConfig(workload="agentic").validate()
    with pytest.raises(BenchError):
        BenchConfig(trees=("2.2.2",), suffix_index="on").validate()  # only tree auto has a suffix index


def test_bench_runs_a_multi_turn_workload_with_and_without_the_suffix_index(loaded, tmp_path, question_file):
    q = question_file()  # question 1 has a second turn
    out = tmp_path / "bench.json"
    cfg = BenchConfig(questions=str(q), per_category=1, max_new_tokens=8, trees=("auto",), warmup=1, pld=False,
                      hf=False, json_out=str(out), workload="multi-turn", suffix_index="both")
    result = run_bench(cfg, loaded=loaded, progress=False)
    assert result["workload"] == "multi-turn" and result["suffix_index"] == "both"
    assert result["question_ids"] == [1, "1/2"] and result["categories"] == ["turn-1", "turn-2"]
    assert result["warmup_question_ids"] == [2]
    methods = result["methods"]
    assert list(methods) == ["baseline", "tr:auto", "tr:auto-nosuffix"]
    for name, m in methods.items():
        assert m["identical"] in (True, None), (name, m.get("mismatches"))
        assert set(m["per_category"]) == {"turn-1", "turn-2"}
    assert methods["tr:auto"]["identical"] and methods["tr:auto-nosuffix"]["identical"]
