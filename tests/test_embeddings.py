"""Embeddings (``--runner pooling``): the engine's vectors equal sentence-transformers' on the
fixtures of each pooling kind (``scripts/make_embedding_golden.py``), with prompts chunked over
many steps; ``dimensions`` and ``normalize``; the pooling config read from the model directory;
the refusals on both sides (a pooling model generates nothing, a generation model embeds
nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxserve.models.pooling import PoolingConfig, PoolingConfigError, is_base_model
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParamsError
from tests.conftest import FIXTURES

EMBEDDINGS = FIXTURES.parent / "embeddings"
TOLERANCE = 1e-4  # fp32 models, against torch
# Steps of at most 16 tokens: the 154-token prompt runs in ten chunks, and the engine compiles
# one token bucket (its model step and its pooling program).
ENGINE = dict(
    dtype="float32",
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    block_size=4,
    num_gpu_blocks_override=256,
    warmup=False,
)


def golden(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(EMBEDDINGS / name / "golden.npz"))


def golden_ids(g: dict[str, np.ndarray]) -> list[list[int]]:
    return [g["token_ids"][i, : g["num_tokens"][i]].tolist() for i in range(len(g["texts"]))]


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


# -- the pooling config, from the model directory (no engine) -----------------------------


@pytest.mark.parametrize(
    ("name", "pooling_type", "normalize"),
    [("qwen3_last", "last", True), ("mistral_mean", "mean", True), ("llama_cls", "cls", False)],
)
def test_the_pooling_comes_from_the_sentence_transformers_files(name, pooling_type, normalize):
    config = PoolingConfig.from_model_dir(EMBEDDINGS / name, 32)
    assert (config.pooling_type, config.normalize) == (pooling_type, normalize)
    assert config.uses_every_token == (pooling_type != "last")


def write_model(tmp_path: Path, pooling: dict | None, normalize: bool, **config) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    if pooling is not None:
        kinds = ["Transformer", "Pooling"] + (["Normalize"] if normalize else [])
        paths = ["", "1_Pooling", "2_Normalize"]
        modules = [
            {"idx": i, "path": paths[i], "type": f"sentence_transformers.models.{kind}"}
            for i, kind in enumerate(kinds)
        ]
        (tmp_path / "modules.json").write_text(json.dumps(modules))
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_the_older_pooling_flags_are_read(tmp_path: Path) -> None:
    flags = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}
    config = PoolingConfig.from_model_dir(write_model(tmp_path, flags, False), 32)
    assert (config.pooling_type, config.normalize) == ("mean", False)


def test_without_sentence_transformers_files_a_decoder_pools_its_last_token_normalized(
    tmp_path: Path,
) -> None:
    config = PoolingConfig.from_model_dir(write_model(tmp_path, None, False), 32)
    assert (config.pooling_type, config.normalize, config.is_matryoshka) == ("last", True, False)


@pytest.mark.parametrize(
    ("pooling", "words"),
    [
        ({"pooling_mode": "max"}, ["pooling_mode='max'", "lasttoken, mean, cls"]),
        ({"pooling_mode_max_tokens": True}, ["pooling_mode_max_tokens"]),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, ["exactly one"]),
    ],
)
def test_a_pooling_that_is_not_served_names_the_file_and_the_mode(tmp_path, pooling, words):
    with pytest.raises(PoolingConfigError) as error:
        PoolingConfig.from_model_dir(write_model(tmp_path, pooling, True), 32)
    assert "1_Pooling/config.json" in str(error.value)
    for word in words:
        assert word in str(error.value)


def test_dimensions_need_a_matryoshka_model_and_one_of_its_dimensions(tmp_path: Path) -> None:
    plain = PoolingConfig.from_model_dir(write_model(tmp_path, None, False), 32)
    with pytest.raises(SamplingParamsError, match="does not support matryoshka") as error:
        plain.check(PoolingParams(dimensions=16))
    assert error.value.param == "dimensions"
    listed = PoolingConfig.from_model_dir(EMBEDDINGS / "qwen3_last", 32)
    assert listed.matryoshka_dimensions == (16, 32)
    listed.check(PoolingParams(dimensions=16))
    with pytest.raises(SamplingParamsError, match=r"dimensions=20 is not one of .*\[16, 32\]"):
        listed.check(PoolingParams(dimensions=20))
    (tmp_path / "config.json").write_text(json.dumps({"is_matryoshka": True}))
    anything = PoolingConfig.from_model_dir(tmp_path, 32)
    anything.check(PoolingParams(dimensions=20))
    with pytest.raises(SamplingParamsError, match="more than the model's hidden size 32"):
        anything.check(PoolingParams(dimensions=33))
    with pytest.raises(SamplingParamsError, match="at least 1"):
        PoolingParams(dimensions=0)


def test_auto_pools_a_checkpoint_that_names_only_base_models() -> None:
    assert is_base_model(["Qwen3Model"]) and is_base_model(["MistralModel"])
    assert not is_base_model(["Qwen3ForCausalLM"]) and not is_base_model(["GPT2LMHeadModel"])
    assert not is_base_model([])


# -- the engine against sentence-transformers ---------------------------------------------


def make_llm(name: str, **overrides):
    import jaxserve

    return jaxserve.LLM(str(EMBEDDINGS / name), runner="pooling", **{**ENGINE, **overrides})


@pytest.fixture(scope="module", params=["qwen3_last", "mistral_mean", "llama_cls"])
def pooled_llm(request):
    return request.param, make_llm(request.param)


def test_embeddings_equal_sentence_transformers_chunked_over_steps(pooled_llm) -> None:
    name, llm = pooled_llm
    g = golden(name)
    texts = [str(t) for t in g["texts"]]
    assert [llm.get_tokenizer().encode(t) for t in texts] == golden_ids(g)
    outputs = llm.embed(texts, use_tqdm=False)
    assert [o.num_prompt_tokens for o in outputs] == g["num_tokens"].tolist()
    assert max(g["num_tokens"]) > 8 * ENGINE["max_num_batched_tokens"]  # many chunks
    got = np.array([o.outputs.embedding for o in outputs])
    np.testing.assert_allclose(got, g["embeddings"], atol=TOLERANCE)
    # Again, the same prompts: last-token pooling takes the prefix cache's blocks, the others
    # compute every token again; the vectors are the same.
    hits = llm.engine.kv.prefix_hits
    again = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    np.testing.assert_allclose(again, g["embeddings"], atol=TOLERANCE)
    assert (llm.engine.kv.prefix_hits > hits) == (name == "qwen3_last")
    assert llm.engine.pooler.num_sequences == 0 and llm.engine.kv.usage == 0


def test_token_ids_and_text_give_the_same_embedding(pooled_llm) -> None:
    name, llm = pooled_llm
    g = golden(name)
    by_ids = llm.embed([{"prompt_token_ids": ids} for ids in golden_ids(g)], use_tqdm=False)
    got = np.array([o.outputs.embedding for o in by_ids])
    np.testing.assert_allclose(got, g["embeddings"], atol=TOLERANCE)


@pytest.fixture(scope="module")
def last_llm():
    return make_llm("qwen3_last")


def test_matryoshka_dimensions_truncate_then_normalize(last_llm) -> None:
    import jaxserve

    g = golden("qwen3_last")
    texts = [str(t) for t in g["texts"]]
    outputs = last_llm.embed(texts, jaxserve.PoolingParams(dimensions=16), use_tqdm=False)
    got = np.array([o.outputs.embedding for o in outputs])
    expected = np.array([unit(p[:16]) for p in g["pooled"]])
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_normalize_false_returns_the_pooled_vector(last_llm) -> None:
    g = golden("qwen3_last")
    out = last_llm.embed(str(g["texts"][1]), PoolingParams(normalize=False), use_tqdm=False)
    np.testing.assert_allclose(out[0].outputs.embedding, g["pooled"][1], atol=TOLERANCE)


def test_each_embedding_is_made_as_its_request_finishes(last_llm, monkeypatch) -> None:
    """``LLM.embed`` turns each finished request into its output (the list of floats) while the
    engine still steps the rest, not all of them after the last step; in the prompts' order."""
    from jaxserve.engine import llm as llm_module

    made_at = []
    make = llm_module._embedding_output

    def recording(out):
        made_at.append(last_llm.engine.num_steps)
        return make(out)

    monkeypatch.setattr(llm_module, "_embedding_output", recording)
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(12)]  # 8 tokens: 2 a step
    before = last_llm.engine.num_steps
    outputs = last_llm.embed(prompts, use_tqdm=False)
    assert len(made_at) == 12 and last_llm.engine.num_steps - before >= 6
    assert min(made_at) < max(made_at)  # the first ones before the last step ran
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert all(isinstance(o.outputs.embedding, list) for o in outputs)


