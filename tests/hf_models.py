"""Tiny transformers MoE models, one per family fmoe.integrations.hf converts (random weights, nothing downloaded)."""
import torch
import transformers

VOCAB = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=0, eos_token_id=0)
DEEPSEEK = dict(COMMON, intermediate_size=32, moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=2, first_k_dense_replace=1, n_group=4, topk_group=2, kv_lora_rank=8,
                qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)


def config(family: str):
    experts = dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    if family == "mixtral":
        return transformers.MixtralConfig(**COMMON, **experts)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**COMMON, intermediate_size=32, moe_intermediate_size=24, num_experts=4,
                                           num_experts_per_tok=2, shared_expert_intermediate_size=20)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                           head_dim=8, norm_topk_prob=False)
    if family == "olmoe":
        return transformers.OlmoeConfig(**COMMON, intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    if family == "deepseek_v2":
        return transformers.DeepseekV2Config(**DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy",
                                             routed_scaling_factor=1.5)
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(**DEEPSEEK, q_lora_rank=8, routed_scaling_factor=2.5,
                                             rope_interleave=False)
    if family == "gpt_oss":
        return transformers.GptOssConfig(**COMMON, **experts, head_dim=8, sliding_window=8, swiglu_limit=1.0,
                                         rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    if family == "granitemoe":
        return transformers.GraniteMoeConfig(**COMMON, **experts)
    if family == "granitemoeshared":
        return transformers.GraniteMoeSharedConfig(**COMMON, **experts, shared_intermediate_size=20)
    if family == "phimoe":
        return transformers.PhimoeConfig(**COMMON, **experts)
    if family == "dbrx":
        return transformers.DbrxConfig(d_model=16, n_heads=2, n_layers=2, max_seq_len=64, vocab_size=VOCAB,
                                       pad_token_id=0, bos_token_id=0, eos_token_id=0,
                                       attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0),
                                       ffn_config=dict(ffn_hidden_size=24, moe_num_experts=4, moe_top_k=2))
    if family == "jamba":
        return transformers.JambaConfig(**COMMON, intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                        expert_layer_period=1, expert_layer_offset=0, attn_layer_period=1,
                                        attn_layer_offset=0, use_mamba_kernels=False)
    raise ValueError(family)


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss", "granitemoe",
            "granitemoeshared", "phimoe", "dbrx", "jamba"]


def tiny(family: str, seed: int = 0):
    """The family's tiny causal LM in eval mode, every tensor (routers, biases, correction bias) random,
    so routing has no ties."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(family)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point() and "inv_freq" not in name and "A_log" not in name:
                tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.3)
    return model


def tokens(batch=2, length=7, seed=1):
    return torch.randint(VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
