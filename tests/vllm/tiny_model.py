"""The tiny random Llama the vLLM tests run: written with transformers at test time (no model hub), fixed seed."""

from __future__ import annotations

from pathlib import Path

# The model's KV layout, which the kvpool server of the tests is started with (--num-layers ... --dtype).
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 2, 2, 32, 32, "float32"
VOCAB = 512


def write_tiny_llama(directory: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama (hidden 128, 4 heads, 2 KV heads of 32) saved to ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=NUM_LAYERS,
                         num_attention_heads=4, num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory)
    return directory


def server_layout_args() -> list[str]:
    """The kvpool-server flags of a pool that holds the tiny model's KV."""
    return ["--num-layers", str(NUM_LAYERS), "--num-kv-heads", str(NUM_KV_HEADS), "--head-dim", str(HEAD_DIM),
            "--block-size", str(BLOCK_SIZE), "--dtype", DTYPE]
