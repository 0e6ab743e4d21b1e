"""Small parsers for the docker tests: the Dockerfile, `pip install` command lines, requirements files, .dockerignore.

No Docker engine is needed (or used) by anything here; the parsers cover the subset of each format that this
repository's files use, and fail loudly on anything they do not understand rather than guess.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE_FILE = REPO / "docker" / "compose.yaml"
DOCKERIGNORE = REPO / ".dockerignore"


# --------------------------------------------------------------------------------------------------------------------
# Dockerfile


@dataclass
class Instruction:
    keyword: str  # upper case: RUN, COPY, ENV, ...
    args: str  # the rest of the (continuation-joined) line


@dataclass
class Stage:
    name: str
    image: str  # as written after FROM, with global ARG defaults substituted
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage {name!r} in the Dockerfile (have {[s.name for s in self.stages]})")

    def parent(self, stage: Stage) -> Stage | None:
        """The earlier stage this one is built FROM, or None when it starts from an image."""
        names = [s.name for s in self.stages[: self.stages.index(stage)]]
        return self.stage(stage.image) if stage.image in names else None

    def chain(self, name: str) -> list[Stage]:
        """The stage and its ancestors, root first."""
        stages = [self.stage(name)]
        while (parent := self.parent(stages[0])) is not None:
            stages.insert(0, parent)
        return stages

    def base_image(self, name: str) -> str:
        return self.chain(name)[0].image

    def instructions(self, name: str, keyword: str) -> list[Instruction]:
        """Every `keyword` instruction that takes part in building stage `name`, in build order."""
        return [i for stage in self.chain(name) for i in stage.all(keyword)]

    def last(self, name: str, keyword: str) -> Instruction | None:
        found = self.instructions(name, keyword)
        return found[-1] if found else None

    def env(self, name: str) -> dict[str, str]:
        values: dict[str, str] = {}
        for instruction in self.instructions(name, "ENV"):
            for token in shlex.split(instruction.args):
                key, sep, value = token.partition("=")
                if not sep:
                    raise ValueError(f"ENV without '=' is not supported here: {instruction.args!r}")
                values[key] = value
        return values


def _logical_lines(text: str) -> list[str]:
    """Comment lines dropped, backslash continuations joined."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#"):
            continue  # comments (and parser directives) may also sit inside a continuation
        if not stripped and not current:
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        if current.strip():
            lines.append(current.strip())
        current = ""
    if current.strip():
        lines.append(current.strip())
    return lines


def _substitute(text: str, variables: dict[str, str]) -> str:
    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise ValueError(f"unknown build variable {name!r} in {text!r}")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, text)


def parse_dockerfile(path: Path = DOCKERFILE) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(path.read_text()):
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        args = args.strip()
        if keyword == "FROM":
            words = args.split()
            words = [w for w in words if not w.startswith("--platform")]
            image = _substitute(words[0], global_args)
            if len(words) == 3 and words[1].lower() == "as":
                name = words[2]
            elif len(words) == 1:
                name = str(len(stages))
            else:
                raise ValueError(f"cannot read FROM {args!r}")
            stages.append(Stage(name=name, image=image))
        elif not stages:
            if keyword != "ARG":
                raise ValueError(f"{keyword} before the first FROM")
            key, _, default = args.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, args))
    return Dockerfile(global_args, stages)


def exec_form(instruction: Instruction | None) -> list[str] | None:
    """["a", "b"] of an ENTRYPOINT/CMD in JSON (exec) form, None for shell form or a missing instruction."""
    import json

    if instruction is None:
        return None
    try:
        value = json.loads(instruction.args)
    except ValueError:
        return None
    return value if isinstance(value, list) else None


# --------------------------------------------------------------------------------------------------------------------
# pip install command lines


@dataclass
class PipInstall:
    requirement_files: list[str]  # as written after -r / --requirement, normalised ("requirements/server.txt")
    local_paths: list[str]  # local projects, normalised ("client", "server")
    packages: list[str]  # requirement specifiers given directly ("nvidia-cuda-runtime-cu12==12.9.79")
    no_deps: bool
    text: str


_PIP_OPTIONS_WITH_VALUE = {"-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f", "--find-links",
                           "-t", "--target", "--prefix", "--root", "--python-version", "--platform"}


def _normalise_path(path: str) -> str:
    path = path.strip()
    while path.startswith("./"):
        path = path[2:]
    return path.rstrip("/") or "."


def _looks_local(token: str) -> bool:
    return token.startswith((".", "/")) or (REPO / _normalise_path(token)).is_dir()


