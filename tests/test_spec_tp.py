"""Model drafters under tensor parallelism (docs/speculative_decoding.md): ``draft_model`` with the
fixture draft and ``eagle3`` with the fixture head on the demo model at tensor_parallel_size=2 on
2 virtual CPU devices (a subprocess: the device count is fixed when JAX starts) give the greedy
tokens of the target without speculation, accept what they accept on one device, and are split
on the target's mesh (EAGLE-3 reading the target's states from its tensor-parallel steps as
from its one-device steps), a draft quantized on load (``speculative_config`` ``quantization``)
split as a quantized target is; a draft whose heads do not split is refused at start naming it.
``mtp`` on the DeepSeek-V3 MTP fixture at tensor_parallel_size=2 drafts what it drafts on one
device, call for call, with its layer split as the target's layers are and its latent pages as
the target's latent cache."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from jaxserve.config import read_config_json
from jaxserve.models.families.registry import model_config_from_dict
from jaxserve.runner.draft_model import check_one_host
from jaxserve.runner.parallel.sharding import mtp_specs, weight_specs
from tests.conftest import run_with_devices

SPEC = Path(__file__).parent / "fixtures" / "spec"
MTP = SPEC / "deepseek_v3_mtp"

# One LLM per (method, TP size); each prints a line of what the test checks.
SCRIPT = textwrap.dedent("""
    import json, os
    from pathlib import Path
    # TP=1 against TP=2 in one mode: verify steps are read back before the next is scheduled
    # (dispatching the next ahead is off under tensor parallelism, on by default on one device)
    os.environ["JAXSERVE_ASYNC_VERIFY"] = "0"
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
    # A draft quantized on load (speculative_config quantization), split as the target's are.
    METHODS["int8"] = {**METHODS["draft_model"], "quantization": "int8"}
    llm, tokens = run(2, "int8")
    w = llm.engine.proposer.weights.layers[0]
    print(json.dumps({"method": "int8", "same": tokens == plain,
                      "accepted": llm.engine.spec_stats.num_accepted_tokens,
                      "wq": spec(w.wq.q), "scale": spec(w.wq.scale), "dtype": str(w.wq.q.dtype)}))
""")


def test_draft_model_and_eagle3_under_tensor_parallelism() -> None:
    stdout = run_with_devices(SCRIPT, 2, timeout=300)
    draft, eagle3, int8 = (json.loads(line) for line in stdout.strip().splitlines())
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
    # A draft quantized on load (int8): the target's tokens, drafts accepted, its values
    # [out, in] and scales [out] split on the output's heads as a quantized target's are.
    assert int8["same"] and int8["accepted"] > 0 and int8["dtype"] == "int8", int8
    assert int8["wq"] == ["P('tp', None)", [128, 256]] and int8["scale"] == ["P('tp',)", [128]]


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


# The MTP fixture (test_mtp.py's prompts and engine) at TP=2 without speculation, then with mtp
# at TP=1 and TP=2: each generates the prompts twice (the second time the prefix cache serves
# their first blocks, so the drafter runs the target again over them). The drafts of every call
# are recorded from the proposer.
MTP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["JAXSERVE_ASYNC_VERIFY"] = "0"  # TP=1 against TP=2 in one mode (as SCRIPT)
    import jaxserve
    from jaxserve import SamplingParams
    PROMPTS = [
        [0, 5, 17, 33, 99, 120, 7, 8, 9, 44, 45, 46, 47, 48, 200, 201, 11],
        [0, 30, 31, 32],
        [0, 250, 3, 250, 3, 250, 3, 250, 3, 61, 62],
        [0, 12],
    ]
    GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(tp, method=None):
        # (the random MTP layer's drafts rarely pay: drafting must not pause, call for call)
        spec = None if method is None else {"method": method, "num_speculative_tokens": 2,
                                            "pause_when_unpaid": False}
        llm = jaxserve.LLM(sys.argv[1], tensor_parallel_size=tp, speculative_config=spec,
                           max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                           block_size=8, num_gpu_blocks_override=40, dtype="float32",
                           warmup=False)
        drafts = []
        if method is not None:
            propose = llm.engine.proposer.propose
            def recorded(seqs, k, on_device=False):
                out = propose(seqs, k, on_device)
                host = out if isinstance(out, dict) else out.on_host()
                drafts.append(sorted(host.items()))
                return out
            llm.engine.proposer.propose = recorded
        tokens = []
        for _ in range(2):
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                use_tqdm=False)
            tokens.append([list(o.outputs[0].token_ids) for o in outs])
        return llm, tokens, drafts

    def spec(x):  # a sharding's spec, and the shape of device 0's shard
        return [str(x.sharding.spec), list(x.addressable_shards[0].data.shape)]

    _, plain, _ = run(2)
    stats = {}
    for tp in (1, 2):
        llm, tokens, drafts = run(tp, "mtp")
        s = llm.engine.spec_stats
        recomputed = llm.engine.proposer.recomputed_tokens
        stats[tp] = [tokens == plain, drafts, s.num_draft_tokens, s.num_accepted_tokens, recomputed]
    proposer, runner = llm.engine.proposer, llm.engine.runner  # TP=2's
    (mtp,) = proposer.draft_weights
    layer, latent = mtp.layer, proposer.draft_kv[0][0]
    names = ("wq_b", "w_kv_b", "wo", "wkv_a", "router", "experts_gate", "experts_down",
             "shared_down")
    print(json.dumps({
        "stats": stats, **{name: spec(getattr(layer, name)) for name in names},
        "eh_proj": spec(mtp.eh_proj), "enorm": spec(mtp.enorm), "lm_head": spec(mtp.lm_head),
        "shared": [mtp.embed is runner.weights.embed, mtp.lm_head is runner.weights.lm_head],
        "latent": spec(latent), "as_target": latent.sharding == runner.kv_cache[0][0].sharding,
    }))
""")


