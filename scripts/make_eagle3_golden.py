"""The EAGLE-3 head's golden outputs, from a PyTorch head built of transformers' Llama parts.

    /work/goldenvenv/bin/python scripts/make_eagle3_golden.py   # torch + transformers, CPU

The head is SpecForge's ``LlamaForCausalLMEagle3`` (as vLLM's ``llama_eagle3.py`` runs it):
transformers' ``LlamaAttention`` with its q/k/v projections widened to read 2H, ``LlamaMLP``,
``LlamaRMSNorm`` (input_layernorm on the embedding, hidden_norm on the hidden state,
post_attention_layernorm, norm), ``fc`` over the three aux states and ``lm_head`` over the draft
vocabulary, mapped to target ids by ``d2t``. It loads the fixture head
(``tests/fixtures/spec/eagle3``, made by ``make_spec_fixtures.py``) and the demo model's
embedding, runs one causal step over ``NUM_TOKENS`` tokens with random aux states, and writes
``tests/fixtures/spec/eagle3_golden.npz``: the inputs, the draft logits and the pre-norm
hidden state, which ``tests/test_eagle3.py`` compares with ``eagle3_forward``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

REPO = Path(__file__).resolve().parent.parent
HEAD = REPO / "tests" / "fixtures" / "spec" / "eagle3"
DEMO = REPO / "jaxserve" / "assets" / "demo"
NUM_TOKENS = 12


class Eagle3Head(torch.nn.Module):
    def __init__(self, config: LlamaConfig, target_hidden_size: int, draft_vocab_size: int):
        super().__init__()
        h = config.hidden_size
        config._attn_implementation = "eager"
        self.fc = torch.nn.Linear(3 * target_hidden_size, h, bias=False)
        self.input_layernorm = LlamaRMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):  # the attention reads [embedding, hidden]
            out = getattr(self.self_attn, name).out_features
            setattr(self.self_attn, name, torch.nn.Linear(2 * h, out, bias=False))
        self.mlp = LlamaMLP(config)
        self.norm = LlamaRMSNorm(h, config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(h, draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, embeds, aux, positions):  # [1, T, H], [1, T, 3H_t], [1, T]
        hidden = self.fc(aux)
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        attn, _ = self.self_attn(x, self.rotary(x, positions), attention_mask=mask)
        residual = residual + attn
        prenorm = residual + self.mlp(self.post_attention_layernorm(residual))
        return self.lm_head(self.norm(prenorm)), prenorm


def main() -> None:
    raw = json.loads((HEAD / "config.json").read_text())
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures",)})
    head = Eagle3Head(config, raw["target_hidden_size"], raw["draft_vocab_size"])
    tensors = {k: v.float() for k, v in load_file(HEAD / "model.safetensors").items()}
    state = {k.removeprefix("midlayer."): v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    missing, unexpected = head.load_state_dict(state, strict=False)
    assert not unexpected and all(name.startswith("rotary") for name in missing), (
        missing,
        unexpected,
    )
    embed = load_file(DEMO / "model.safetensors")["model.embed_tokens.weight"].float()
    rng = np.random.default_rng(0)
    token_ids = rng.integers(0, raw["vocab_size"], NUM_TOKENS)
    aux = rng.standard_normal((NUM_TOKENS, 3 * raw["target_hidden_size"])).astype(np.float32)
    positions = np.arange(3, 3 + NUM_TOKENS)  # as after a 3-token prefix
    with torch.no_grad():
        logits, prenorm = head(
            embed[torch.as_tensor(token_ids)][None],
            torch.as_tensor(aux)[None],
            torch.as_tensor(positions)[None],
        )
    draft_to_target = np.arange(raw["draft_vocab_size"]) + tensors["d2t"].long().numpy()
    np.savez(
        REPO / "tests" / "fixtures" / "spec" / "eagle3_golden.npz",
        token_ids=token_ids.astype(np.int32),
        positions=positions.astype(np.int32),
        aux=aux,
        draft_logits=logits[0].numpy(),
        prenorm=prenorm[0].numpy(),
        draft_to_target=draft_to_target.astype(np.int32),
    )
    print(f"wrote eagle3_golden.npz: {NUM_TOKENS} tokens, logits {tuple(logits[0].shape)}")


if __name__ == "__main__":
    main()
