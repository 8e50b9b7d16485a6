"""Writes a tiny LoRA adapter for the tier's tiny model (PEFT's on-disk form:
adapter_config.json and adapter_model.safetensors), with small random
weights: rank 8 on every layer's q_proj and v_proj, shapes read from the
model's config.json. vLLM loads it with `--enable-lora --lora-modules
NAME=PATH`; its answers do not matter to the tests, only that requests for
NAME run with a LoRA request (whose name and path vLLM hashes into every
block).

Run with the tier's venv python (torch and safetensors are there):
    ~/.cache/kvroute/vllm-0.32/venv/bin/python tests/real/make_lora.py OUT_DIR [MODEL_DIR]
or call write_adapter() from a fixture (the tier's pytest runs in that venv).
"""
import json
import sys
from pathlib import Path

RANK = 8
TARGETS = ("q_proj", "v_proj")


def write_adapter(out_dir, model_dir, rank=RANK, seed=0):
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    out_features = {"q_proj": cfg["num_attention_heads"] * head_dim,
                    "v_proj": cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in TARGETS:
            pre = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.01
            tensors[f"{pre}.lora_B.weight"] = torch.randn(out_features[m], rank, generator=g) * 0.01
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "task_type": "CAUSAL_LM", "target_modules": list(TARGETS), "base_model_name_or_path": str(model_dir),
        "fan_in_fan_out": False, "inference_mode": True}, indent=1) + "\n")
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import vllm_tier

    model = sys.argv[2] if len(sys.argv) > 2 else vllm_tier.model_dir()
    print(write_adapter(sys.argv[1], model))
