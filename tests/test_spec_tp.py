"""Model drafters under tensor parallelism (docs/speculative_decoding.md): ``draft_model`` with the
fixture draft and ``eagle3`` with the fixture head on the demo model at tensor_parallel_size=2 on
2 virtual CPU devices (a subprocess: the device count is fixed when JAX starts) give the greedy
tokens of the target without speculation, accept what they accept on one device, and are split
on the target's mesh (EAGLE-3 reading the target's states from its tensor-parallel steps as
from its one-device steps); a draft whose heads do not split is refused at start naming it; ``mtp``
is refused under tensor parallelism naming the field."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxserve.engine.spec_decode import DrafterTarget, make_proposer
from jaxserve.engine_config import EngineConfig, SpeculativeConfig
from jaxserve.runner.draft_model import check_one_host
from tests.conftest import run_with_devices

SPEC = Path(__file__).parent / "fixtures" / "spec"

# One LLM per (method, TP size); each prints a line of what the test checks.
SCRIPT = textwrap.dedent("""
    import json
    from pathlib import Path
    import jaxserve
    from jaxserve import SamplingParams
    from jaxserve.engine_config import default_model_dir
    SPEC = Path("tests/fixtures/spec")
    EVAL = json.loads((SPEC / "eval.json").read_text())
    PROMPTS = [s[: EVAL["prompt_len"]] for s in EVAL["sequences"][:4]]
    GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    METHODS = {
        "draft_model": {"method": "draft_model", "model": str(SPEC / "draft")},
        "eagle3": {"method": "eagle3", "model": str(SPEC / "eagle3")},
    }

    def run(tp, method=None):
        spec = None if method is None else {
            **METHODS[method], "num_speculative_tokens": EVAL["num_speculative_tokens"]}
        llm = jaxserve.LLM(str(default_model_dir()), tensor_parallel_size=tp,
                           speculative_config=spec, max_model_len=128, max_num_seqs=8,
                           max_num_batched_tokens=32, block_size=16,
                           num_gpu_blocks_override=64, dtype="float32", warmup=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return llm, [list(o.outputs[0].token_ids) for o in outs]

    def spec(x):  # a sharding's spec, and the shape of device 0's shard
        return [str(x.sharding.spec), list(x.addressable_shards[0].data.shape)]

    _, plain = run(2)
    for method in METHODS:
        stats = {}
        for tp in (1, 2):
            llm, tokens = run(tp, method)
            s = llm.engine.spec_stats
            recomputed = getattr(llm.engine.proposer, "recomputed_tokens", 0)
            stats[tp] = [tokens == plain, s.num_draft_tokens, s.num_accepted_tokens, recomputed]
        proposer = llm.engine.proposer  # TP=2's
        if method == "draft_model":
            w, kv = proposer.weights.layers[0], proposer.kv[0][0]
            extra = {}
        else:
            w, kv = proposer.draft_weights.layer, proposer.draft_kv[0]
            head = proposer.draft_weights
            extra = {"lm_head": spec(head.lm_head), "fc": spec(head.fc),
                     "embed_shared": head.embed is llm.engine.runner.weights.embed}
        print(json.dumps({"method": method, "stats": stats, "wq": spec(w.wq), "wk": spec(w.wk),
                          "wo": spec(w.wo), "w_down": spec(w.w_down), "kv": spec(kv), **extra}))
""")


def test_draft_model_and_eagle3_under_tensor_parallelism() -> None:
    stdout = run_with_devices(SCRIPT, 2, timeout=300)
    draft, eagle3 = (json.loads(line) for line in stdout.strip().splitlines())
    for report in (draft, eagle3):
        (same_1, drafted_1, accepted_1, again_1), (same_2, drafted_2, accepted_2, again_2) = (
            report["stats"]["1"],
            report["stats"]["2"],
        )
        # At TP=1 and at TP=2 with the drafter: the greedy tokens of TP=2 without it.
        assert same_1 and same_2, report
        # The drafter drafts and is accepted as on one device, and (EAGLE-3) reads the target's
        # states from its steps as on one device: the target runs again for as many positions.
        assert accepted_2 > 0 and (drafted_2, accepted_2) == (drafted_1, accepted_1), report
        assert again_2 == again_1, report
        # Query heads (4) and KV heads (2) split over the 2 devices; o and down row-parallel.
        assert report["wo"] == ["P('tp', None, None)", [2, 64, 256]]
        assert report["w_down"] == ["P('tp', None)", [384, 256]]
        # The pages [P, page, K, D] split on KV heads: one of the 2 on each device.
        assert report["kv"][0] == "P(None, None, 'kv', None)" and report["kv"][1][2:] == [1, 64]
    assert draft["wq"] == ["P(None, 'tp', None)", [256, 2, 64]]
    assert draft["wk"] == ["P(None, 'kv', None)", [256, 1, 64]]
    # The head's q, k, v read [embedding, hidden] (2 x 256); only their heads split.
    assert eagle3["wq"] == ["P(None, 'tp', None)", [512, 2, 64]]
    assert eagle3["wk"] == ["P(None, 'kv', None)", [512, 1, 64]]
    assert eagle3["lm_head"] == ["P(None, 'tp')", [256, 512]]  # the draft vocabulary, 1024
    assert eagle3["fc"] == ["P()", [768, 256]]  # replicated
    assert eagle3["embed_shared"]  # the target's embedding, as it is sharded


REFUSED = textwrap.dedent("""
    import sys
    import jaxserve
    from jaxserve.engine_config import default_model_dir
    try:
        jaxserve.LLM(str(default_model_dir()), tensor_parallel_size=2, max_model_len=128,
                     speculative_config={"method": "draft_model", "model": sys.argv[1],
                                         "num_speculative_tokens": 3},
                     num_gpu_blocks_override=64, dtype="float32", warmup=False)
    except ValueError as exc:
        print(exc)
""")


def test_a_draft_whose_heads_do_not_split_is_refused_naming_it(tmp_path) -> None:
    draft = tmp_path / "odd_draft"
    shutil.copytree(SPEC / "draft", draft)
    config = json.loads((draft / "config.json").read_text())
    config.update(num_attention_heads=1, num_key_value_heads=1)  # 1 head of 64
    (draft / "config.json").write_text(json.dumps(config))
    stdout = run_with_devices(REFUSED, 2, str(draft), timeout=300)
    assert stdout.strip() == (
        "speculative_config: the draft model 'odd_draft': tensor_parallel_size=2 must divide "
        "num_q_heads=1 (each device computes whole query heads)"
    )


def test_mtp_under_tensor_parallelism_is_refused_naming_the_field() -> None:
    engine = EngineConfig(tensor_parallel_size=2)
    runner = SimpleNamespace(multihost=False)  # refused before the drafter reads the runner
    target = DrafterTarget(engine, None, None, 128, runner=runner)
    why = r"\(its layers are not laid out for tensor parallelism\)"
    with pytest.raises(
        ValueError,
        match=rf"method='mtp' runs its drafter on one device {why}: "
        r"tensor_parallel_size=2 must be 1 with it",
    ):
        make_proposer(SpeculativeConfig(method="mtp", num_speculative_tokens=1), target)


def test_a_model_drafter_on_a_multi_host_replica_is_refused() -> None:
    for method in ("draft_model", "eagle3"):
        with pytest.raises(ValueError, match=f"method={method!r} on a multi-host replica"):
            check_one_host(SimpleNamespace(multihost=True), method)
