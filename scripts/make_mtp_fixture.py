"""Build ``tests/fixtures/spec/deepseek_v3_mtp``: the DeepSeek-V3 fixture with one MTP layer.

    python scripts/make_mtp_fixture.py

A copy of ``tests/fixtures/models/deepseek_v3`` (its config, tokenizer and target tensors as
they are; not its golden) whose config.json says ``num_nextn_predict_layers: 1`` and whose
``model.safetensors`` gains the MTP layer at ``model.layers.3.``, named as DeepSeek-V3's
published checkpoint names it: ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], a decoder layer named
as the target's last (experts) layer, ``embed_tokens`` (the target's again),
``shared_head.norm`` and ``shared_head.head`` [V, H]. The new weights are random (seeded):
drafts are rarely accepted, which is enough for the lossless check (greedy output identical
with and without ``mtp``). transformers' DeepseekV3 drops MTP layers, so there is no golden of
the MTP step from it. numpy and safetensors only; deterministic.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "tests" / "fixtures" / "models" / "deepseek_v3"
OUT = REPO / "tests" / "fixtures" / "spec" / "deepseek_v3_mtp"
SEED = 42
STD = 0.15  # the fixture's initializer_range


def main() -> None:
    config = json.loads((SOURCE / "config.json").read_text())
    num_layers, h = config["num_hidden_layers"], config["hidden_size"]
    vocab = config["vocab_size"]
    tensors = load_file(SOURCE / "model.safetensors")
    rng = np.random.default_rng(SEED)
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    new: dict[str, np.ndarray] = {}
    for name in sorted(tensors):
        if name.startswith(last):
            like = tensors[name]
            norm = name.endswith(("layernorm.weight", "_norm.weight"))
            value = np.ones_like(like) if norm else rng.normal(0, STD, like.shape)
            if name.endswith("e_score_correction_bias"):
                value = np.zeros_like(like)
            new[mtp + name[len(last) :]] = value.astype(like.dtype)
    new[mtp + "enorm.weight"] = np.ones(h, np.float32)
    new[mtp + "hnorm.weight"] = np.ones(h, np.float32)
    new[mtp + "eh_proj.weight"] = rng.normal(0, STD, (h, 2 * h)).astype(np.float32)
    new[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    new[mtp + "shared_head.norm.weight"] = np.ones(h, np.float32)
    new[mtp + "shared_head.head.weight"] = rng.normal(0, STD, (vocab, h)).astype(np.float32)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    for path in SOURCE.iterdir():
        if path.name not in ("golden.npz", "model.safetensors", "config.json"):
            shutil.copy(path, OUT / path.name)
    (OUT / "config.json").write_text(
        json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2, sort_keys=True) + "\n"
    )
    save_file({**tensors, **new}, str(OUT / "model.safetensors"), metadata={"format": "pt"})
    print(f"{OUT}: {len(new)} MTP tensors at {mtp}")


if __name__ == "__main__":
    main()
