"""Fuzzing headers and indexes: every outcome is the exact data or a SurgeryError, nothing else.

A seeded mutation loop (reproducible in CI) over a real safetensors file and a real sharded
index: byte flips, truncations and insertions in the header, and structural edits of its JSON
(dtypes, shapes, offsets, types, nesting). Whenever surgery opens a mutated file and reads it,
the safetensors package must read the same tensors from it; whenever it cannot, the error is a
:class:`~surgery.SurgeryError`.

Key shapes are fuzzed through a whole load: the example MoE checkpoint with keys renamed by
component count, digit runs, separators and lengths. Every load returns within a time bound,
with every weight it reports loaded exactly the original, or raises a ``SurgeryError``.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import surgery
from surgery.checkpoint import open_checkpoint, write_checkpoint

SEED = 20261203
CASES = 300


def _source(path: Path) -> bytes:
    torch.manual_seed(0)
    write_checkpoint(
        {
            "a": torch.randn(3, 4),
            "b": torch.arange(6, dtype=torch.int32),
            "c": torch.randn(2).to(torch.bfloat16),
        },
        path,
    )
    return (path / "model.safetensors").read_bytes()


def _split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(header: Any, data: bytes) -> bytes:
    text = json.dumps(header)
    for depth in (10, 2000, 100_000):  # nesting too deep for json.dumps itself: spliced in as text
        text = text.replace(f'"__nested_{depth}__"', "[" * depth + "0" + "]" * depth)
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + data


_VALUES: list[Any] = [
    0,
    1,
    -1,
    3,
    2**31,
    2**63,
    2**64,
    -(2**63),
    1.5,
    "F32",
    "F16",
    "BF16",
    "I64",
    "U8",
    "BOOL",
    "F8_E4M3",
    "F4",
    "X9",
    "",
    None,
    True,
    [],
    [0],
    [2, 3],
    [0, 2**63],
    [0, 2**62, 2**62],
    [-1, 4],
    {},
    {"x": 1},
    [[1]],
]


def _mutate_json(rng: random.Random, header: dict[str, Any]) -> Any:
    header = json.loads(json.dumps(header))
    kind = rng.randrange(6)
    keys = [k for k in header if k != "__metadata__"]
    key = rng.choice(keys)
    if kind == 0:
        header[key][rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(_VALUES)
    elif kind == 1:
        begin, end = header[key]["data_offsets"]
        header[key]["data_offsets"] = [begin + rng.randint(-8, 8), end + rng.randint(-8, 8)]
    elif kind == 2:
        del header[key][rng.choice(["dtype", "shape", "data_offsets"])]
    elif kind == 3:
        header["__metadata__"] = rng.choice(
            [{"k": 1}, [], "x", {"format": "pt", "n": "1"}, {"a": {"b": "c"}}]
        )
    elif kind == 4:
        header[rng.choice(["z", key + "x", ""])] = dict(header[key])  # a copy that overlaps
    else:
        header[key]["shape"] = f"__nested_{rng.choice([10, 2000, 100_000])}__"
    return header


def _mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    data = bytearray(raw)
    kind = rng.randrange(4)
    (n,) = struct.unpack("<Q", raw[:8])
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(8 + n)
            data[i] = rng.randrange(256)
    elif kind == 1:
        del data[rng.randrange(len(data)) :]
    elif kind == 2:
        i = rng.randrange(8, 8 + n)
        data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    else:
        data[:8] = struct.pack("<Q", rng.choice([0, 1, n - 1, n + 1, len(raw), 2**40, 2**64 - 1]))
    return bytes(data)


def _check(path: Path) -> str:
    """Open and read ``path``; compare with safetensors. Returns the outcome's kind."""
    try:
        with open_checkpoint(path) as reader:
            ours = {k: reader.get_tensor(k) for k in reader}
    except surgery.SurgeryError:
        return "refused"
    with safe_open(path, "pt") as f:  # surgery read it: safetensors must read the same
        theirs = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
    assert sorted(ours) == sorted(theirs)
    for k, v in ours.items():
        assert v.dtype == theirs[k].dtype and v.shape == theirs[k].shape
        assert torch.equal(
            v.view(torch.uint8) if v.numel() else v, theirs[k].view(torch.uint8) if v.numel() else theirs[k]
        )
    return "read"


