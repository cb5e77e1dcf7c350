"""Every command in README.md and docs/*.md runs as written.

The fenced shell blocks (bash, sh, shell, console, or unlabelled blocks that mention ``ray_jobs/``) are read with
their backslash-continued lines joined. For every ``python ray_jobs/<job>.py`` (directly or after ``ray job submit
... --``): the job exists, each ``--config PATH`` exists (relative to the repo root), and each ``--set key=value`` key
is a key of that job's config model (``jobconfig.loader.check_key``, what the job itself runs). ``python
scripts/*.py``, ``python benchmarks/*.py``, ``python -m <module>`` and ``make <target>`` must name something that
exists. Values are not checked (``$PWD``, ``YOUR-BUCKET`` and ``<run>`` are fine there); keys and paths are.

A ``console`` block may show a failing command on purpose: ``$ command`` followed by output starting with
``error:``. Such a command must then be caught, with the documented message.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
JOB_OPTIONS = {"--config", "--set", "--help", "-h"}
SEPARATORS = {"&&", "||", ";", "|"}
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
PYTHON = re.compile(r"(^|/)python(3(\.\d+)?)?$")


@dataclass
class Command:
    source: str  # "README.md:42"
    text: str
    expected_error: str | None = None  # a console block's documented "error: ..." output


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(language, line number of the block's first line, lines) of every fenced code block."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, language, start = match.group(1), match.group(2).lower(), i + 2
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append((language, start, body))
        i += 1
    return blocks


def _join_continuations(lines: list[str], first: int) -> list[tuple[int, str]]:
    joined, buffer, start = [], "", None
    for number, line in enumerate(lines, first):
        if start is None:
            start = number
        if line.rstrip().endswith("\\"):
            buffer += line.rstrip()[:-1] + " "
            continue
        joined.append((start, buffer + line))
        buffer, start = "", None
    if buffer:
        joined.append((start, buffer))
    return joined


def shell_commands(label: str, text: str) -> list[Command]:
    """The commands of the shell blocks of one markdown text, each with ``label:line``."""
    commands = []
    for language, first, body in fenced_blocks(text):
        if not (language in SHELL_LANGUAGES or (language == "" and any("ray_jobs/" in b for b in body))):
            continue
        if language == "console":
            prompt_lines = [(n, b) for n, b in enumerate(body) if b.startswith("$ ")]
            for k, (n, line) in enumerate(prompt_lines):
                end = prompt_lines[k + 1][0] if k + 1 < len(prompt_lines) else len(body)
                output = [o for o in body[n + 1:end] if o.strip()]
                expected = output[0].strip() if output and output[0].strip().startswith("error:") else None
                commands.append(Command(f"{label}:{first + n}", line[2:], expected))
            continue
        for number, line in _join_continuations(body, first):
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(Command(f"{label}:{number}", line.strip()))
    return commands


def _segments(text: str) -> list[list[str]]:
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    segments, current = [], []
    for token in lexer:
        if token in SEPARATORS:
            segments.append(current)
            current = []
        else:
            current.append(token)
    segments.append(current)
    return [s for s in segments if s]


@functools.lru_cache(maxsize=None)
def job_config_model(job: str):
    """The pydantic model a job parses its command line into: the first argument of its ``parse_job_args`` call,
    taken from the job module (imported, not run: jobs run under ``if __name__ == "__main__"``)."""
    path = ROOT / "ray_jobs" / f"{job}.py"
    tree = ast.parse(path.read_text(), str(path))
    names = [node.args[0].id for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, "id", getattr(node.func, "attr", None)) == "parse_job_args"
             and node.args and isinstance(node.args[0], ast.Name)]
    if not names:
        raise LookupError(f"ray_jobs/{job}.py calls no parse_job_args(Model, ...)")
    saved_env, saved_path = dict(os.environ), list(sys.path)
    sys.path[:0] = [str(ROOT / "ray_jobs"), str(ROOT)]
    try:
        spec = importlib.util.spec_from_file_location(f"_docs_job_{job}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:  # _bootstrap sets the local-Ray environment on import: leave this process as it was
        sys.path[:] = saved_path
        os.environ.clear()
        os.environ.update(saved_env)
    return getattr(module, names[0])


def _check_job(job_path: str, args: list[str], root: Path) -> list[str]:
    from jobconfig.loader import ConfigError, check_key

    problems = []
    job = Path(job_path).stem
    if not (root / job_path).is_file():
        return [f"no job {job_path}"]
    model = job_config_model(job) if root == ROOT else None
    i = 0
    while i < len(args):
        option, _, inline = args[i].partition("=")
        if option not in JOB_OPTIONS:
            problems.append(f"{job_path} takes --config, --set and --help, not {args[i]!r}")
            i += 1
            continue
        if option in ("--help", "-h"):
            i += 1
            continue
        if inline:
            value = inline
            i += 1
        elif i + 1 < len(args):
            value = args[i + 1]
            i += 2
        else:
            problems.append(f"{option} without a value")
            break
        if option == "--config":
            if not (root / value).is_file():
                problems.append(f"--config {value}: no such file")
        elif "=" not in value:
            problems.append(f"--set expects key=value, got {value!r}")
        elif model is not None:
            try:
                check_key(model, value.split("=", 1)[0].strip())
            except ConfigError as exc:
                problems.append(f"--set {value}: {exc}")
    return problems


def _make_targets(root: Path) -> set[str]:
    makefile = root / "Makefile"
    text = makefile.read_text() if makefile.exists() else ""
    return {m.group(1) for m in re.finditer(r"^([\w.-]+)\s*:(?!=)", text, re.MULTILINE)}


def check_command(command: Command, root: Path = ROOT) -> list[str]:
    """What is wrong with one command (empty when it would run as written)."""
    problems = []
    for tokens in _segments(command.text):
        if tokens[0] == "make" and len(tokens) > 1 and not tokens[1].startswith("-") and "=" not in tokens[1]:
            if tokens[1] not in _make_targets(root):
                problems.append(f"make {tokens[1]}: no such target in Makefile")
        for i, token in enumerate(tokens[:-1]):
            if not PYTHON.search(token):
                continue
            target = tokens[i + 1]
            if target == "-m" and i + 2 < len(tokens):
                module = tokens[i + 2].replace(".", "/")
                top = module.split("/")[0]
                if (root / top).is_dir() and not ((root / f"{module}.py").is_file()
                                                 or (root / module / "__main__.py").is_file()):
                    problems.append(f"python -m {tokens[i + 2]}: no such module")
            elif target.startswith("ray_jobs/"):
                problems += _check_job(target, tokens[i + 2:], root)
            elif target.startswith(("scripts/", "benchmarks/")) and "<" not in target:
                if not (root / target).is_file():
                    problems.append(f"no script {target}")
    return problems


def check_docs(texts: dict[str, str], root: Path = ROOT) -> list[str]:
    """Every problem of every shell command in ``{label: markdown}``, as ``label:line: command: problem``."""
    report = []
    for label, text in texts.items():
        for command in shell_commands(label, text):
            problems = check_command(command, root)
            if command.expected_error is None:
                report += [f"{command.source}: {command.text}\n    {p}" for p in problems]
                continue
            documented = command.expected_error.removeprefix("error:").strip().split("...")[0].strip()
            if not any(documented in p for p in problems):
                report.append(f"{command.source}: {command.text}\n    documented to fail with {documented!r}, "
                              f"checker found {problems or 'nothing wrong'}")
    return report


def _texts() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in doc_files() if p.exists()}


def test_every_documented_command_runs_as_written():
    texts = _texts()
    commands = [c for label, text in texts.items() for c in shell_commands(label, text)]
    jobs = {Path(t).stem for c in commands for s in _segments(c.text) for t in s if t.startswith("ray_jobs/")}
    # the quick start names every job a user submits
    shipped = {p.stem for p in (ROOT / "ray_jobs").glob("*.py") if not p.name.startswith("_")}
    report = check_docs(texts)
    assert not report, "commands in the docs that would not run as written:\n" + "\n".join(report)
    assert shipped <= jobs, f"jobs with no documented command: {sorted(shipped - jobs)}"


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#+\s+(.+?)\s*$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_relative_links_in_the_docs_resolve():
    """Every relative link (a page, a benchmarks/results file, a config) and its #anchor exists."""
    broken = []
    for path in doc_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", line):
                if "://" in target or target.startswith("mailto:"):
                    continue
                linked = (path.parent / target) if target else path
                if not linked.exists():
                    broken.append(f"{path.relative_to(ROOT)}:{number}: {target}")
                elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                    broken.append(f"{path.relative_to(ROOT)}:{number}: {target}#{anchor} (no such heading)")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