def test_embed_queues_prompts_as_the_steps_need_them(last_llm, monkeypatch) -> None:
    """``LLM.embed`` queues ``POOLING_QUEUED_AHEAD`` steps' token budgets of prompts before its
    first step and the rest between steps (beside the device), with the collector off while it
    runs; the outputs come in the prompts' order all the same."""
    import gc

    from jaxserve.engine import llm as llm_module

    engine = last_llm.engine
    queued, queued_at_step, collecting = [], [], []
    add, step = engine.add_pooling_request, engine.step

    def counting_add(request_id, *args, **kwargs):
        add(request_id, *args, **kwargs)
        queued.append(request_id)

    def recording_step():
        queued_at_step.append(len(queued))
        collecting.append(gc.isenabled())
        return step()

    monkeypatch.setattr(engine, "add_pooling_request", counting_add)
    monkeypatch.setattr(engine, "step", recording_step)
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(40)]  # 8 tokens: 2 a step
    outputs = last_llm.embed(prompts, use_tqdm=False)
    ahead = llm_module.POOLING_QUEUED_AHEAD * engine.config.max_num_batched_tokens // 8
    assert queued_at_step[0] == ahead < len(prompts)
    assert queued_at_step == sorted(queued_at_step) and queued_at_step[-1] == len(prompts)
    assert all(q - ahead <= 2 * i for i, q in enumerate(queued_at_step))  # never far ahead
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert not any(collecting) and gc.isenabled()