def test_mutated_headers_are_read_exactly_or_refused_with_a_surgery_error(tmp_path: Path) -> None:
    raw = _source(tmp_path / "src")
    header, data = _split(raw)
    rng = random.Random(SEED)
    outcomes: dict[str, int] = {}
    for case in range(CASES):
        mutated = _join(_mutate_json(rng, header), data) if case % 2 else _mutate_bytes(rng, raw)
        path = tmp_path / f"case{case}.safetensors"
        path.write_bytes(mutated)
        try:
            kind = _check(path)
        except AssertionError:
            raise
        except Exception as exc:  # anything but a SurgeryError is a bug
            pytest.fail(f"case {case}: {type(exc).__name__}: {exc}")
        outcomes[kind] = outcomes.get(kind, 0) + 1
        path.unlink()
    assert outcomes.get("refused", 0) > CASES // 2  # the mutations mostly break the file ...
    assert outcomes.get("read", 0) > 0  # ... and some leave a valid one, read exactly


def _mutate_index(rng: random.Random, index: dict[str, Any]) -> Any:
    index = json.loads(json.dumps(index))
    weight_map = index["weight_map"]
    key = rng.choice(sorted(weight_map))
    kind = rng.randrange(6)
    if kind == 0:
        weight_map[key] = rng.choice(
            [
                "../x.safetensors",
                "/etc/passwd",
                "",
                ".",
                "a/../../b.safetensors",
                5,
                None,
                ["m"],
                "nope.safetensors",
            ]
        )
    elif kind == 1:
        del weight_map[key]
    elif kind == 2:
        weight_map[key + "x"] = weight_map[key]
    elif kind == 3:
        index[rng.choice(["weight_map", "metadata"])] = rng.choice([[], "x", 1, None, {"a": []}])
    elif kind == 4:
        index = rng.choice([[], "x", None, 3])
    else:
        weight_map[key] = (
            "model-00001-of-00002.safetensors"
            if weight_map[key].startswith("model-00002")
            else weight_map[key].replace("00001", "00002")
        )
    return index


def test_mutated_indexes_are_read_exactly_or_refused_with_a_surgery_error(tmp_path: Path) -> None:
    src = tmp_path / "src"
    sd = {f"t{i}": torch.full((8,), float(i)) for i in range(6)}
    write_checkpoint(sd, src, max_shard_size=70)
    index_path = src / "model.safetensors.index.json"
    original = json.loads(index_path.read_text())
    rng = random.Random(SEED)
    refused = 0
    for case in range(100):
        index_path.write_text(json.dumps(_mutate_index(rng, original)))
        try:
            with open_checkpoint(src) as reader:
                got = {k: reader.get_tensor(k) for k in reader}
        except surgery.SurgeryError:
            refused += 1
            continue
        except Exception as exc:
            pytest.fail(f"case {case}: {type(exc).__name__}: {exc}")
        assert sorted(got) == sorted(sd) and all(torch.equal(got[k], sd[k]) for k in sd), case
    assert refused > 50


# --------------------------------------------------------------------------- key shapes through a load

KEY_CASES = 120
KEY_CPU_BOUND = 2.0  # seconds of CPU per load: the bound of tests/test_routing.py's hostile keys


def _mutate_key(rng: random.Random, key: str) -> str:
    """``key`` with one change of shape: component count, digit runs, separators or lengths."""
    parts = key.split(".")
    numeric = [i for i, p in enumerate(parts) if p.isdigit()] or [rng.randrange(len(parts))]
    i = rng.randrange(len(parts))
    kind = rng.randrange(5)
    if kind == 0:  # component count: one component repeated, numeric ones most often
        j = rng.choice([*numeric, i])
        parts[j : j + 1] = [parts[j]] * rng.choice([2, 16, 17, 65, 1_000, 20_000, 100_000])
    elif kind == 1:  # digit runs in an index
        j = rng.choice(numeric)
        parts[j] = rng.choice(
            [
                "0" + parts[j],
                parts[j] + "0" * rng.choice([1, 9, 10, 11]),
                "9" * rng.choice([11, 300, 4_097, 200_000]),
                "-1",
                "1e3",
                "\u0663",  # ARABIC-INDIC DIGIT THREE: str.isdigit, but no index
            ]
        )
    elif kind == 2:  # separators
        sep = rng.choice(["..", "._", "/", ". ", ":", ".\n", "\u2024", "", "." * 1_000])
        j = rng.randrange(1, len(parts))
        return ".".join(parts[:j]) + sep + ".".join(parts[j:])
    elif kind == 3:  # lengths: one component padded
        parts[i] += rng.choice(["x", "_", "0", "x."]) * rng.choice([1, 1_000, 5_000, 100_000, 1 << 20])
    else:  # numeric components inserted, of every width
        width = rng.choice([1, 2, 5, 10, 11])
        parts[i:i] = [
            str(rng.randrange(10 ** (width - 1), 10**width)) for _ in range(rng.choice([1, 17, 3_000]))
        ]
    return ".".join(parts)


