"""FLOPs, parameter and KV-cache planner: a DLCM against a Llama-style baseline (paper §6.3, Table 3).

Three stages, one module each: `specs` (config fields, presets, reading a config.json), `costs` (parameters,
FLOPs and KV-cache bytes per token) and `search` (`dlcm_like`, `search_dlcm`).

Pure arithmetic on config fields (no torch): parameters, training and inference FLOPs per token and KV-cache
bytes per token for a dense baseline (`BaselineSpec`) and a DLCM (`DLCMSpec`, the fields of `DLCMConfig`),
and `search_dlcm`, which looks for DLCM shapes whose inference FLOPs per token match the baseline's at a
compression ratio R and a concept share P.

Counting conventions (every figure follows them):
- FLOPs: a multiply-add is 2 FLOPs, and only matrix products count: a weight matrix with n entries costs 2·n
  FLOPs per row it multiplies. Norms, activations, softmax, RoPE, bias adds, the router's cosine and
  pooling's mean are left out (O(D) per token each). The embedding lookup is free; the LM head counts.
- Attention map: one query head of dim K against one key costs 2·K (Q·Kᵀ) + 2·K (weights·V) = 4·K FLOPs.
- Inference FLOPs per token: one decoding step at context length L (`context_length`). A self-attention
  layer reads L keys. DLCM's concept stage (W_up on the pooled mean, the concept layers, smoothing and the
  decoder's cross-attention K/V projections) runs once per concept, i.e. 1/R of a run per token, and a
  concept layer reads M = L/R concepts. The decoder's cross-attention reads the counted form: M = L/R
  concept keys (one K/V per concept with its log-count bias; docs/ARCHITECTURE.md, §3.2), not L replicated
  keys. "Without attention map" drops every per-key term.
- Training FLOPs per token: 3 × the forward (backward ≈ 2 × forward) over a causal sequence of L tokens, so a
  query reads (L + 1)/2 keys on average, a concept (M + 1)/2 concepts. The cross-attention is counted in the
  replicated form the training kernel runs (`cross_attention="replicated"`: concept K/V repeated to the L
  token positions, (L + 1)/2 keys per query) or in the counted form (`"counted"`: (M + 1)/2 keys).
- Parameters: every tensor of the model, norms, biases and the null concept included. Embedding parameters
  are the input embedding plus the LM head when it is not tied; non-embedding parameters are the rest.
- Concept share P follows the paper: eq. 22 splits the total parameter count N into N·P for the concept
  model and N·(1 − P) for the rest, so P = (concept layers + concept norm) / total parameters, embeddings
  in the denominator. Table 3's DLCM (`DLCM_PRESETS["dlcm-paper-2.3b"]`) gives P ≈ 0.60, the paper's
  "P = 60%"; its share of the non-embedding parameters would be ≈ 0.73 (`concept_share(spec, of=...)`).
- KV-cache bytes per token: K and V of every token-level self-attention layer per token, plus the concept
  layers' K/V and the decoder's cross-attention K/V once per concept (÷ R per token); `dtype_bytes` per entry.
  `ConceptCache.num_bytes()` also holds per-concept counts and slots and per-row chunk state, left out here.
"""

from .costs import (
    CROSS_ATTENTION_FORMS,
    SHARE_DENOMINATORS,
    CostReport,
    Stage,
    concept_share,
    cost_report,
    cost_stages,
    inference_flops_per_token,
    kv_cache_bytes_per_token,
    parameter_count,
    parameter_groups,
    training_flops_per_token,
)
from .search import Candidate, dlcm_like, search_dlcm
from .specs import DLCM_PRESETS, PRESETS, BaselineSpec, DLCMSpec, load_spec, read_config_json

__all__ = [
    "CROSS_ATTENTION_FORMS",
    "DLCM_PRESETS",
    "PRESETS",
    "SHARE_DENOMINATORS",
    "BaselineSpec",
    "Candidate",
    "CostReport",
    "DLCMSpec",
    "Stage",
    "concept_share",
    "cost_report",
    "cost_stages",
    "dlcm_like",
    "inference_flops_per_token",
    "kv_cache_bytes_per_token",
    "load_spec",
    "parameter_count",
    "parameter_groups",
    "read_config_json",
    "search_dlcm",
    "training_flops_per_token",
]