SNIPPET = """\
# A page with mistakes

```bash
python ray_jobs/stage1.py --config configs/tiny/stage1.yaml --set trainer.max_stepz=5
ray job submit --working-dir . -- python ray_jobs/stage2.py \\
    --config configs/stage2/no-such-config.yaml --set model.init_from=models:/raoe-s1/1
python ray_jobs/no_such_job.py --config configs/tiny/stage1.yaml
python scripts/no_such_script.py && make no-such-target
```

```
python ray_jobs/evaluate.py --set eval.batch_size=8 --verbose
```

```console
$ python ray_jobs/evaluate.py --set eval.batch_size=8
error: unknown key 'eval.batch_size'
```

```text
python ray_jobs/evaluate.py --set not.checked=1
```
"""


def test_the_checker_reports_each_broken_command_with_file_and_line():
    """The checker is shown to catch what it is there to catch, each with its file and line."""
    report = "\n".join(check_docs({"page.md": SNIPPET}))
    assert "page.md:4: " in report and "unknown key 'trainer.max_stepz'" in report
    assert "did you mean 'trainer.max_steps'?" in report
    assert "page.md:5: " in report and "--config configs/stage2/no-such-config.yaml: no such file" in report
    assert "page.md:7: " in report and "no job ray_jobs/no_such_job.py" in report
    assert "page.md:8: " in report and "no script scripts/no_such_script.py" in report
    assert "make no-such-target: no such target" in report
    assert "page.md:12: " in report and "not '--verbose'" in report  # an unlabelled block that runs a job
    assert "page.md:16: " in report and "documented to fail" in report  # a documented error that does not happen
    assert "not.checked" not in report  # text blocks are not commands
    assert report.count("\npage.md:") + report.startswith("page.md:") == 7
    # and the good parts of the same commands pass
    assert not check_command(Command("x", "python ray_jobs/stage1.py --config configs/tiny/stage1.yaml "
                                          "--set trainer.max_steps=5 --set 'model.prompt=Represent: {text}'"))
