"""Encoder-only models (BERT, XLM-RoBERTa) for embeddings and cross-encoder reranking: their
config (``config.py``), typed weights and safetensors loading (``weights.py``), the
bidirectional forward pass over one flat ragged batch of whole sequences (``forward.py``), and
what turns its hidden states into embeddings or scores (``heads.py``). Pure device code: the
runner jits it; nothing here keeps a KV cache."""