def parse_pip_install(command: str) -> PipInstall | None:
    """The `pip install ...` inside one simple shell command, or None when it is not one."""
    if not re.search(r"\bpip3?\s+install\b", command):
        return None
    tokens = shlex.split(command, comments=True)
    for i in range(len(tokens) - 1):
        if tokens[i].endswith(("pip", "pip3")) and tokens[i + 1] == "install":
            args = tokens[i + 2:]
            break
    else:
        return None
    result = PipInstall([], [], [], False, command.strip())
    j = 0
    while j < len(args):
        token = args[j]
        if token in ("-r", "--requirement"):
            result.requirement_files.append(_normalise_path(args[j + 1]))
            j += 2
            continue
        if token.startswith("--requirement="):
            result.requirement_files.append(_normalise_path(token.split("=", 1)[1]))
        elif token.startswith("-r") and len(token) > 2:
            result.requirement_files.append(_normalise_path(token[2:]))
        elif token in ("-e", "--editable"):
            result.local_paths.append(_normalise_path(args[j + 1]))
            j += 2
            continue
        elif token == "--no-deps":
            result.no_deps = True
        elif token in _PIP_OPTIONS_WITH_VALUE:
            j += 2
            continue
        elif token.startswith("-"):
            pass  # -q, --upgrade, --no-cache-dir, ...
        elif _looks_local(token):
            result.local_paths.append(_normalise_path(token))
        else:
            result.packages.append(token)
        j += 1
    return result


def pip_installs_in_shell(text: str) -> list[PipInstall]:
    """Every `pip install` in a shell snippet (one logical line; && ; || separate commands)."""
    found = []
    for command in re.split(r"&&|\|\||;", text):
        parsed = parse_pip_install(command)
        if parsed is not None:
            found.append(parsed)
    return found


def dockerfile_pip_installs(dockerfile: Dockerfile, stage: str) -> list[PipInstall]:
    """The pip installs that build `stage` (its own and its ancestors')."""
    return [p for run in dockerfile.instructions(stage, "RUN") for p in pip_installs_in_shell(run.args)]


def _shell_lines(text: str) -> list[str]:
    """Continuation-joined lines of shell text, with a leading `$ ` prompt removed."""
    joined = re.sub(r"\\\n", " ", text)
    lines = []
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def readme_pip_installs(readme: Path) -> list[PipInstall]:
    """`pip install` commands inside the fenced code blocks of a Markdown file."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", readme.read_text(), flags=re.MULTILINE | re.DOTALL)
    return [p for block in blocks for line in _shell_lines(block) for p in pip_installs_in_shell(line)]


def makefile_pip_installs(makefile: Path) -> list[PipInstall]:
    lines = [line.strip().lstrip("@-") for line in _shell_lines(makefile.read_text())]
    return [p for line in lines for p in pip_installs_in_shell(line.replace("$(PY)", "python"))]


# --------------------------------------------------------------------------------------------------------------------
# requirements files


def requirement_closure(files: list[str]) -> set[str]:
    """The files plus every file they pull in with -r, as repo-relative paths."""
    seen: set[str] = set()
    todo = [REPO / f for f in files]
    while todo:
        path = todo.pop().resolve()
        rel = path.relative_to(REPO).as_posix()
        if rel in seen:
            continue
        if not path.is_file():
            raise FileNotFoundError(f"requirements file {rel} does not exist")
        seen.add(rel)
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            match = re.match(r"^(?:-r|--requirement)\s*=?\s*(\S+)$", line)
            if match:
                todo.append(path.parent / match.group(1))
    return seen


def requirement_pins(path: Path) -> dict[str, str]:
    """name -> version of the `name==version` lines of one requirements file."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


# --------------------------------------------------------------------------------------------------------------------
# .dockerignore (Docker's rules: patterns in order, the last one that matches wins, `!` re-includes; a pattern
# matches a path or any of its parent directories; `**` spans directories, `*` and `?` do not cross `/`)


def _glob_to_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    parts = pattern.split("/")
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        if part == "**":
            out += ".*" if last else "(?:.*/)?"
            continue
        i = 0
        while i < len(part):
            char = part[i]
            if char == "*":
                out += "[^/]*"
            elif char == "?":
                out += "[^/]"
            elif char == "[":
                end = part.index("]", i)
                out += "[" + part[i + 1: end].replace("!", "^", 1) + "]"
                i = end
            else:
                out += re.escape(char)
            i += 1
        if not last:
            out += "/"
    return re.compile(out + r"\Z")


def read_dockerignore(path: Path = DOCKERIGNORE) -> list[tuple[bool, re.Pattern[str]]]:
    """(is_exception, compiled pattern) in file order."""
    rules = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = line[1:] if exception else line
        pattern = pattern.strip().lstrip("/").rstrip("/")
        rules.append((exception, _glob_to_regex(pattern)))
    return rules


def dockerignored(rel_path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = rel_path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for exception, regex in rules:
        if any(regex.match(candidate) for candidate in candidates):
            ignored = not exception
    return ignored
