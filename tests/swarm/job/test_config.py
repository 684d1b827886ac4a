"""Job files: the examples parse, bad values are named precisely, fingerprints track the maths."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from pathlib import Path

import pytest

from swarm.errors import ConfigError
from swarm.job.config import (
    CompressionConfig,
    JobConfig,
    ModelConfig,
    OptimizerConfig,
    TrainingConfig,
    load_job,
    parse_job,
)
from swarm.job.fingerprint import fingerprint
from swarm.job.pinning import pin_data

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TEXT = b"It is wise to turn circumstances to good account. " * 4  # 200 bytes > seq_len + 1

# Sections as {key: TOML literal}; "" holds top-level keys. None in an override deletes a key,
# or a whole section.
Sections = dict[str, dict[str, str | None] | None]
BASE: Sections = {
    "": {},
    "model": {"n_layers": "4", "n_heads": "4", "d_model": "64", "seq_len": "64"},
    "data": {"kind": '"text"', "path": '"corpus.txt"'},
    "training": {
        "stages": "4",
        "microbatch_size": "8",
        "target_batch_size": "32",
        "steps": "3",
    },
    "optimizer": {"kind": '"adamw"', "lr": "3e-3"},
    "runtime": {},
}


def render(overrides: Sections | None = None) -> str:
    sections: dict[str, dict[str, str | None]] = {k: dict(v or {}) for k, v in BASE.items()}
    for section, keys in (overrides or {}).items():
        if keys is None:
            del sections[section]
        else:
            sections.setdefault(section, {}).update(keys)
    lines = [f"{k} = {v}" for k, v in sections.pop("").items() if v is not None]
    for section, keys in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {v}" for k, v in keys.items() if v is not None]
    return "\n".join(lines) + "\n"


def job(tmp_path: Path, overrides: Sections | None = None, data: bytes = TEXT) -> JobConfig:
    (tmp_path / "corpus.txt").write_bytes(data)
    return parse_job(render(overrides), tmp_path)


def test_the_llama_example_is_the_recipe_it_says() -> None:
    job = load_job(EXAMPLES / "llama-small.toml")
    assert (job.model.kind, job.model.kv_heads, job.data.val_fraction) == ("llama", 2, 0.05)
    t, o = job.training, job.optimizer
    assert (t.precision, t.grad_clip, t.eval_every, job.compression.wire) == (
        "bf16-mixed",
        1.0,
        50,
        "bf16",
    )
    assert (o.schedule, o.warmup_steps, o.min_lr) == ("cosine", 30, 2e-4)


def test_examples_parse() -> None:
    tiny = load_job(EXAMPLES / "tiny.toml")
    assert tiny.name == "tiny"
    assert (tiny.model.d_model, tiny.model.n_layers, tiny.model.n_heads) == (64, 4, 4)
    assert (tiny.model.seq_len, tiny.model.vocab_size) == (64, 256)
    assert tiny.data.kind == "text"
    assert tiny.data.path == (EXAMPLES / "data" / "corpus.txt").resolve()
    assert tiny.training == TrainingConfig(
        stages=4,
        microbatch_size=8,
        target_batch_size=32,
        steps=150,
        seed=0,
        dtype="float32",
        checkpoint_every=100,  # unset in the file: the default, resolved when the job is read
    )
    assert tiny.training.microbatches_per_step == 4
    assert (tiny.optimizer.kind, tiny.optimizer.lr, tiny.optimizer.weight_decay) == (
        "adamw",
        3e-3,
        0.0,
    )
    assert tiny.compression.wire == "none"

    synthetic = load_job(EXAMPLES / "tiny_synthetic.toml")
    assert synthetic.data.kind == "synthetic" and synthetic.data.path is None
    same = ("model", "training", "optimizer", "compression", "runtime")
    assert all(getattr(tiny, s) == getattr(synthetic, s) for s in same)
    assert fingerprint(tiny) != fingerprint(synthetic)


def test_a_local_steps_job_with_no_other_pool_key_loads(tmp_path: Path) -> None:
    # A default never makes another valid choice invalid: checkpoint_every's 100 is not a
    # multiple of sync_every's 16, so unset under local steps it is the round end after it.
    local = job(tmp_path, {"pool": {"mode": '"local"'}})
    assert (local.pool.sync_every, local.training.checkpoint_every) == (16, 112)
    rounds = {"mode": '"local"', "sync_every": "25"}
    assert job(tmp_path, {"pool": rounds}).training.checkpoint_every == 100
    assert job(tmp_path, {"pool": {**rounds, "sync_every": "500"}}).training.checkpoint_every == 500
    assert job(tmp_path).training.checkpoint_every == 100  # step mode: as before
    # Set, it is the user's: one that is no round's end is refused, the default offered.
    with pytest.raises(ConfigError) as e:
        job(tmp_path, {"pool": {"mode": '"local"'}, "training": {"checkpoint_every": "100"}})
    assert str(e.value) == (
        "training.checkpoint_every = 100 is not allowed; use a multiple of pool.sync_every = 16 "
        'with pool.mode = "local" (or leave it unset: 112)'
    )
    # A job built in code is held to the same rule.
    built = dataclasses.replace(local, training=TrainingConfig(1, 8, 32, 3))
    assert built.training.checkpoint_every == 112


def test_corpus_size_and_encoding() -> None:
    raw = (EXAMPLES / "data" / "corpus.txt").read_bytes()
    assert 60_000 <= len(raw) <= 150_000
    raw.decode("utf-8")
    assert (EXAMPLES / "data" / "README.md").is_file()


def test_defaults_and_types(tmp_path: Path) -> None:
    j = job(tmp_path, {"optimizer": {"lr": "1"}, "": {"name": '"run-1"'}})
    assert j.name == "run-1"
    assert j.optimizer.lr == 1.0 and isinstance(j.optimizer.lr, float)
    assert j.optimizer.betas == (0.9, 0.999) and j.optimizer.eps == 1e-8
    assert j.compression.block_size == 2048 and j.runtime.chunk_bytes == 4 * 2**20
    assert j.runtime.max_message_bytes == 64 * 2**20
    assert j.runtime.max_tensor_bytes == 2**30
    assert (j.runtime.max_in_flight, j.runtime.activation_cache) == ("auto", 64)
    assert (j.runtime.rpc_timeout_s, j.runtime.commit_timeout_s) == (60.0, 120.0)
    assert (j.training.seed, j.training.dtype, j.training.checkpoint_every) == (0, "float32", 100)
    with pytest.raises(dataclasses.FrozenInstanceError):
        j.model.d_model = 8  # type: ignore[misc]
    assert json.loads(json.dumps(j.to_dict()))["data"]["path"] == str(tmp_path / "corpus.txt")


def test_name_defaults_to_file_stem(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_bytes(TEXT)
    (tmp_path / "my_job.toml").write_text(render())
    assert load_job(tmp_path / "my_job.toml").name == "my_job"
    assert parse_job(render(), tmp_path).name == "job"
    (tmp_path / "my job.toml").write_text(render())
    with pytest.raises(ConfigError, match="name is not set and the default 'my job'"):
        load_job(tmp_path / "my job.toml")
    (tmp_path / "my job.toml").write_text(render({"": {"name": '"fine"'}}))
    assert load_job(tmp_path / "my job.toml").name == "fine"


def test_code_built_sections_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"model\.d_model = 65"):
        ModelConfig(d_model=65)
    assert OptimizerConfig(kind="sgd", lr=1, betas=[0, 0.5]).betas == (0.0, 0.5)  # type: ignore[arg-type]


# (overrides, extra data-file bytes or None, fragments the message must contain)
BAD: list[tuple[Sections, bytes | None, list[str]]] = [
    ({"model": {"kind": '"rnn"'}}, None, ['model.kind = "rnn"', 'one of "gpt"']),
    ({"model": {"vocab_size": "0"}}, None, ["model.vocab_size = 0", "an integer >= 1"]),
    ({"model": {"d_model": "65"}}, None, ["model.d_model = 65", "multiple of model.n_heads = 4"]),
    ({"model": {"n_heads": '"4"'}}, None, ['model.n_heads = "4"', "an integer >= 1"]),
    ({"model": {"seq_len": "true"}}, None, ["model.seq_len = true", "an integer >= 1"]),
    ({"model": {"mlp_ratio": "1.5"}}, None, ["model.mlp_ratio = 1.5", "an integer >= 1"]),
    ({"model": {"vocab_size": "128"}}, None, ["model.vocab_size = 128", ">= 256", '"text"']),
    (
        {"data": {"kind": '"images"'}},
        None,
        ['data.kind = "images"', '"text", "tokens", "synthetic"'],
    ),
    ({"data": {"path": None}}, None, ["data.path is required", '"text"']),
    ({"data": {"path": "3"}}, None, ["data.path = 3", "a path string"]),
    ({"data": {"sha256": '"abc"'}}, None, ['data.sha256 = "abc"', "64 lowercase hex digits"]),
    ({"data": {"sha256": '"' + "0" * 64 + '"'}}, None, ["data.sha256 = ", "the file's sha256"]),
    ({"data": {"path": '"nope.txt"'}}, None, ["data.path = ", "nope.txt", "cannot be read"]),
    ({}, b"", ["data.path = ", "has 0 bytes", "longer than model.seq_len + 1 = 65 bytes"]),
    ({}, b"x" * 65, ["data.path = ", "has 65 bytes", "longer than model.seq_len + 1 = 65"]),
    ({}, b"\xff\xfe" * 100, ["data.path = ", "not UTF-8", "a UTF-8 text file"]),
    ({"training": {"stages": None}}, None, ["training.stages is required", "an integer >= 1"]),
    ({"training": {"stages": "0"}}, None, ["training.stages = 0", "an integer >= 1"]),
    ({"training": {"stages": "7"}}, None, ["training.stages = 7", "<= model.n_layers + 2 = 6"]),
    ({"training": {"microbatch_size": "0"}}, None, ["training.microbatch_size = 0", ">= 1"]),
    (
        {"training": {"target_batch_size": "30"}},
        None,
        ["training.target_batch_size = 30", "multiple of training.microbatch_size = 8"],
    ),
    ({"training": {"steps": '"30"'}}, None, ['training.steps = "30"', "an integer >= 1"]),
    ({"training": {"seed": "-1"}}, None, ["training.seed = -1", "an integer >= 0"]),
    (
        {"training": {"dtype": '"float16"'}},
        None,
        ['training.dtype = "float16" is not allowed; use one of "float32", "float64", "bfloat16"'],
    ),
    ({"training": {"checkpoint_every": "-1"}}, None, ["training.checkpoint_every = -1", ">= 0"]),
    ({"optimizer": {"kind": None}}, None, ["optimizer.kind is required", '"adamw", "sgd"']),
    ({"optimizer": {"kind": '"adam"'}}, None, ['optimizer.kind = "adam"', '"adamw", "sgd"']),
    ({"optimizer": {"lr": None}}, None, ["optimizer.lr is required", "a number > 0"]),
    ({"optimizer": {"lr": "0"}}, None, ["optimizer.lr = 0", "a number > 0"]),
    ({"optimizer": {"lr": '"fast"'}}, None, ['optimizer.lr = "fast"', "a number > 0"]),
    ({"optimizer": {"weight_decay": "-0.1"}}, None, ["optimizer.weight_decay = -0.1", ">= 0"]),
    ({"optimizer": {"betas": "[0.9]"}}, None, ["optimizer.betas = [0.9]", "list of 2 numbers"]),
    ({"optimizer": {"betas": "[0.9, 1.0]"}}, None, ["optimizer.betas = [0.9, 1.0]", "[0, 1)"]),
    ({"optimizer": {"betas": "0.9"}}, None, ["optimizer.betas = 0.9", "list of 2 numbers"]),
    ({"optimizer": {"eps": "0"}}, None, ["optimizer.eps = 0", "a number > 0"]),
    ({"optimizer": {"momentum": "1.0"}}, None, ["optimizer.momentum = 1.0", "in [0, 1)"]),
    (
        {"compression": {"wire": '"fp8"'}},
        None,
        ['compression.wire = "fp8"', '"none", "fp16", "bf16", "int8_blockwise"'],
    ),
    ({"compression": {"block_size": "0"}}, None, ["compression.block_size = 0", ">= 1"]),
    (
        {"compression": {"error_feedback": '"yes"'}},
        None,
        ['compression.error_feedback = "yes"', "true or false"],
    ),
    ({"training": {"delayed_update": "1"}}, None, ["training.delayed_update = 1", "true or false"]),
    ({"runtime": {"max_in_flight": "0"}}, None, ["runtime.max_in_flight = 0", "in 1..65536"]),
    ({"runtime": {"rpc_timeout_s": "0"}}, None, ["runtime.rpc_timeout_s = 0", "a number > 0"]),
    ({"runtime": {"commit_timeout_s": "-1"}}, None, ["runtime.commit_timeout_s = -1", "> 0"]),
    # a deadline past what gRPC can express failed every call at once, blaming the peers
    ({"runtime": {"rpc_timeout_s": "inf"}}, None, ["runtime.rpc_timeout_s = Infinity", "finite"]),
    (
        {"runtime": {"averaging_timeout_s": "1e10"}},
        None,
        ["runtime.averaging_timeout_s = 10000000000.0", "<= 86400"],
    ),
    ({"optimizer": {"lr": "inf"}}, None, ["optimizer.lr = Infinity", "a finite number > 0"]),
    ({"optimizer": {"eps": "nan"}}, None, ["optimizer.eps = NaN", "a finite number > 0"]),
    # past SQLite's integers: the job store answered INTERNAL, naming no key
    (
        {"training": {"steps": "9223372036854775808"}},
        None,
        ["training.steps = 9223372036854775808", "at most 9223372036854775807"],
    ),
    # past gRPC's: every client of the job raised OverflowError
    (
        {"runtime": {"max_message_bytes": "4294967296"}},
        None,
        ["runtime.max_message_bytes = 4294967296", "<= 2147483647"],
    ),
    ({"runtime": {"chunk_bytes": "0"}}, None, ["runtime.chunk_bytes = 0", ">= 1"]),
    (
        {"runtime": {"max_message_bytes": "4194304"}},
        None,
        ["runtime.max_message_bytes = 4194304", "> runtime.chunk_bytes = 4194304"],
    ),
    ({"runtime": {"max_tensor_bytes": "0"}}, None, ["runtime.max_tensor_bytes = 0", ">= 1"]),
    ({"runtime": {"activation_cache": "-1"}}, None, ["runtime.activation_cache = -1", ">= 0"]),
    (
        {"rebalance": {"horizon_s": "60.0"}},
        None,
        ["rebalance.horizon_s = 60.0", "> rebalance.move_cost_s = 60.0"],
    ),
    ({"trainig": {}}, None, ["unknown section trainig", "did you mean training?"]),
    ({"": {"colour": '"red"'}}, None, ["unknown section colour", "allowed: name, model"]),
    ({"training": {"stepz": "3"}}, None, ["training.stepz", "did you mean training.steps?"]),
    ({"model": {"zzz": "3"}}, None, ["unknown key model.zzz", "allowed: model.kind"]),
    ({"": {"name": '"a/b"'}}, None, ['name = "a/b"', "letters, digits"]),
    ({"": {"name": "5"}}, None, ["name = 5", "a string"]),
    ({"": {"model": "3"}, "model": None}, None, ["model = 3", "a [model] table"]),
]


@pytest.mark.parametrize(
    ("overrides", "data", "fragments"), BAD, ids=[" ".join(f[0].split()[:3]) for *_, f in BAD]
)
def test_bad_values_are_named(
    tmp_path: Path, overrides: Sections, data: bytes | None, fragments: list[str]
) -> None:
    (tmp_path / "corpus.txt").write_bytes(TEXT if data is None else data)
    with pytest.raises(ConfigError) as info:
        parse_job(render(overrides), tmp_path)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "broken.toml").write_text("[training\nstages = 4\n")
    with pytest.raises(ConfigError, match=r"broken\.toml: invalid TOML: .*line 1"):
        load_job(tmp_path / "broken.toml")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_job(tmp_path / "missing.toml")


def test_data_path_resolves_against_job_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "jobs").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.txt").write_bytes(TEXT)
    (tmp_path / "jobs" / "j.toml").write_text(render({"data": {"path": '"../data/corpus.txt"'}}))
    monkeypatch.chdir(tmp_path / "data")  # the working directory must not matter
    loaded = load_job(Path("..") / "jobs" / "j.toml")
    assert loaded.data.path == tmp_path / "data" / "corpus.txt"
    absolute = json.dumps(str(tmp_path / "data" / "corpus.txt"))
    assert job(tmp_path, {"data": {"path": absolute}}).data.path == loaded.data.path


def test_fingerprint(tmp_path: Path) -> None:
    base = job(tmp_path)
    assert len(fingerprint(base)) == 16
    assert fingerprint(job(tmp_path)) == fingerprint(base)
    assert fingerprint(load_job(EXAMPLES / "tiny.toml")) == fingerprint(
        load_job(EXAMPLES / "tiny.toml")
    )

    maths: list[Sections] = [
        {"model": {"d_model": "32"}},
        {"training": {"seed": "1"}},
        {"training": {"dtype": '"float64"'}},
        {"optimizer": {"lr": "1e-3"}},
        {"optimizer": {"kind": '"sgd"'}},
        {"compression": {"wire": '"fp16"'}},
        {"compression": {"error_feedback": "false"}},
        {"data": {"kind": '"synthetic"', "path": None}},
    ]
    for overrides in maths:
        assert fingerprint(job(tmp_path, overrides)) != fingerprint(base), overrides
    assert fingerprint(job(tmp_path, data=TEXT + b"!")) != fingerprint(base)

    same: list[Sections] = [
        {"runtime": {"max_in_flight": "2", "rpc_timeout_s": "5"}},
        {"runtime": {"chunk_bytes": "1024", "activation_cache": "0"}},
        {"training": {"checkpoint_every": "10"}},
        {"compression": {"error_feedback": "true"}},  # the default: older jobs keep theirs
        {"": {"name": '"other"'}},
    ]
    for overrides in same:
        assert fingerprint(job(tmp_path, overrides)) == fingerprint(base), overrides
    # The data file is fingerprinted by its content at load time, not by where it lies.
    (tmp_path / "moved").mkdir()
    assert fingerprint(job(tmp_path / "moved")) == fingerprint(base)


def test_data_sha256_is_recorded_and_pins_the_file(tmp_path: Path) -> None:
    digest = hashlib.sha256(TEXT).hexdigest()
    loaded = job(tmp_path)
    assert loaded.data.sha256 == digest
    assert job(tmp_path, {"data": {"sha256": f'"{digest}"'}}) == loaded
    # Built in code without a digest: the fingerprint reads the file instead.
    in_code = dataclasses.replace(loaded, data=dataclasses.replace(loaded.data, sha256=None))
    assert fingerprint(in_code) == fingerprint(loaded)
    (tmp_path / "corpus.txt").unlink()
    assert fingerprint(loaded)  # recorded at load: the file is no longer needed
    with pytest.raises(ConfigError, match="cannot be read"):
        fingerprint(in_code)


@pytest.mark.parametrize(
    "text",
    [
        render(),  # a [data] table: one line added under its header
        render().replace("[data]", "[data]   # the corpus").rstrip("\n"),  # comment, no newline
        render({"data": None}).replace(
            "[model]", 'data = { kind = "text", path = "c.txt" }\n[model]'
        ),
        'data.kind = "text"\ndata.path = "c.txt"\n' + render({"data": None}),  # dotted keys
        render({"data": {"note": '"""\n[data]\n"""'}}),  # a header look-alike in a string
    ],
)
def test_pin_data_sets_data_sha256_and_changes_nothing_else(text: str) -> None:
    digest = hashlib.sha256(TEXT).hexdigest()
    pinned = pin_data(text, digest)
    doc, before = tomllib.loads(pinned), tomllib.loads(text)
    assert doc["data"].pop("sha256") == digest and doc == before
    assert pin_data(pinned, digest) == pinned  # pinned already: unchanged
    if "#" in text:
        assert "# the corpus" in pinned  # written in place, comments kept
    with pytest.raises(ConfigError, match=r"data\.sha256"):
        pin_data(pinned, "0" * 64)


def test_a_pinned_job_names_the_file_and_both_hashes_when_the_data_changed(
    tmp_path: Path,
) -> None:
    digest = hashlib.sha256(TEXT).hexdigest()
    pinned = pin_data(render(), digest)
    assert parse_job(pinned, tmp_path / "x", check_data=False).data.sha256 == digest
    (tmp_path / "corpus.txt").write_bytes(TEXT)
    assert parse_job(pinned, tmp_path).data.sha256 == digest
    changed = TEXT.replace(b"wise", b"rash")
    (tmp_path / "corpus.txt").write_bytes(changed)
    with pytest.raises(ConfigError) as info:
        parse_job(pinned, tmp_path)
    message = str(info.value)
    assert str(tmp_path / "corpus.txt") in message and digest in message
    assert hashlib.sha256(changed).hexdigest() in message and "changed" in message


def test_a_large_data_file_is_hashed_in_pieces(tmp_path: Path) -> None:
    big = TEXT * 30_000  # 6 MB: several reads; a multi-byte character split between two of them
    big = big[: (1 << 20) - 1] + "é".encode() + big[(1 << 20) - 1 :]
    loaded = job(tmp_path, data=big)
    assert loaded.data.sha256 == hashlib.sha256(big).hexdigest()
    with pytest.raises(ConfigError, match="not UTF-8"):
        job(tmp_path, data=big + b"\xff")


def test_each_direction_has_its_codec_and_wire_is_shorthand_for_both() -> None:
    assert CompressionConfig(wire="fp16") == CompressionConfig(
        wire="fp16", forward="fp16", backward="fp16"
    )
    split = CompressionConfig(wire="bf16", backward="hadamard3")
    assert (split.forward, split.backward) == ("bf16", "hadamard3")
    with pytest.raises(ConfigError, match=r'compression.forward = "int4".*"hadamard3"'):
        CompressionConfig(forward="int4")


def test_bf16_mixed_puts_bf16_on_the_wire_unless_the_job_says_otherwise(tmp_path: Path) -> None:
    mixed: Sections = {"training": {"precision": '"bf16-mixed"'}}
    c = job(tmp_path, mixed).compression
    assert (c.wire, c.forward, c.backward) == ("bf16", "bf16", "bf16")
    c = job(tmp_path, {**mixed, "compression": {"backward": '"none"'}}).compression
    assert (c.wire, c.forward, c.backward) == ("none", "none", "none")  # as written
    assert job(tmp_path).compression.wire == "none"  # fp32: as before
    with pytest.raises(ConfigError, match=r"training\.dtype"):
        job(tmp_path, {"training": {"precision": '"bf16-mixed"', "dtype": '"float64"'}})
