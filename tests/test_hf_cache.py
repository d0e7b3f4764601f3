"""Hugging Face model ids: served offline from the local Hugging Face cache when there, else one
error line that says nothing is downloaded and how to get the model (hf_cache.py).

Each test builds a cache in tmp_path in huggingface_hub's layout (blobs, snapshots of links to
them, refs naming a commit) around the tiny Llama fixture.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

import jaxserve
from jaxserve.cli import main
from jaxserve.hf_cache import ModelNotFoundError, hf_hub_cache_dir, is_repo_id, resolve_model_dir
from jaxserve.sampling_params import SamplingParams

FIXTURE = Path(__file__).parent / "fixtures" / "models" / "llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_cache(cache: Path, repo_id: str, commit: str = COMMIT, branch: str = "main") -> Path:
    """The fixture model as ``hf download repo_id`` leaves it in ``cache``; its snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for path in FIXTURE.iterdir():
        if path.name == "golden.npz":
            continue
        blob = repo / "blobs" / f"{commit[:8]}-{path.name}"
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """HF_HOME in tmp_path (the other cache variables unset); its hub directory."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf" / "hub"


def test_the_cache_dir_follows_huggingface_hubs_variables(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf_hub_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hf_hub_cache_dir() == tmp_path / "hub"


def test_a_cached_id_resolves_to_its_snapshot(hf_home, tmp_path):
    snapshot = add_to_cache(hf_home, "org/tiny")
    assert resolve_model_dir("org/tiny") == snapshot
    assert resolve_model_dir("org/tiny", revision=COMMIT) == snapshot
    v1 = add_to_cache(hf_home, "org/tiny", commit="f" * 40, branch="v1")
    assert resolve_model_dir("org/tiny", revision="v1") == v1
    assert resolve_model_dir("org/tiny") == snapshot  # main still names the first
    elsewhere = add_to_cache(tmp_path / "downloads", "org/tiny")  # vLLM's --download-dir
    assert resolve_model_dir("org/tiny", cache_dir=tmp_path / "downloads") == elsewhere
    assert resolve_model_dir(str(FIXTURE)) == FIXTURE  # a directory is itself


def test_a_model_not_in_the_cache_says_how_to_get_it(hf_home):
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model_dir("Qwen/Qwen3-8B")
    message = str(error.value)
    assert "\n" not in message
    assert f"no Hugging Face model of that id is in the cache ({hf_home})" in message
    assert "jaxserve downloads nothing" in message
    assert "`hf download Qwen/Qwen3-8B`" in message and "pass the model's directory" in message
    add_to_cache(hf_home, "org/tiny")
    with pytest.raises(ModelNotFoundError, match=f"revision 'v2' is not .* snapshots: {COMMIT}"):
        resolve_model_dir("org/tiny", revision="v2")
    with pytest.raises(ModelNotFoundError, match="/no/such/dir: no such model directory"):
        resolve_model_dir("/no/such/dir")


def test_an_interrupted_download_is_named(hf_home):
    snapshot = add_to_cache(hf_home, "org/tiny")
    (snapshot / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="has no config.json .*hf download org/tiny"):
        resolve_model_dir("org/tiny")


@pytest.mark.parametrize(
    ("text", "is_id"),
    [("org/name", True), ("gpt2", True), ("Qwen/Qwen2.5-0.5B", True), ("/abs/dir", False),
     ("./dir", False), ("a/b/c", False), ("../x", False), ("org--x/y", False)],
)  # fmt: skip
def test_repo_ids(text, is_id):
    assert is_repo_id(text) == is_id


def test_serve_stops_at_once_on_a_missing_model(hf_home, caplog):
    caplog.set_level(logging.INFO)
    assert main(["serve", "org/missing", "--port", "0"]) == 1
    (error,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert error.startswith("org/missing is not a local directory") and "hf download" in error
    assert "Loading" not in caplog.text


def test_capacity_reads_a_cached_model(hf_home, capsys):
    add_to_cache(hf_home, "org/tiny")
    assert main(["capacity", "org/tiny", "--device-memory", "1GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"].endswith(f"snapshots/{COMMIT}")


def test_a_cached_model_serves_offline_as_its_directory(hf_home):
    add_to_cache(hf_home, "org/tiny")
    golden = np.load(FIXTURE / "golden.npz")
    llm = jaxserve.LLM(
        "org/tiny",
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        block_size=4,
        num_gpu_blocks_override=128,
    )  # test_engine.py's settings: its compiled programs are reused
    assert llm.engine.config.model_name == "org/tiny"
    prompt = {"prompt_token_ids": [int(t) for t in golden["prompt_ids"]]}
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate(prompt, greedy)[0]
    assert out.outputs[0].token_ids == golden["greedy_ids"].tolist()


def test_offline_benchmarks_say_how_to_get_a_missing_model(hf_home):
    with pytest.raises(
        SystemExit, match="^error: org/missing is not a local directory.*hf download"
    ):
        main(["bench", "latency", "--model", "org/missing", "--batch-size", "1"])