def mtp_sharing_the_lm_head(directory: Path) -> Path:
    """The MTP fixture with its layer's ``shared_head.head`` left out (the layer shares the
    target's ``lm_head``) and ``eh_proj`` passing the target's hidden state through (its
    embedding half zero): the layer's weights are random, and from the target's own state and
    head a draft is now and then accepted (the target repeating a token)."""
    shutil.copytree(MTP, directory)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.3.shared_head.head.weight"]
    h = json.loads((directory / "config.json").read_text())["hidden_size"]
    eh_proj = np.concatenate([np.zeros((h, h)), np.eye(h)], axis=1)  # [H, 2H]: [embed, hidden]
    tensors["model.layers.3.eh_proj.weight"] = eh_proj.astype(np.float32)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_mtp_under_tensor_parallelism_drafts_as_on_one_device(tmp_path) -> None:
    model_dir = mtp_sharing_the_lm_head(tmp_path / "deepseek_v3_mtp")
    report = json.loads(run_with_devices(MTP_SCRIPT, 2, str(model_dir), timeout=300))
    (same_1, drafts_1, *counts_1), (same_2, drafts_2, *counts_2) = (
        report["stats"]["1"],
        report["stats"]["2"],
    )
    # At TP=1 and at TP=2 with mtp: the greedy tokens of TP=2 without it.
    assert same_1 and same_2
    # The same drafts call for call, so the same counts (some drafts accepted); the second pass
    # runs the target again over the prefixes the cache served, for as many positions as on
    # one device.
    drafted, accepted, recomputed = counts_2
    assert drafts_2 == drafts_1 and drafted > 0 and accepted > 0 and recomputed > 0
    assert counts_2 == counts_1
    # The MTP layer split as the target's layers are: the query heads (4) of the latent
    # attention on the 2 devices, the latent projections whole, o row-parallel; each expert's
    # (and the shared experts') intermediate dim split, the router replicated.
    assert report["wq_b"] == ["P(None, 'tp', None)", [24, 2, 24]]
    assert report["w_kv_b"] == ["P(None, 'tp', None)", [32, 2, 28]]
    assert report["wo"] == ["P('tp', None, None)", [2, 12, 64]]
    assert report["wkv_a"] == ["P(None, None)", [64, 32]]
    assert report["router"] == ["P(None, None)", [64, 8]]
    assert report["experts_gate"] == ["P(None, None, 'tp')", [8, 64, 4]]
    assert report["experts_down"] == ["P(None, 'tp', None)", [8, 4, 64]]
    assert report["shared_down"] == ["P('tp', None)", [4, 64]]
    # eh_proj and the norms replicated; the embedding and lm_head the target's, as sharded.
    assert report["eh_proj"] == ["P()", [128, 64]] and report["enorm"] == ["P()", [64]]
    assert report["lm_head"] == ["P(None, 'tp')", [64, 160]] and report["shared"] == [True, True]
    # The latent pages [P, page, 1, L] as the target's latent cache: whole on every device.
    assert report["latent"] == ["P(None, None, 'kv', None)", [36, 8, 1, 32]]
    assert report["as_target"]