def _fuzz_key_shapes(root: Path, queue: Any) -> None:
    """The loop of the test below, run in a child process that the test kills if it hangs."""
    import time

    from surgery.examples.moe import build_moe_model, original_state_dict

    truth = build_moe_model(seed=0).state_dict()
    clean = original_state_dict(build_moe_model(seed=0))
    write_checkpoint(clean, root / "clean")
    plan = surgery.plan_load(build_moe_model(seed=1), root / "clean")
    sources_of = {t: set(e.source_keys) for e in plan.entries for t in e.target_keys}
    rng = random.Random(SEED)
    outcomes: dict[str, int] = {}
    worst = 0.0
    for case in range(KEY_CASES):
        state = dict(clean)
        mutated: list[str] = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            old = rng.choice(sorted(set(state) - set(mutated)))
            new = _mutate_key(rng, old)
            if new not in state:
                state[new] = state.pop(old)
                mutated.append(new)
        path = root / f"case{case}"
        write_checkpoint(state, path)
        model = build_moe_model(seed=1)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        cpu = time.process_time()
        try:
            report = surgery.load_checkpoint(model, path)
        except surgery.SurgeryError:
            report = None
        except Exception as exc:  # anything but a SurgeryError is a bug
            queue.put(("fail", case, f"{type(exc).__name__}: {str(exc)[:300]}"))
            return
        cpu = time.process_time() - cpu
        worst = max(worst, cpu)
        problem = _key_fuzz_problem(model, report, state, mutated, before, truth, sources_of)
        if cpu > KEY_CPU_BOUND:
            problem = f"the load took {cpu:.2f} s of CPU"
        if problem:
            shown = [m if len(m) < 100 else f"{m[:60]}...({len(m)} characters)" for m in mutated]
            queue.put(("fail", case, f"{problem}; mutated keys {shown}"))
            return
        kind = "refused" if report is None else "loaded" if not report.unexpected_keys else "unexpected"
        outcomes[kind] = outcomes.get(kind, 0) + 1
        for f in path.iterdir():
            f.unlink()
    queue.put(("done", outcomes, worst))


def _key_fuzz_problem(
    model: Any,
    report: Any,
    state: dict[str, torch.Tensor],
    mutated: list[str],
    before: dict[str, torch.Tensor],
    truth: dict[str, torch.Tensor],
    sources_of: dict[str, set[str]],
) -> str | None:
    """What is wrong with one outcome, or ``None``."""
    now = model.state_dict()
    if report is None:
        changed = [k for k, v in now.items() if not torch.equal(v, before[k])]
        return f"refused, but changed {changed[:3]}" if changed else None
    wrong = [k for k in report.loaded_keys if not torch.equal(now[k], truth[k])]
    if wrong:
        return f"loaded {wrong[:3]} with data that is not the original"
    planned = [k for e in report.plan.entries for k in e.source_keys]
    if sorted(planned) != sorted(state):
        return "a checkpoint key was planned twice or not at all"
    if all(k in report.unexpected_keys for k in mutated):
        lost = [t for t, src in sources_of.items() if src <= set(state) and t not in report.loaded_keys]
        if lost:
            return f"{lost[:3]} were not loaded, though none of their keys was touched"
    return None


def test_mutated_key_shapes_load_exactly_or_raise_a_surgery_error_within_a_time_bound(tmp_path: Path) -> None:
    """Each load of a checkpoint whose keys were reshaped returns within KEY_CPU_BOUND seconds of
    CPU; what it reports loaded is the original data, every key is accounted for once, and keys
    left untouched still load when the reshaped ones are reported unexpected."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_fuzz_key_shapes, args=(tmp_path, queue))
    child.start()
    child.join(KEY_CASES * KEY_CPU_BOUND)
    if child.is_alive():
        child.kill()
        pytest.fail("a load of a checkpoint with reshaped keys did not return")
    result = queue.get(timeout=5)
    if result[0] == "fail":
        pytest.fail(f"case {result[1]}: {result[2]}")
    _, outcomes, worst = result
    assert outcomes.get("unexpected", 0) > KEY_CASES // 2, outcomes  # most reshaped keys name nothing ...
    assert outcomes.get("loaded", 0) + outcomes.get("refused", 0) > 0, outcomes  # ... a few still do
    assert worst < KEY_CPU_BOUND
