"""The README's usage example runs as written against a real server."""

from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs(server):
    text = README.read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start : text.index("```", start)]
    assert "KVPoolClient(" in code
    exec(compile(code.replace("127.0.0.1:50051", server.address), "README.md", "exec"), {})