def test_mtp_specs_split_the_experts_as_the_target_does() -> None:
    """With --enable-expert-parallel the MTP layer's experts go whole on the devices, as the
    target's do; without it each expert's intermediate dim is split (specs only: no devices)."""
    config = model_config_from_dict(read_config_json(MTP / "config.json"))
    target = weight_specs(config, 2, expert_parallel=True).layers[-1]
    whole = mtp_specs(config, 0, 2, expert_parallel=True).layer
    sliced = mtp_specs(config, 0, 2).layer
    assert whole.experts_gate == target.experts_gate == P("tp", None, None)
    assert sliced.experts_gate == P(None, None, "tp") and sliced.experts_down == P(None, "tp", None)
    assert whole.wq_b == sliced.wq_b == target.wq_b == P(None, "tp", None)


def test_a_model_drafter_on_a_multi_host_replica_is_refused() -> None:
    for method in ("draft_model", "eagle3", "mtp"):
        with pytest.raises(ValueError, match=f"method={method!r} on a multi-host replica"):
            check_one_host(SimpleNamespace(multihost=True), method)


AHEAD = textwrap.dedent("""
    import json, os
    from pathlib import Path
    import jaxserve
    from jaxserve import SamplingParams
    from jaxserve.engine_config import default_model_dir
    SPEC = Path("tests/fixtures/spec")
    EVAL = json.loads((SPEC / "eval.json").read_text())
    PROMPTS = [s[: EVAL["prompt_len"]] for s in EVAL["sequences"][:2]]
    GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    for method in ("draft_model", "eagle3"):
        spec = {"method": method, "model": str(SPEC / ("draft" if method == "draft_model"
                else "eagle3")), "num_speculative_tokens": EVAL["num_speculative_tokens"]}
        for flag in ("0", "1"):
            os.environ["JAXSERVE_DRAFT_AHEAD"] = flag
            llm = jaxserve.LLM(str(default_model_dir()), tensor_parallel_size=2,
                               speculative_config=spec, max_model_len=128, max_num_seqs=1,
                               block_size=16, num_gpu_blocks_override=64, dtype="float32",
                               warmup=flag == "1")
            outs = [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0]
                    for p in PROMPTS]
            s = llm.engine.spec_stats
            runs[method + flag] = [[list(o.outputs[0].token_ids) for o in outs], s.num_drafts,
                                   s.num_accepted_tokens, llm.engine.proposer.ahead_taken]
            llm.shutdown()
    print(json.dumps(runs))
""")


def test_model_drafters_draft_ahead_of_the_host_under_tensor_parallelism() -> None:
    """``JAXSERVE_DRAFT_AHEAD=1`` at tensor_parallel_size=2 (warm-up on: the calls drafted
    ahead compile there, on the mesh), a draft model and an EAGLE-3 head: the tokens, drafts
    and accepted tokens of drafting after the host reads each step, and steps take the calls
    drafted ahead."""
    runs = json.loads(run_with_devices(AHEAD, 2, timeout=400).strip().splitlines()[-1])
    for method in ("draft_model", "eagle3"):
        off, on = runs[method + "0"], runs[method + "1"]
        assert on[3] > 0 and off[3] == 0, (method, runs)
        assert on[:3] == off[:3], (method, runs)
