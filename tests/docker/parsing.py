"""Just enough of docker/Dockerfile, `pip install` lines and .dockerignore for the docker tests (no Docker engine).

Only the shapes this repository's files use: global `ARG name=default` used as `${name}` in FROM, `FROM x AS name`,
comment lines, backslash continuations, `RUN a && b`, `ENV key=value ...`, `pip install -r file | --no-deps | ./dir |
name==version`; .dockerignore patterns with `*`, `**/`, `[...]` and `!`. Anything else fails loudly.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE_FILE = REPO / "docker" / "compose.yaml"


@dataclass
class PipInstall:
    text: str
    files: list[str]  # after -r, as written ("requirements/server.txt")
    local: list[str]  # local projects: "." (the root project, extras dropped) or ./dir without "./" ("client")
    packages: list[str]  # specifiers given directly ("nvidia-cuda-runtime-cu12==12.9.79")
    no_deps: bool


def pip_installs(shell: str) -> list[PipInstall]:
    """Each `pip install` among the `&&`-separated commands of one shell line (`# comments` dropped)."""
    found = []
    for command in shell.split("&&"):
        if not re.search(r"\bpip install\b", command):
            continue
        words = shlex.split(command, comments=True)
        words = iter(words[words.index("install") + 1:])
        install = PipInstall(command.strip(), [], [], [], False)
        for word in words:
            if word == "-r":
                install.files.append(next(words))
            elif word == "--no-deps":
                install.no_deps = True
            elif word.startswith("-"):
                raise ValueError(f"pip option {word!r} not understood here: {command!r}")
            elif word == "." or word.startswith(".["):
                install.local.append(".")
            elif word.startswith("./"):
                install.local.append(word[2:].rstrip("/"))
            else:
                install.packages.append(word)
        found.append(install)
    return found


def readme_pip_installs(readme: Path = REPO / "README.md") -> list[PipInstall]:
    """The `pip install` lines inside the fenced code blocks of a Markdown file."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", readme.read_text(), flags=re.MULTILINE | re.DOTALL)
    return [p for block in blocks for line in block.splitlines() for p in pip_installs(line)]


def requirement_closure(files: list[str]) -> set[str]:
    """The requirements files plus every file they pull in with `-r`, as repository-relative paths."""
    seen: set[str] = set()
    todo = [REPO / f for f in files]
    while todo:
        path = todo.pop().resolve()
        if (rel := path.relative_to(REPO).as_posix()) not in seen:
            seen.add(rel)
            todo += [path.parent / f for f in re.findall(r"^-r\s+(\S+)", path.read_text(), flags=re.MULTILINE)]
    return seen


@dataclass
class Stage:
    base: str  # an image (ARG defaults substituted) or an earlier stage's name
    instructions: list[tuple[str, str]]  # (KEYWORD, arguments)


class Dockerfile:
    def __init__(self, path: Path = DOCKERFILE) -> None:
        args: dict[str, str] = {}
        self.stages: dict[str, Stage] = {}  # in file order
        for line in path.read_text().replace("\\\n", " ").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            keyword, _, rest = line.partition(" ")
            if keyword == "FROM":
                image, as_, name = rest.split()
                if as_ != "AS":
                    raise ValueError(f"cannot read FROM {rest!r}")
                self.stages[name] = Stage(re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], image), [])
            elif self.stages:
                list(self.stages.values())[-1].instructions.append((keyword, rest.strip()))
            elif keyword == "ARG":
                name, _, default = rest.partition("=")
                args[name] = default
            else:
                raise ValueError(f"{keyword} before the first FROM")

    def chain(self, name: str) -> list[Stage]:
        """The stage and the earlier stages it is built FROM, root first."""
        chain = [self.stages[name]]
        while chain[0].base in self.stages:
            chain.insert(0, self.stages[chain[0].base])
        return chain

    def base_image(self, name: str) -> str:
        return self.chain(name)[0].base

    def instructions(self, name: str, keyword: str) -> list[str]:
        """The arguments of every `keyword` instruction that builds stage `name`, in build order."""
        return [rest for stage in self.chain(name) for kw, rest in stage.instructions if kw == keyword]

    def last(self, name: str, keyword: str) -> str | None:
        return (self.instructions(name, keyword) or [None])[-1]

    def env(self, name: str) -> dict[str, str]:
        return dict(word.split("=", 1) for env in self.instructions(name, "ENV") for word in shlex.split(env))

    def pip_installs(self, name: str) -> list[PipInstall]:
        return [p for run in self.instructions(name, "RUN") for p in pip_installs(run)]


def dockerignore_rules(path: Path = REPO / ".dockerignore") -> list[tuple[bool, re.Pattern[str]]]:
    """(is `!` exception, pattern) in file order. `*` stays within one path component, `**/` spans any number."""
    rules = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        glob = line.lstrip("!").strip("/")
        if "?" in glob or re.search(r"\*\*(?!/)", glob):
            raise ValueError(f".dockerignore pattern {line!r} not understood here")
        tokens = re.split(r"(\*\*/|\*|\[[^\]]*\])", glob)
        regex = "".join("(?:.*/)?" if t == "**/" else "[^/]*" if t == "*" else t if t.startswith("[") else re.escape(t)
                        for t in tokens)
        rules.append((line.startswith("!"), re.compile(regex + r"\Z")))
    return rules


def dockerignored(rel_path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories decides."""
    parts = rel_path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for exception, regex in rules:
        if any(regex.match(candidate) for candidate in candidates):
            ignored = not exception
    return ignored
