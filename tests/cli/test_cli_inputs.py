"""Every input of ``ngram-hal run`` checked before anything runs: prompts files (keys, size,
nesting, encoding, ids), seeds, ``--prompt`` with ``--prompts``, report destinations, and prompts
too long for the context (refused after the tokenizer is read, before the model loads).

The command-line cases run the console script in a subprocess, as a user runs it; none of them
loads the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from ngram_hal.cli.checks import prompt_room_error
from ngram_hal.engine.config import LlamaConfig
from ngram_hal.engine.engine import Engine, EngineConfig
from ngram_hal.engine.model import LlamaModel
from ngram_hal.engine.request import Request, SamplingParams
from ngram_hal.engine.workload import MAX_JSON_DEPTH, MAX_LINE_BYTES, json_depth_over, load_prompts
from ngram_hal.reference import CpuBackend

from test_cli_errors import check_one_error_line, run_cli

GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}]})


def model_available() -> bool:
    from ngram_hal.engine.gguf_loader import find_model_file

    try:
        find_model_file()
    except (FileNotFoundError, OSError):
        return False
    return True


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    texts = {
        "unknown-keys": f'{GOOD}\n{{"messages": [{{"role": "user", "content": "x"}}], "max_tokens": 3, '
                        f'"temperture": 0.5}}\n'.encode(),
        "deep": f"{GOOD}\n".encode() + b"[" * 200_000 + b"\n",
        "huge": ('{"messages": [{"role": "user", "content": "' + "a" * 10_000_000 + '"}]}\n').encode(),
        "not-utf8": f"{GOOD}\n\n".encode() + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n',
        "good": f"{GOOD}\n".encode(),
    }
    for name, data in texts.items():
        (root / f"{name}.jsonl").write_bytes(data)
    (root / "a-file").write_text("not a folder\n")
    return {name: root / f"{name}.jsonl" for name in texts} | {"root": root, "a-file": root / "a-file"}


# (arguments, the one error line): each is refused with exit code 2 before the model loads.
CASES = {
    "unknown-keys": (["--prompts", "{unknown-keys}"],
                     r"^error: --prompts \S+unknown-keys.jsonl line 2: unknown keys 'max_tokens', 'temperture' "
                     r"\(a line may hold: id, kind, messages, max_new_tokens\)$"),
    "deep-json": (["--prompts", "{deep}"],
                  rf"^error: --prompts \S+deep.jsonl line 2: JSON nested deeper than {MAX_JSON_DEPTH} levels"),
    "huge-line": (["--prompts", "{huge}"],
                  rf"^error: --prompts \S+huge.jsonl line 1: longer than {MAX_LINE_BYTES} bytes \(1 MiB\)"),
    "not-utf8": (["--prompts", "{not-utf8}"],
                 r"^error: --prompts \S+not-utf8.jsonl line 3: not UTF-8 \(byte 0xe9 at byte 47 of the line\)$"),
    "prompt-and-prompts": (["--prompt", "hi", "--prompts", "{good}"],
                           r"^error: --prompt and --prompts \S+good.jsonl: give one of them"),
    "seed-too-big": (["--temperature", "1", "--seed", str(2**64)],
                     r"^error: argument --seed: '18446744073709551616': input should be less than "
                     r"18446744073709551616"),
    "negative-seed": (["--seed", "-1"], r"^error: argument --seed: '-1': input should be greater than or equal to 0"),
    "json-into-a-folder": (["--prompt", "hi", "--json", "{root}"], r"^error: --json \S+: is a folder, not a file$"),
    "json-under-a-file": (["--prompt", "hi", "--json", "{a-file}/run.json"],
                          r"^error: --json \S+a-file/run.json: \S+a-file is not a folder$"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_is_refused_before_anything_loads(case, files):
    args, message = CASES[case]
    done = run_cli("run", *(a.format(**files) for a in args), timeout=60)
    check_one_error_line(done.returncode, done.stdout, done.stderr, message)


def test_a_bad_input_keeps_exit_code_2_with_debug(files):
    done = run_cli("run", "--prompts", str(files["unknown-keys"]), "--debug", timeout=60)
    assert done.returncode == 2 and "Traceback (most recent call last)" in done.stderr
    assert done.stderr.splitlines()[-1].startswith("error: --prompts ")


@pytest.mark.skipif(not model_available(), reason="the model file is not installed")
def test_a_prompt_too_long_for_the_context_is_refused_before_the_model_loads(tmp_path):
    prompts = tmp_path / "long.jsonl"
    long = json.dumps({"messages": [{"role": "user", "content": "word " * 300}]})
    prompts.write_text(f"{GOOD}\n{long}\n")
    done = run_cli("run", "--prompts", str(prompts), "--max-context-len", "128", "--tree-size", "4",
                   "--json", str(tmp_path / "run.json"), timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert lines[-1].startswith(f"error: --prompts {prompts} line 2: ")
    assert lines[-1].endswith("prompt tokens; --max-context-len 128 holds at most 115 with --tree-size 4 "
                              "(12 positions stay free for draft trees)")
    # The tokenizer was read from the model file's metadata; the weights never loaded.
    assert "reading the tokenizer of" in done.stderr and "loading" not in done.stderr
    assert done.stdout == "" and not (tmp_path / "run.json").exists()


# ---------------------------------------------------------------- the prompts file, in this process


def write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_bytes(data)
    return path


def test_prompts_lines_refuse_unknown_and_missing_keys(tmp_path):
    path = write(tmp_path, b'{"messages": [{"role": "user", "content": "a"}], "temperture": 1}\n')
    with pytest.raises(ValueError, match=r"p.jsonl line 1: unknown key 'temperture' \(a line may hold: id, kind, "
                                         r"messages, max_new_tokens\)$"):
        load_prompts(path)
    path = write(tmp_path, b'{"messages": [{"role": "user", "text": "a"}]}\n')
    with pytest.raises(ValueError, match=r"line 1: messages\[0\]: unknown key 'text' \(a message has: role, content\)"):
        load_prompts(path)
    path = write(tmp_path, f'{GOOD}\n{{"messages": [{{"role": "user"}}]}}\n'.encode())
    with pytest.raises(ValueError, match=r"line 2: messages\[0\]: no key 'content' \(a message has: role, content\)"):
        load_prompts(path)


def test_prompts_lines_size_rule_counts_bytes_without_the_line_end(tmp_path):
    head, tail = '{"messages": [{"role": "user", "content": "', '"}]}'
    fill = MAX_LINE_BYTES - len(head) - len(tail)
    longest = (head + "a" * fill + tail).encode()
    specs = load_prompts(write(tmp_path, longest + b"\r\n" + GOOD.encode() + b"\n"))
    assert len(specs) == 2 and len(specs[0].messages[0]["content"]) == fill
    with pytest.raises(ValueError, match=r"line 1: longer than 1048576 bytes"):
        load_prompts(write(tmp_path, (head + "a" * (fill + 1) + tail).encode()))


def test_prompts_json_depth_is_read_before_parsing():
    assert not json_depth_over(GOOD, 3) and json_depth_over(GOOD, 2)
    assert not json_depth_over('{"a": "[[[[[[[[[[[[[[[[[[[[\\"]]]"}', 1)
    assert json_depth_over("[" * 100_000, MAX_JSON_DEPTH)


def test_prompts_file_checks_encoding_json_and_ids(tmp_path):
    specs = load_prompts(write(tmp_path, b"\xef\xbb\xbf" + GOOD.encode() + b"\n\n" + GOOD.encode() + b"\n"))
    assert [(s.id, s.line) for s in specs] == [("line-1", 1), ("line-3", 3)]
    with pytest.raises(ValueError, match=r"line 2: not UTF-8 \(byte 0xff at byte 1 of the line\)"):
        load_prompts(write(tmp_path, GOOD.encode() + b"\n\xff\n"))
    digits = GOOD[:-1] + ', "max_new_tokens": ' + "9" * 5000 + "}"
    with pytest.raises(ValueError, match=r"line 1: not usable JSON \(Exceeds the limit"):
        load_prompts(write(tmp_path, digits.encode()))
    same = json.dumps({"id": "x", "messages": [{"role": "user", "content": "a"}]})
    with pytest.raises(ValueError, match=r"line 3: id 'x' is already the id of line 1"):
        load_prompts(write(tmp_path, f"{same}\n{GOOD}\n{same}\n".encode()))


# ---------------------------------------------------------------- seeds and the engine's rule


def test_seeds_are_checked_when_the_params_are_made():
    for bad in (2**64, 2**70, -1):
        with pytest.raises(ValidationError, match=r"seed\n"):
            SamplingParams(temperature=1.0, seed=bad)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


@pytest.fixture(scope="module")
def tiny_model():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, tie_word_embeddings=False, eos_token_id=None)
    return LlamaModel.random(cfg, CpuBackend(), seed=1)


def test_the_largest_seed_samples(tiny_model):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(tiny_model, None, EngineConfig(tree_size=2, num_slots=256, max_context_len=64))
        params = [SamplingParams(max_new_tokens=3), SamplingParams(temperature=1.0, seed=2**64 - 1, max_new_tokens=3)]
        outs = engine.generate([[1, 2, 3], [4, 5, 6]], params)
    finally:
        torch.set_num_threads(threads)
    assert [len(o.token_ids) for o in outs] == [3, 3] and not any(o.error for o in outs)


@pytest.mark.parametrize("tree_size,max_context_len,num_slots,page_size",
                         [(4, 64, 4096, 1), (1, 32, 4096, 1), (4, 64, 60, 1), (4, 64, 60, 16), (2, 64, 50, 7)])
def test_the_prompt_rule_is_the_engines(tiny_model, tree_size, max_context_len, num_slots, page_size):
    """For every prompt length around the limits, the command refuses exactly what the engine would."""
    engine = Engine(tiny_model, None, EngineConfig(tree_size=tree_size, num_slots=num_slots,
                                                   max_context_len=max_context_len, graphs=False, page_size=page_size))
    for n in range(1, max_context_len + 2):
        params = SamplingParams(max_new_tokens=16)
        engine_says = engine.sched.check(Request([1] * n, params))
        ours = prompt_room_error(n, 16, tree_size, max_context_len, num_slots, f"--tree-size {tree_size}",
                                 page_size)
        assert (engine_says is None) == (ours is None), (n, engine_says, ours)
