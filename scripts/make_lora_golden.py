"""Build the LoRA parity fixtures under ``tests/fixtures/lora/``: random PEFT adapters on the tiny
llama fixture, and the logits transformers + peft compute with each adapter.

Run with an interpreter that has torch, transformers and peft (CPU is enough):

    python scripts/make_lora_golden.py

Each adapter directory holds what ``PeftModel.save_pretrained`` writes (``adapter_config.json``,
``adapter_model.safetensors``) and a ``golden.npz``: the prompt's prefill logits, a greedy run of
``NUM_GREEDY`` tokens and the logits each came from, all from the ``PeftModel`` forward (the
adapter applied as ``x @ A @ B * scale`` beside the base layer, which is what merging computes).
The adapters differ in rank, scaling (one uses rsLoRA) and target modules, and their B matrices
are random (PEFT initialises B to zero), so each one changes the model's tokens. The output is
deterministic for the same torch / transformers / peft versions.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import peft
import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "tests" / "fixtures" / "models" / "llama"
OUT = REPO / "tests" / "fixtures" / "lora"
NUM_GREEDY = 8
MIN_MARGIN = 0.05  # top-1 minus top-2 logit at every greedy step
MAX_SEED_TRIES = 64
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

# name -> (rank, lora_alpha, use_rslora, target_modules, std of the random A and B)
ADAPTERS: dict[str, tuple[int, int, bool, list[str] | str, float]] = {
    "alpha": (8, 16, False, "all-linear", 0.2),
    "beta": (4, 8, True, "all-linear", 0.25),
    "gamma": (16, 8, False, ATTENTION, 0.2),
    "delta": (2, 4, False, MLP, 0.3),
}


def greedy_run(model: torch.nn.Module, prompt_ids: list[int]) -> dict[str, np.ndarray]:
    """Prefill logits, then greedy tokens through the model's cache and their logits."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
        prefill = out.logits[0]
        cache, row = out.past_key_values, prefill[-1]
        ids, rows = [], []
        for _ in range(NUM_GREEDY):
            token = int(row.argmax())
            ids.append(token)
            rows.append(row)
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache, row = out.past_key_values, out.logits[0, -1]
        decode = torch.stack(rows)
    top2 = decode.topk(2, dim=-1).values
    return {
        "prompt_ids": np.asarray(prompt_ids, np.int32),
        "prefill_logits": prefill.numpy().astype(np.float32),
        "greedy_ids": np.asarray(ids, np.int32),
        "decode_logits": decode.numpy().astype(np.float32),
        "greedy_margins": (top2[:, 0] - top2[:, 1]).numpy().astype(np.float32),
    }


def randomize_adapter(model: torch.nn.Module, seed: int, std: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(std * torch.randn(param.shape, generator=gen))


def write_adapter(name: str, index: int, prompt_ids: list[int], base_ids: np.ndarray) -> None:
    rank, alpha, rslora, targets, std = ADAPTERS[name]
    out = OUT / name
    if out.exists():
        shutil.rmtree(out)
    for attempt in range(MAX_SEED_TRIES):
        seed = 100 * (index + 1) + attempt
        base = transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()
        config = peft.LoraConfig(
            r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, lora_dropout=0.0
        )
        model = peft.get_peft_model(base, config).eval()
        randomize_adapter(model, seed, std)
        result = greedy_run(model, prompt_ids)
        changed = not np.array_equal(result["greedy_ids"], base_ids)
        if result["greedy_margins"].min() > MIN_MARGIN and changed:
            break
    else:
        raise RuntimeError(f"{name}: no seed in {MAX_SEED_TRIES} tries has clear greedy tokens")
    model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)  # peft's model card template
    # NOTE: the base model as a user would name it, not this machine's absolute path.
    config_path = out / "adapter_config.json"
    text = config_path.read_text().replace(str(BASE), "tests/fixtures/models/llama")
    config_path.write_text(text)
    result["seed"] = np.int64(seed)
    np.savez_compressed(out / "golden.npz", **result)
    print(
        f"{name:6s} r={rank} alpha={alpha} rslora={rslora} seed={seed} "
        f"greedy={result['greedy_ids'].tolist()}"
    )


def main() -> None:
    torch.set_num_threads(1)
    golden = np.load(BASE / "golden.npz")
    prompt_ids = golden["prompt_ids"].tolist()
    for index, name in enumerate(ADAPTERS):
        write_adapter(name, index, prompt_ids, golden["greedy_ids"])


if __name__ == "__main__":
    main()
