"""Property-based fuzzing of the two pickle readers, bounded to stay fast on CI: any byte
stream built from pickle opcodes either decodes or raises one FP8StateError, never anything
else, and never changes an attribute of the classes and functions the allow-lists name."""

from __future__ import annotations

import io
import pathlib
import tempfile

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import metadata as dcp_metadata

from fp8state._te.unpickler import loads
from fp8state.checkpoint.dcp_untrusted import read_untrusted_metadata
from fp8state.errors import FP8StateError

WATCHED = [dcp_metadata.Metadata, pathlib.PosixPath, torch.Size, torch._utils._rebuild_tensor_v2]

# Pieces an attacker combines: opcodes with plausible arguments, globals from both
# allow-lists and from outside them, strings, integers (huge ones too).
PIECES = st.sampled_from(
    [
        b"\x80\x02",
        b"ctorch._utils\n_rebuild_tensor_v2\n",
        b"ctorch.storage\nUntypedStorage\n",
        b"ctorch.distributed.checkpoint.metadata\nMetadata\n",
        b"cpathlib\nPosixPath\n",
        b"ctorch\nSize\n",
        b"ccollections\nOrderedDict\n",
        b"cos\nsystem\n",
        b"X\x05\x00\x00\x00pwned",
        b"X\x03\x00\x00\x00yes",
        b"K\x01",
        b"\x8a\x08" + (2**63 - 1).to_bytes(8, "little"),
        b"N",
        b"]",
        b"}",
        b")",
        b"(",
        b"t",
        b"\x85",
        b"\x86",
        b"a",
        b"s",
        b"u",
        b"b",
        b"R",
        b"\x81",
        b"\x92",
        b"q\x00",
        b"h\x00",
        b"0",
        b"2",
    ]
)
STREAMS = st.lists(PIECES, max_size=24).map(lambda parts: b"".join(parts) + b".")


def _attributes() -> list[list[str]]:
    return [sorted(map(str, vars(obj))) for obj in WATCHED]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(STREAMS)
def test_the_te_unpickler_decodes_or_refuses(data: bytes) -> None:
    before = _attributes()
    try:
        loads(data)
    except FP8StateError:
        pass
    assert _attributes() == before


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(STREAMS)
def test_the_dcp_metadata_reader_decodes_or_refuses(data: bytes) -> None:
    before = _attributes()
    with tempfile.TemporaryDirectory() as folder:
        pathlib.Path(folder, ".metadata").write_bytes(data)
        try:
            read_untrusted_metadata(folder)
        except FP8StateError:
            pass
    assert _attributes() == before


def test_the_pieces_include_a_stream_plain_pickle_would_run() -> None:
    # The fuzzer's alphabet reaches the attacks: this stream, built from its pieces, calls
    # os.system under plain pickle (not run here: pickletools only reads it).
    import pickletools

    stream = b"\x80\x02cos\nsystem\nX\x05\x00\x00\x00pwned\x85R."
    ops = [op.name for op, _, _ in pickletools.genops(io.BytesIO(stream))]
    assert ops == ["PROTO", "GLOBAL", "BINUNICODE", "TUPLE1", "REDUCE", "STOP"]
    assert all(piece in stream for piece in (b"cos\nsystem\n", b"\x85", b"R"))