def test_a_late_bad_prompt_raises_and_aborts_the_queued_ones(last_llm) -> None:
    """A prompt that cannot run raises when its turn to be queued comes (after earlier steps
    ran); the requests queued before it are aborted, and the engine serves the next call."""
    from jaxserve.engine.request_checks import RequestError

    engine = last_llm.engine
    good = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(30)]
    before = engine.num_steps
    with pytest.raises(RequestError, match="maximum context length is 256"):
        last_llm.embed(good + [[5] * 257] + good, use_tqdm=False)
    assert engine.num_steps > before  # the first prompts ran before the bad one's turn
    assert 0 < engine.num_unfinished() < len(good)  # queued ahead, their aborts sent
    while engine.has_work():  # the next step takes the aborts
        engine.step()
    assert engine.num_unfinished() == 0
    assert len(last_llm.embed(good[:3], use_tqdm=False)) == 3


def test_a_pooling_engine_refuses_generation_and_bad_dimensions(last_llm) -> None:
    from jaxserve.engine.request_checks import RequestError

    with pytest.raises(RequestError, match="served for pooling"):
        last_llm.generate("Hi")
    with pytest.raises(RequestError, match="matryoshka") as error:
        last_llm.embed("Hi", PoolingParams(dimensions=20))
    assert error.value.param == "dimensions"
    with pytest.raises(RequestError, match="maximum context length is 256") as error:
        last_llm.embed({"prompt_token_ids": [5] * 257})
    assert error.value.param == "input"
    # A prompt of the whole context is served: it generates nothing.
    assert len(last_llm.embed({"prompt_token_ids": [5] * 256})[0].outputs.embedding) == 32


def test_a_generation_engine_refuses_embeddings() -> None:
    import jaxserve
    from jaxserve.engine.request_checks import RequestError

    llm = jaxserve.LLM(str(FIXTURES / "llama"), **ENGINE)
    assert llm.engine.config.runner == "generate"  # auto: a *ForCausalLM checkpoint generates
    with pytest.raises(RequestError, match="--runner pooling"):
        llm.embed("Hi")


def test_warm_up_compiles_the_pooling_program_and_no_sampler(tmp_path: Path) -> None:
    g = golden("mistral_mean")
    llm = make_llm("mistral_mean", warmup=True, compilation_cache_dir=str(tmp_path))
    programs = llm.engine.runner.programs
    assert set(programs.compiled_steps) == set(programs.compiled_pool) == {16}
    assert not programs.compiled_samplers and not programs.compiled_logits
    assert not programs.compiled_prompt_lp
    got = [o.outputs.embedding for o in llm.embed(str(g["texts"][2]), use_tqdm=False)]
    np.testing.assert_allclose(got[0], g["embeddings"][2], atol=TOLERANCE)
    llm.shutdown()
