"""Wire compatibility that runs in a clean clone (issue 35 item 5): `buf breaking` (FILE rules, protos/buf.yaml)
compares protos/ against protos/released/, the committed descriptor image of the released proto (a buf JSON image,
a FileDescriptorSet: no git tag needed). A breaking change -- a field removed, renumbered or retyped, an RPC removed
-- fails; an additive one passes. The baseline is replaced only at a release, deliberately: `make proto-baseline`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
PROTO = "kvpool/v1/kvpool.proto"


def baseline() -> Path:
    (image,) = (PROTOS / "released").glob("*.json")  # exactly one released contract
    return image


def buf() -> str:
    found = shutil.which("buf", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("buf (PyPI buf-bin, requirements/dev.txt) is not installed beside this interpreter")
    return found


def breaking(module: Path) -> subprocess.CompletedProcess:
    return subprocess.run([buf(), "breaking", str(module), "--against", str(baseline()), "--error-format", "json"],
                          capture_output=True, text=True, timeout=60)


def mutated(tmp_path: Path, old: str, new: str) -> Path:
    module = tmp_path / "protos"
    shutil.copytree(PROTOS, module, ignore=shutil.ignore_patterns("released"))
    proto = module / PROTO
    text = proto.read_text()
    assert text.count(old) == 1, f"the mutation's anchor {old!r} is not in the proto once"
    proto.write_text(text.replace(old, new))
    return module


def test_the_proto_is_compatible_with_the_released_one():
    result = breaking(PROTOS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_baseline_is_a_descriptor_set_of_the_kvpool_v1_package():
    from google.protobuf import descriptor_pb2, json_format

    image = json_format.Parse(baseline().read_text(), descriptor_pb2.FileDescriptorSet(), ignore_unknown_fields=True)
    (proto,) = [f for f in image.file if f.name == PROTO]
    assert proto.package == "kvpool.v1" and [s.name for s in proto.service] == ["KVPoolService"]
    assert json.loads(baseline().read_text())["file"][0]["name"] == PROTO


@pytest.mark.parametrize("old, new, rule", [
    ("call (copy-on-write destinations included).\n  repeated uint32 new_block_ids = 2;\n",
     "call (copy-on-write destinations included).\n", "FIELD_NO_DELETE"),                   # a field removed
    ("uint32 dst_block_id = 2;", "uint32 dst_block_id = 7;", "FIELD_NO_DELETE"),          # renumbered
    ("uint32 src_block_id = 1;", "uint64 src_block_id = 1;", "FIELD_SAME_TYPE"),        # retyped
    ("  rpc Free(FreeRequest) returns (FreeResponse);\n", "", "RPC_NO_DELETE"),            # an RPC removed
], ids=["field-removed", "field-renumbered", "field-retyped", "rpc-removed"])
def test_a_breaking_change_fails(tmp_path, old, new, rule):
    result = breaking(mutated(tmp_path, old, new))
    assert result.returncode != 0 and rule in result.stdout + result.stderr, result.stdout + result.stderr


def test_an_additive_change_passes(tmp_path):
    module = mutated(tmp_path, "  uint32 num_blocks_freed = 1;\n",
                     "  uint32 num_blocks_freed = 1;\n  uint32 num_sequences_freed = 2;\n")
    proto = module / PROTO
    proto.write_text(proto.read_text().replace("service KVPoolService {\n", "service KVPoolService {\n"
                                               "  rpc FreeAll(FreeRequest) returns (FreeResponse);\n"))
    result = breaking(module)
    assert result.returncode == 0, result.stdout + result.stderr
