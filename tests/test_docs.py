"""The README and docs/: the README stays a short product page that opens with the two commands CI
runs, every relative link resolves (file and heading), every documented command names a real
target, script, flag or file (``tr-serve`` lines are parsed by the CLI itself), and nothing in the
repository's text or code speaks of the working sessions that built it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_BYTES = 25_000
DOCS = sorted([README, ROOT / "k8s" / "README.md", ROOT / "tr_serve" / "data" / "README.md",
               *(ROOT / "docs").glob("**/*.md")])
# text and code that must speak of the product only (tr_serve/data/*.jsonl is data: questions)
WORDING_SUFFIXES = {".md", ".py", ".c", ".h", ".sh", ".yaml", ".yml", ".txt", ".toml"}

# A numbered or "this/earlier ..." unit of the project's own work (examples: NUMBERED_WORK below): how
# the project was built, not what it is. A POSIX session (start_new_session), Ray's or an HTTP
# session are product terms.
SESSION_WORDING = re.compile(
    r"\bsessions?[\s-]*\d+"
    r"|\b(?:this|that|earlier|previous|last|next|later|each|every|working)\s+sessions?\b",
    re.IGNORECASE)

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())  # a '#' line inside a code block is no heading
    seen: dict[str, int] = {}
    out = set()
    for line in text.splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def code_blocks(path: Path, languages: tuple[str, ...] = ("bash", "sh")) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang in languages]


def command_lines(block: str) -> list[list[str]]:
    """Each command of a shell block as its words: continuation lines and quotes spanning lines
    joined, comments dropped."""
    commands, pending = [], ""
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        pending = ""
        if words:
            commands.append(words)
    assert not pending, f"unterminated command: {pending!r}"
    return commands


def documented_commands() -> list[tuple[str, list[str]]]:
    return [(rel(doc), words) for doc in DOCS for block in code_blocks(doc) for words in command_lines(block)]


# ---- the README ----------------------------------------------------------------------------------
def test_readme_is_a_short_product_page():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail to docs/ (limit {README_MAX_BYTES})"


def test_readme_opens_with_the_run_and_test_commands_that_ci_runs():
    first = code_blocks(README)[0]
    assert [words for words in command_lines(first)] == [["make", "run"], ["make", "test"]]
    assert README.read_text().index("```") < 600, "the two commands come first"
    ci = [words for words in command_lines((ROOT / ".ci" / "run").read_text()) if words[0] == "make"]
    assert ci and all(words[:2] == ["make", "test"] for words in ci), ".ci/run runs the README's test command"


# ---- links ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {rel(path)}")
    assert not broken, f"{rel(doc)}: " + "; ".join(broken)


# ---- commands ------------------------------------------------------------------------------------
def test_documented_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    used = []
    for doc, words in documented_commands():
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value make ...
            words = words[1:]
        if words[:1] == ["make"]:
            used.append((doc, words[1] if len(words) > 1 else None))
    assert {"run", "test"} <= {target for _, target in used}
    missing = [(doc, target) for doc, target in used if target not in targets]
    assert not missing, f"not targets of the Makefile: {missing}"


def test_documented_tr_serve_commands_parse():
    from tr_serve.cli import build_parser

    commands = [(doc, words) for doc, words in documented_commands() if words[0] == "tr-serve"]
    assert {words[1] for _, words in commands} >= {"run", "generate", "bench", "bench-fleet", "bench-tp",
                                                   "bench-tp-fleet"}
    for doc, words in commands:
        try:
            build_parser().parse_args(words[1:])
        except SystemExit as e:
            pytest.fail(f"{doc}: `{shlex.join(words)}` does not parse (exit {e.code})")


def script_flags(script: Path) -> set[str]:
    """The options a script (or the tr_serve module whose arguments it reuses) declares."""
    sources = [script.read_text()]
    sources += [(ROOT / m.replace(".", "/")).with_suffix(".py").read_text()
                for m in re.findall(r"from (tr_serve\.[\w.]+) import", sources[0])
                if (ROOT / m.replace(".", "/")).with_suffix(".py").exists()]
    return {f for src in sources for f in re.findall(r"[\"'](--[\w-]+)[\"']", src)}


def test_documented_script_commands_name_real_scripts_and_flags():
    checked = 0
    for doc, words in documented_commands():
        scripts = [w for w in words if w.startswith("scripts/") and w.endswith(".py")]
        if not scripts:
            continue
        script = ROOT / scripts[0]
        assert script.exists(), f"{doc}: {scripts[0]} does not exist"
        flags = script_flags(script)
        unknown = [w.split("=")[0] for w in words[words.index(scripts[0]) + 1:]
                   if w.startswith("--") and w.split("=")[0] not in flags]
        assert not unknown, f"{doc}: {scripts[0]} has no option {unknown}"
        checked += 1
    assert checked >= 8


def test_documented_repository_paths_exist():
    prefixes = ("configs/", "k8s/", "scripts/", "tests/", "docs/", "tr_serve/")
    missing = [(doc, w) for doc, words in documented_commands() for w in words
               if w.startswith(prefixes) and "<" not in w and not (ROOT / w).exists()]
    assert not missing, missing


# ---- wording -------------------------------------------------------------------------------------
# spelled from a placeholder, so that this file does not itself speak of how the project was built
NUMBERED_WORK = ["{w} 38", "{W}'s figures", "{w}s 36-37", "the {w}-37 code", "this {w}'s machine",
                 "in an earlier {w}", "{U} 4"]


@pytest.mark.parametrize("template", NUMBERED_WORK)
def test_session_wording_is_recognised(template):
    word = "ses" + "sion"
    text = template.format(w=word, W=word.capitalize() + " 12", U=word.upper())
    assert SESSION_WORDING.search(text)


@pytest.mark.parametrize("text", ["runs in a session of its own", "start_new_session=True", "Ray's session directory",
                                  "HTTP sessions", "@pytest.fixture(scope=\"session\")", "its own session (a new group)"])
def test_product_uses_of_session_are_allowed(text):
    assert not SESSION_WORDING.search(text)


def wording_files() -> list[Path]:
    files = [README, ROOT / "k8s" / "README.md", ROOT / "Makefile", ROOT / "Dockerfile", ROOT / "pyproject.toml"]
    for folder in ("docs", "tr_serve", "scripts", "configs", "k8s", ".ci"):
        files += [p for p in (ROOT / folder).rglob("*")
                  if p.is_file() and (p.suffix in WORDING_SUFFIXES or p.parent.name == ".ci")]
    return sorted({p for p in files if p.exists() and "__pycache__" not in p.parts})


def test_no_session_wording_in_the_repository_text():
    hits = [f"{rel(p)}:{n}: {line.strip()[:100]}" for p in wording_files()
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if SESSION_WORDING.search(line)]
    assert not hits, "speak of the product (dates, commits, machines), not of who worked when:\n" + "\n".join(hits)
