#!/usr/bin/env bash
# vLLM's own unit tests name the hub model facebook/opt-125m for their scheduler configs
# (only its config.json is read; no weights, no tokenizer). CI has no hub: this lays that
# config.json into an offline Hugging Face cache at $1 (use with HF_HOME=$1 HF_HUB_OFFLINE=1).
set -euo pipefail
rev=0000000000000000000000000000000000000000
d="$1/hub/models--facebook--opt-125m"
mkdir -p "$d/snapshots/$rev" "$d/refs"
printf '%s' "$rev" > "$d/refs/main"
cat > "$d/snapshots/$rev/config.json" <<'JSON'
{
  "_name_or_path": "facebook/opt-125m",
  "activation_dropout": 0.0,
  "activation_function": "relu",
  "architectures": ["OPTForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 2,
  "do_layer_norm_before": true,
  "dropout": 0.1,
  "eos_token_id": 2,
  "ffn_dim": 3072,
  "hidden_size": 768,
  "init_std": 0.02,
  "layerdrop": 0.0,
  "max_position_embeddings": 2048,
  "model_type": "opt",
  "num_attention_heads": 12,
  "num_hidden_layers": 12,
  "pad_token_id": 1,
  "prefix": "</s>",
  "torch_dtype": "float16",
  "use_cache": true,
  "vocab_size": 50272,
  "word_embed_proj_dim": 768
}
JSON
